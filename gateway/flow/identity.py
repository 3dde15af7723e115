"""Who sent a request and how urgent it is: the tenant and the priority flow control uses.

* **Priority** follows vLLM's ``priority`` field and order: an integer, lower is served
  first, 0 by default. A configured header (``x-kvgate-priority``) overrides the body's.
* **Tenant**: by default the client's API key (``Authorization: Bearer``, else
  ``x-api-key``), hashed with BLAKE2b into ``key:<12 hex>`` so that no key is ever stored;
  without a key, ``anonymous``. With ``tenant_header`` set, that header's value names the
  tenant (truncated to 64 characters); a request without it falls back to the key.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

ANONYMOUS = "anonymous"
MAX_TENANT_CHARS = 64
PRIORITY_LIMIT = 2**31
"""Priorities are clamped to ``[-2**31, 2**31 - 1]`` (vLLM's field is an int)."""


class PriorityError(ValueError):
    """The request's priority is not an integer."""


def key_tenant(key: str) -> str:
    """The tenant name of an API key: a short BLAKE2b digest, never the key itself."""
    digest = hashlib.blake2b(key.encode("utf-8", "replace"), digest_size=6).hexdigest()
    return f"key:{digest}"


def tenant_of(headers: Mapping[str, str], tenant_header: str | None = None) -> str:
    """The tenant of a request from its (lower-cased) headers."""
    if tenant_header:
        named = headers.get(tenant_header.lower(), "").strip()
        if named:
            return named[:MAX_TENANT_CHARS]
    auth = headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return key_tenant(token.strip())
    api_key = headers.get("x-api-key", "").strip()
    if api_key:
        return key_tenant(api_key)
    return ANONYMOUS


def _clamp(value: int) -> int:
    return max(-PRIORITY_LIMIT, min(PRIORITY_LIMIT - 1, value))


def priority_of(
    headers: Mapping[str, str], body: Mapping[str, Any], header: str | None = "x-kvgate-priority"
) -> int:
    """The request's priority: the header's when present, else the body's ``priority``, else 0.

    Raises :class:`PriorityError` for a value that is not an integer.
    """
    if header:
        raw = headers.get(header.lower())
        if raw is not None:
            try:
                return _clamp(int(raw.strip()))
            except ValueError:
                raise PriorityError(f"header {header} must be an integer, got {raw!r}") from None
    value = body.get("priority", 0)
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int):
        raise PriorityError(f"priority must be an integer, got {value!r}")
    return _clamp(value)
