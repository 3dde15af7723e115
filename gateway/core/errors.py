"""One error tree for kvgate.

Each error carries an HTTP status and an OpenAI error ``type`` so the gateway
can render it as ``{"error": {"message", "type", "param", "code"}}``; the CLI
prints the message on one line and exits with :attr:`KvgateError.exit_code`.
"""

from __future__ import annotations


class KvgateError(Exception):
    """Base class: a problem kvgate reports to its user, never a bug."""

    status_code = 500
    error_type = "internal_error"
    exit_code = 1

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class ConfigError(KvgateError):
    """Bad configuration, CLI flag or name (unknown policy, preset, workload)."""

    status_code = 400
    error_type = "invalid_request_error"
    exit_code = 2


class WorkloadError(ConfigError):
    """A trace or workload spec that cannot be read; names file and line."""

    def __init__(self, message: str, *, path: str | None = None, line: int | None = None) -> None:
        where = ""
        if path is not None:
            where = f"{path}:{line}: " if line is not None else f"{path}: "
        super().__init__(where + message)
        self.path = path
        self.line = line


class NoEngineError(KvgateError):
    """No healthy engine can take the request."""

    status_code = 503
    error_type = "service_unavailable"
