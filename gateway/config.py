"""Gateway configuration: a YAML file, overridden by ``KVGATE_*`` environment variables,
overridden by command-line flags.

Environment variables use ``__`` for nesting, e.g. ``KVGATE_PORT=9000``,
``KVGATE_POLICY__NAME=least_loaded``, ``KVGATE_TIMEOUTS__READ_S=900``;
lists and maps take JSON: ``KVGATE_ENGINES='[{"url": "http://10.0.0.5:8000"}]'``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    InitSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from gateway import config_sessions
from gateway.config_flow import FlowControlConfig
from gateway.core.errors import ConfigError
from gateway.tracing.config import TracingConfig

Role = Literal["both", "prefill", "decode"]


_Strict = config_sessions.Strict
SessionsConfig = config_sessions.SessionsConfig
ResponsesConfig = config_sessions.ResponsesConfig


class EngineConfig(_Strict):
    """One upstream engine (a vLLM OpenAI server or ``kvgate emulate``)."""

    url: str
    role: Role = "both"
    model: str | None = Field(
        default=None, description="served model name; discovered from /v1/models when unset"
    )
    api_key: SecretStr | None = Field(default=None, description="sent as Bearer to the engine")

    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        value = value.strip().rstrip("/")
        if not value.startswith(("http://", "https://")) or len(value) <= len("http://"):
            raise ValueError(f"engine url must start with http:// or https://, got {value!r}")
        return value


class SloConfig(_Strict):
    """A service level: TTFT and TPOT targets in seconds."""

    ttft_s: float = Field(gt=0)
    tpot_s: float = Field(gt=0)


def _default_slos() -> dict[str, SloConfig]:
    return {
        "interactive": SloConfig(ttft_s=1.0, tpot_s=0.05),
        "standard": SloConfig(ttft_s=5.0, tpot_s=0.1),
        "batch": SloConfig(ttft_s=60.0, tpot_s=0.5),
    }


class PDConfig(_Strict):
    """Conditional disaggregation: when a request's prefill runs on the prefill pool
    (docs/disaggregation.md; the rule of :mod:`gateway.policies.pd_rule`)."""

    min_uncached_tokens: int = Field(
        default=16, ge=0, description="local prefill below this many uncached tokens (llm-d)"
    )
    max_local_tokens: int = Field(
        default=2048,
        ge=0,
        description="local prefill only below this many uncached tokens... (Dynamo, with:)",
    )
    max_local_ratio: float = Field(
        default=0.7, ge=0, le=1, description="...and below this uncached share of the prompt"
    )
    saturation_wait_s: float = Field(
        default=1.0,
        gt=0,
        description="local prefill when the prefill pool's predicted wait is longer (seconds)",
    )


DEFAULT_POLICY = "predicted_ttft"
"""The policy of ``kvgate serve``, ``kvgate demo`` and the simulator when none is named: the
winner of ``python -m benchmarks.quality.evaluate suite`` (docs/evaluation.md#suite)."""


class PolicyConfig(_Strict):
    name: str = DEFAULT_POLICY
    options: dict[str, Any] = Field(default_factory=dict)


class TimeoutConfig(_Strict):
    """Upstream timeouts in seconds. ``read_s`` bounds the gap between two stream chunks
    (and the wait for a non-streamed answer), so it must outlast the longest prefill."""

    connect_s: float = Field(default=5.0, gt=0)
    read_s: float = Field(default=600.0, gt=0)
    write_s: float = Field(default=30.0, gt=0)
    pool_s: float = Field(default=10.0, gt=0)


class RetryConfig(_Strict):
    """Retries of failures before the first byte reached the client, on another engine."""

    max_attempts: int = Field(default=3, ge=1, le=10)
    backoff_s: float = Field(default=0.05, ge=0)
    backoff_max_s: float = Field(default=1.0, ge=0)
    budget_ratio: float = Field(
        default=0.2, ge=0, description="retries may add this share of the requests (window)"
    )
    budget_min_per_s: float = Field(
        default=3.0, ge=0, description="retries allowed per second on top of the ratio"
    )
    budget_window_s: float = Field(default=10.0, gt=0, description="the budget's sliding window")


class HealthConfig(_Strict):
    """Active probing (``/health``) and metric scraping (``/metrics``) of every engine."""

    interval_s: float = Field(default=1.0, gt=0)
    timeout_s: float = Field(default=2.0, gt=0)
    models_refresh_s: float = Field(
        default=5.0,
        gt=0,
        description="re-read each engine's /v1/models (LoRA adapters loaded at runtime) this often",
    )
    failure_threshold: int = Field(default=2, ge=1)
    recovery_threshold: int = Field(default=1, ge=1)
    cooldown_s: float = Field(default=5.0, ge=0, description="minimum time out after a failure")
    cooldown_max_s: float = Field(
        default=60.0, ge=0, description="cap of the doubling cooldown of repeated trips"
    )
    cooldown_jitter: float = Field(default=0.2, ge=0, lt=1, description="cooldown × (1 ± this)")
    failure_rate: float = Field(
        default=0.5, gt=0, le=1, description="open when this share of the window's requests fail"
    )
    failure_rate_window_s: float = Field(default=10.0, gt=0)
    failure_rate_min_requests: int = Field(
        default=20, ge=1, description="outcomes in the window before the rate counts"
    )
    half_open_requests: int = Field(
        default=1, ge=1, description="trial requests at once to an engine whose cooldown ended"
    )


class RecordConfig(_Strict):
    """Traffic recording (``kvgate serve --record PATH``): one Mooncake-format JSON line per
    request, prompt-free, with salted block hashes (docs/gateway.md#recording-traffic)."""

    path: str | None = Field(default=None, description="the recording file; unset: off")
    max_bytes: int = Field(
        default=100 * 1024 * 1024, ge=4096, description="rotate PATH past this size"
    )
    backups: int = Field(default=5, ge=0, le=1000, description="rotated files kept: PATH.1..N")
    salt: SecretStr | None = Field(
        default=None,
        description="key of the hash-id salt; unset: random per process (recordings of two "
        "processes then share no ids)",
    )
    queue_size: int = Field(
        default=10_000, ge=1, description="records waiting for the writer; then dropped"
    )

    @field_validator("salt")
    @classmethod
    def _check_salt(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and not value.get_secret_value().strip():
            raise ValueError("record.salt must not be empty (unset it for a random one)")
        return value


class DecisionLogConfig(_Strict):
    """Decision recording: every policy call (inputs, answers, hooks) kept in memory, in
    order, for ``GET /admin/decisions`` and replay (docs/gateway.md#decision-log)."""

    enabled: bool = Field(default=False, description="record the policy's calls")
    max_bytes: int = Field(
        default=64 * 1024 * 1024, ge=1024, description="estimated memory bound; then stops"
    )


class RateLimitConfig(_Strict):
    """Per-client request rate limits on ``/v1/*``: one token bucket per client API key, or
    per client IP; off unless ``requests_per_s`` is set (docs/security.md)."""

    requests_per_s: float | None = Field(
        default=None, gt=0, description="sustained requests per second per client; unset: off"
    )
    burst: int | None = Field(
        default=None, ge=1, description="requests a client may send at once; default: the rate"
    )
    per: Literal["key", "ip"] = Field(
        default="key",
        description="key: per client API key (per client IP when no api_keys are set); ip: "
        "per client IP",
    )
    max_buckets: int = Field(
        default=100_000, ge=1, description="clients tracked at once; least recently seen dropped"
    )


_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


def _dns_label(value: str | None, what: str) -> str | None:
    if value is not None and not _DNS_LABEL.match(value):
        raise ValueError(f"{what} must be a DNS label (lowercase a-z, 0-9, '-'), got {value!r}")
    return value


class KubeServiceConfig(_Strict):
    """A Kubernetes Service whose ready endpoints become engines (one discovery source)."""

    name: str = Field(description="the Service; its EndpointSlices carry this name as label")
    namespace: str | None = Field(default=None, description="default: discovery.namespace")
    port_name: str | None = Field(default=None, description="the named port of the slices")
    port: int | None = Field(default=None, ge=1, le=65535, description="a fixed port instead")
    role: Role = "both"
    model: str | None = Field(default=None, description="served model; else from /v1/models")
    api_key: SecretStr | None = Field(default=None, description="sent as Bearer to the engines")
    scheme: Literal["http", "https"] = "http"

    @field_validator("name", "namespace")
    @classmethod
    def _check_label(cls, value: str | None) -> str | None:
        return _dns_label(value, "a Service name or namespace")

    @model_validator(mode="after")
    def _one_port(self) -> KubeServiceConfig:
        if self.port is not None and self.port_name is not None:
            raise ValueError("set port_name or port, not both")
        return self


class InferencePoolConfig(_Strict):
    """A Gateway API Inference Extension ``InferencePool`` (``inference.networking.k8s.io/v1``)
    whose selected Ready pods become engines, one per pod and target port."""

    name: str = Field(description="the InferencePool")
    namespace: str | None = Field(default=None, description="default: discovery.namespace")
    role_label: str | None = Field(
        default="llm-d.ai/role",
        description="pod label naming an engine's P/D role (prefill, decode, both); unset: both",
    )
    model: str | None = Field(default=None, description="served model; else from /v1/models")
    api_key: SecretStr | None = Field(default=None, description="sent as Bearer to the engines")
    scheme: Literal["http", "https"] = "http"

    @field_validator("name", "namespace")
    @classmethod
    def _check_label(cls, value: str | None) -> str | None:
        return _dns_label(value, "an InferencePool name or namespace")


class DiscoveryConfig(_Strict):
    """Where engines come from besides ``engines``: nowhere (static), Kubernetes
    EndpointSlices, or an InferencePool's pods, watched (or polled) through the API server."""

    kind: Literal["static", "kubernetes", "inferencepool"] = "static"
    namespace: str | None = Field(
        default=None, description="default namespace of services: the pod's own, else 'default'"
    )
    services: list[KubeServiceConfig] = Field(default_factory=list)
    pool: InferencePoolConfig | None = Field(default=None, description="kind: inferencepool")
    watch: bool = Field(default=True, description="watch the API objects; false: poll them")
    interval_s: float = Field(default=10.0, gt=0, description="poll period (watch: false)")
    resync_s: float = Field(default=300.0, gt=0, description="a watch runs this long, relist")
    api_server: str | None = Field(
        default=None, description="default: https://$KUBERNETES_SERVICE_HOST:$..._PORT"
    )
    token_file: str = "/var/run/secrets/kubernetes.io/serviceaccount/token"
    ca_file: str = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"
    timeout_s: float = Field(default=10.0, gt=0, description="API request timeout")
    backoff_s: float = Field(default=1.0, gt=0, description="first retry delay after an error")
    backoff_max_s: float = Field(default=30.0, gt=0)

    @field_validator("namespace")
    @classmethod
    def _check_namespace(cls, value: str | None) -> str | None:
        return _dns_label(value, "discovery.namespace")

    @field_validator("api_server")
    @classmethod
    def _check_api_server(cls, value: str | None) -> str | None:
        if value is not None:
            value = value.strip().rstrip("/")
            if not value.startswith(("http://", "https://")):
                raise ValueError(f"api_server must start with http:// or https://, got {value!r}")
        return value

    @model_validator(mode="after")
    def _check(self) -> DiscoveryConfig:
        if self.kind == "kubernetes" and not self.services:
            raise ValueError("discovery kind kubernetes needs at least one entry in services")
        if self.kind != "kubernetes" and self.services:
            raise ValueError("discovery.services is only used with kind: kubernetes")
        if (self.kind == "inferencepool") != (self.pool is not None):
            raise ValueError("discovery.pool is set exactly when kind is inferencepool")
        keys = [(s.namespace or self.namespace, s.name) for s in self.services]
        if len(set(keys)) != len(keys):
            raise ValueError("a Service is listed twice in discovery.services")
        return self


class ReplicaSyncConfig(_Strict):
    """Replica load sync (docs/deployment.md#several-replicas): each gateway replica
    publishes its per-engine in-flight requests and pending prefill tokens on a NATS
    subject and adds its peers' to its own; every replica of a group uses the same
    ``nats_url`` and ``subject``."""

    nats_url: str | None = Field(
        default=None, description="NATS server, e.g. nats://nats:4222; unset: off"
    )
    subject: str = Field(default="kvgate.load", min_length=1, description="one per gateway group")
    interval_s: float = Field(
        default=0.02,
        gt=0,
        description="check for finished requests this often (routing publishes at once)",
    )
    heartbeat_s: float = Field(default=1.0, gt=0, description="publish at least this often")
    ttl_s: float = Field(default=3.0, gt=0, description="drop a peer silent this long")
    replica_id: str | None = Field(
        default=None, description="this replica's name; default host-pid-random (unique)"
    )

    @model_validator(mode="after")
    def _check(self) -> ReplicaSyncConfig:
        if self.nats_url is not None and not self.nats_url.startswith(("nats://", "tls://")):
            raise ValueError(f"nats_url must start with nats:// or tls://, got {self.nats_url!r}")
        if self.ttl_s <= self.heartbeat_s:
            raise ValueError("replica_sync.ttl_s must exceed heartbeat_s")
        return self


class Settings(BaseSettings):
    """Everything ``kvgate serve`` needs."""

    model_config = SettingsConfigDict(
        env_prefix="KVGATE_", env_nested_delimiter="__", extra="forbid", frozen=True
    )

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    engines: list[EngineConfig] = Field(default_factory=list)
    discovery: DiscoveryConfig = Field(default_factory=DiscoveryConfig)
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    slo_classes: dict[str, SloConfig] = Field(default_factory=_default_slos)
    default_slo_class: str = Field(
        default="standard", description="SLO class of requests without x-kvgate-slo-class"
    )
    pd: PDConfig = Field(default_factory=PDConfig)
    block_size: int | None = Field(
        default=None,
        ge=1,
        description="engine KV block size in tokens; unset: the engines' own (from "
        "vllm:cache_config_info), 16 until one reports",
    )
    keying: Literal["text", "tokens"] = Field(
        default="text",
        description="routing key: text chunks, or the engine's own tokens hashed as vLLM does "
        "(one /tokenize call per request; needed for kv_events)",
    )
    vllm_hash_seed: str | None = Field(
        default=None, description="the engines' PYTHONHASHSEED, when they pin one (token keys)"
    )
    kv_events: bool = Field(
        default=False,
        description="subscribe to each engine's KV events (GET /kv_event_sources); needs keying "
        "'tokens' so routing keys and engine block ids agree",
    )
    chars_per_token: float = Field(
        default=4.0, gt=0, description="text chunk = block tokens x this"
    )
    seed: int = 0
    preset: str = Field(
        default="llama3-8b-h100",
        description="engine performance preset (name or file) for cost-aware policies",
    )
    api_keys: list[SecretStr] = Field(default_factory=list, description="client keys (Bearer)")
    admin_key: SecretStr | None = None
    max_body_bytes: int = Field(default=8 * 1024 * 1024, ge=1024)
    max_header_bytes: int = Field(
        default=64 * 1024,
        ge=4096,
        description="request line and headers larger than this get 431 (kvgate serve)",
    )
    rate_limit: RateLimitConfig = Field(default_factory=RateLimitConfig)
    queue_timeout_s: float = Field(
        default=300.0, gt=0, description="longest a request may wait in a router queue"
    )
    max_queued: int = Field(default=10_000, ge=1, description="router queue bound (then 429)")
    max_in_flight: int | None = Field(
        default=None,
        ge=1,
        description="proxied requests in the gateway at once (held ones too); more get 503 "
        "with Retry-After; unset: no cap",
    )
    shutdown_grace_s: int = Field(
        default=30, ge=0, description="on SIGTERM, seconds open requests (streams) may finish"
    )
    timeouts: TimeoutConfig = Field(default_factory=TimeoutConfig)
    retries: RetryConfig = Field(default_factory=RetryConfig)
    health: HealthConfig = Field(default_factory=HealthConfig)
    max_connections: int = Field(default=1000, ge=1)
    expose_engine_header: bool = Field(default=True, description="X-Kvgate-Engine on responses")
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_requests: bool = True
    record: RecordConfig = Field(default_factory=RecordConfig)
    replica_sync: ReplicaSyncConfig = Field(default_factory=ReplicaSyncConfig)
    sessions: SessionsConfig = Field(default_factory=SessionsConfig)
    responses: ResponsesConfig = Field(default_factory=ResponsesConfig)
    decision_log: DecisionLogConfig = Field(default_factory=DecisionLogConfig)
    tracing: TracingConfig = Field(default_factory=TracingConfig)
    flow_control: FlowControlConfig = Field(default_factory=FlowControlConfig)

    @model_validator(mode="after")
    def _check(self) -> Settings:
        if self.kv_events and self.keying != "tokens":
            raise ValueError("kv_events needs keying: tokens (engine block ids are token hashes)")
        keys = [*self.api_keys, *([self.admin_key] if self.admin_key is not None else [])]
        if any(not k.get_secret_value().strip() for k in keys):
            raise ValueError("api_keys and admin_key must not be empty (unset them instead)")
        if self.default_slo_class not in self.slo_classes:
            raise ValueError(f"default_slo_class {self.default_slo_class!r} is not in slo_classes")
        return self


def load_settings(config_path: str | Path | None = None, **overrides: Any) -> Settings:
    """Settings from ``config_path`` (YAML), then the environment, then ``overrides``."""
    data: dict[str, Any] = {}
    if config_path is not None:
        path = Path(config_path)
        try:
            loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"config {path} is not valid YAML: {exc}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config {path} must be a mapping at the top level")
        data = loaded or {}

    class _Bound(Settings):
        @classmethod
        def settings_customise_sources(
            cls,
            settings_cls: type[BaseSettings],
            init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource,
            dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource,
        ) -> tuple[PydanticBaseSettingsSource, ...]:
            return (init_settings, env_settings, InitSettingsSource(settings_cls, data))

    overrides = {k: v for k, v in overrides.items() if v is not None}
    try:
        return _Bound(**overrides)
    except ValidationError as exc:
        raise ConfigError(f"invalid configuration: {_first_error(exc)}") from None


def _first_error(exc: ValidationError) -> str:
    errors = exc.errors()
    first = errors[0]
    where = ".".join(str(p) for p in first.get("loc", ())) or "settings"
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{where}: {first.get('msg', 'invalid')}{more}"
