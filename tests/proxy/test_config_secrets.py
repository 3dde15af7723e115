"""Secrets in the settings: empty keys are refused rather than matching an empty header."""

from __future__ import annotations

import pytest

from gateway.config import load_settings
from gateway.core.errors import ConfigError


@pytest.mark.parametrize("field", [{"admin_key": ""}, {"admin_key": "  "}, {"api_keys": ["a", ""]}])
def test_empty_keys_are_configuration_errors(field: dict[str, object]) -> None:
    with pytest.raises(ConfigError, match="must not be empty"):
        load_settings(engines=[{"url": "http://127.0.0.1:9"}], **field)


def test_empty_admin_key_from_the_environment_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGATE_ADMIN_KEY", "")
    with pytest.raises(ConfigError, match="must not be empty"):
        load_settings(engines=[{"url": "http://127.0.0.1:9"}])
