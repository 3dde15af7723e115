"""Parse a vLLM ``/metrics`` page into the signals a router uses.

Reads the text format with prometheus_client's parser. Series are summed over
the ``engine`` label (one per DP rank); KV usage takes the fullest rank.
Handles vLLM >= 0.11 names and falls back to the pre-0.11 ``gpu_*`` ones.
``vllm:cache_config_info`` gives the engine's real block size and KV blocks.
``vllm:lora_requests_info`` (an info gauge whose value vLLM sets to the time of
its last update, one series per label set ever seen) gives ``--max-loras`` and
the adapters running and waiting: the series with the latest value is the
engine's state now. At most :data:`MAX_LORA_NAMES` names per list are kept.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from gateway.cluster.registry import EngineMetrics

_SUM = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:prefix_cache_queries": "prefix_queries",
    "vllm:prefix_cache_hits": "prefix_hits",
    "vllm:num_preemptions": "preemptions",
    # vLLM <= 0.10 names (hidden in 0.11, gone in 0.20)
    "vllm:gpu_prefix_cache_queries": "prefix_queries",
    "vllm:gpu_prefix_cache_hits": "prefix_hits",
}
_MAX = {"vllm:kv_cache_usage_perc": "kv_usage", "vllm:gpu_cache_usage_perc": "kv_usage"}


class MetricsParseError(ValueError):
    """The page is not Prometheus text, or has no vLLM metric at all."""


_LORA_INFO = "vllm:lora_requests_info"
MAX_LORA_NAMES = 256
"""Adapters kept per list (running, waiting) of one scrape."""

_WANTED = tuple(sorted({*_SUM, *_MAX, "vllm:cache_config_info", _LORA_INFO}))


def _relevant(text: str) -> str:
    """Only the lines of the families we read: vLLM pages carry hundreds of histogram lines."""
    keep = []
    for line in text.splitlines():
        if line.startswith("#"):
            parts = line.split(" ", 3)
            name = parts[2] if len(parts) > 2 else ""
        else:
            name = line
        if name.startswith(_WANTED):
            keep.append(line)
    return "\n".join(keep) + "\n"


def parse_vllm_metrics(text: str) -> EngineMetrics:
    """The router's signals from one ``/metrics`` page."""
    text = _relevant(text)
    out = EngineMetrics()
    seen = False
    modern_kv = False
    try:
        for family in text_string_to_metric_families(text):
            name = family.name
            if name == "vllm:cache_config_info":
                seen = True
                for sample in family.samples:
                    labels = sample.labels
                    out.hash_algo = labels.get("prefix_caching_hash_algo") or out.hash_algo
                    if "enable_prefix_caching" in labels:
                        out.prefix_caching = labels["enable_prefix_caching"] == "True"
                    out.block_size = _int_label(sample.labels.get("block_size"), out.block_size)
                    out.num_gpu_blocks = _int_label(
                        sample.labels.get("num_gpu_blocks"), out.num_gpu_blocks
                    )
                continue
            if name == _LORA_INFO:
                seen = True
                _read_lora_info(family.samples, out)
                continue
            field = _SUM.get(name)
            if field is not None:
                seen = True
                total = sum(s.value for s in family.samples if s.name in (name, name + "_total"))
                if not (name.startswith("vllm:gpu_prefix") and getattr(out, field)):
                    setattr(out, field, total)
                continue
            field = _MAX.get(name)
            if field is not None:
                seen = True
                if name == "vllm:gpu_cache_usage_perc" and modern_kv:
                    continue
                modern_kv = modern_kv or name == "vllm:kv_cache_usage_perc"
                values = [s.value for s in family.samples if s.name == name]
                if values:
                    out.kv_usage = min(max(*values, 0.0), 1.0)
    except (ValueError, TypeError, IndexError) as exc:
        raise MetricsParseError(f"not a Prometheus text page: {exc}") from None
    if not seen:
        raise MetricsParseError("no vLLM metrics on the page")
    return out


def _read_lora_info(samples: Sequence[Sample], out: EngineMetrics) -> None:
    latest = max(samples, key=lambda s: s.value, default=None)
    if latest is None:
        return
    labels = latest.labels
    out.max_lora = _int_label(labels.get("max_lora"), out.max_lora)
    out.lora_running = _names(labels.get("running_lora_adapters", ""))
    out.lora_waiting = _names(labels.get("waiting_lora_adapters", ""))


def _names(joined: str) -> tuple[str, ...]:
    names = (n.strip() for n in joined.split(","))
    return tuple(n for n in names if n)[:MAX_LORA_NAMES]


def _int_label(raw: str | None, default: int | None) -> int | None:
    if raw is None or raw in ("", "None"):
        return default
    try:
        return int(float(raw))
    except ValueError:
        return default
