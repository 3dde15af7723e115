"""Performance presets: data files (YAML or JSON) that build a :class:`PerfModel`.

Built-in presets live in ``gateway/perfmodel/presets/``; a path to a file of
the same shape works anywhere a preset name does.
"""

from __future__ import annotations

import dataclasses
import json
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from gateway.core.errors import ConfigError
from gateway.perfmodel.model import PerfModel

DEFAULT_PRESET = "mistral-7b-a6000"
_FIELDS = {f.name for f in dataclasses.fields(PerfModel)}


def available_presets() -> list[str]:
    """Names of the built-in presets, sorted."""
    root = resources.files("gateway.perfmodel") / "presets"
    return sorted(p.name.rsplit(".", 1)[0] for p in root.iterdir() if p.name.endswith(".yaml"))


def load_preset(name_or_path: str) -> PerfModel:
    """A built-in preset by name, or a preset file by path."""
    path = Path(name_or_path)
    if path.suffix in {".yaml", ".yml", ".json"} or path.is_file():
        if not path.is_file():
            raise ConfigError(f"preset file not found: {name_or_path}")
        return preset_from_text(path.read_text(encoding="utf-8"), source=str(path))
    root = resources.files("gateway.perfmodel") / "presets"
    item = root / f"{name_or_path}.yaml"
    if not item.is_file():
        known = ", ".join(available_presets())
        raise ConfigError(f"unknown preset {name_or_path!r} (known: {known})")
    return preset_from_text(item.read_text(encoding="utf-8"), source=name_or_path)


def preset_from_text(text: str, *, source: str) -> PerfModel:
    try:
        data = json.loads(text) if text.lstrip().startswith("{") else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"preset {source}: not valid YAML/JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"preset {source}: expected a mapping of fields")
    return preset_from_dict(data, source=source)


def preset_from_dict(data: dict[str, Any], *, source: str) -> PerfModel:
    unknown = sorted(set(data) - _FIELDS)
    if unknown:
        raise ConfigError(f"preset {source}: unknown field(s) {', '.join(unknown)}")
    if "name" not in data:
        data = {**data, "name": Path(source).stem}
    if "sources" in data:
        data = {**data, "sources": tuple(str(s) for s in data["sources"] or ())}
    try:
        return PerfModel(**data)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"preset {source}: {exc}") from None


def preset_to_dict(model: PerfModel) -> dict[str, Any]:
    out = dataclasses.asdict(model)
    out["sources"] = list(model.sources)
    return out
