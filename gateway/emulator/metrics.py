"""vLLM's Prometheus metrics for one emulated engine, on a registry the app owns.

Names, types, label sets, HELP texts and buckets follow a real vLLM 0.3x
``/metrics`` dump (every series has ``model_name`` and ``engine``;
``vllm:cache_config_info`` has ``engine`` and the cache fields). Gauges are
read from the :class:`EngineCore` at scrape time; counters and histograms are
fed by the driver's events. Latencies are in the engine's *virtual* seconds,
which equal wall seconds at ``time_scale=1``. Decode legs of P/D requests
waiting for their KV transfer count as waiting with reason ``deferred``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.emulator.driver import GenerationHandle
from gateway.perfmodel.engine import EngineCore, StepOutcome

_LABELS = ("model_name", "engine")
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
         7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
_ITL = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
        10.0, 20.0, 40.0, 80.0)  # fmt: skip
_LATENCY = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
            120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
_ITERATION = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def token_buckets(max_value: int) -> list[float]:
    """vLLM's 1-2-5 series of token-count buckets, up to ``max_value``."""
    out: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            value = m * scale
            if value > max_value:
                return out
            out.append(float(value))
        scale *= 10


class _EngineState(Collector):
    """Gauges and the preemption counter, read from the engine at scrape time."""

    def __init__(self, core: EngineCore, labels: list[str], deferred: Callable[[], int]) -> None:
        self.core = core
        self.labels = labels
        self.deferred = deferred

    def collect(self) -> Iterable[Metric]:
        core, labels, names = self.core, self.labels, list(_LABELS)
        deferred = self.deferred()
        for name, doc, value in (
            ("running", "Number of requests in model execution batches.", core.num_running),
            ("waiting", "Number of requests waiting to be processed.", core.num_waiting + deferred),
        ):
            g = GaugeMetricFamily(f"vllm:num_requests_{name}", doc, labels=names)
            g.add_metric(labels, value)
            yield g
        g = GaugeMetricFamily(
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for "
            "scheduling capacity; 'deferred' = deferred by transient constraints (LoRA budget, "
            "KV transfer, blocked status). Sum of all reasons equals vllm:num_requests_waiting.",
            labels=[*names, "reason"],
        )
        g.add_metric([*labels, "capacity"], core.num_waiting)
        g.add_metric([*labels, "deferred"], deferred)
        yield g
        g = GaugeMetricFamily(
            "vllm:engine_sleep_state",
            "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is "
            "awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep "
            "level 2.",
            labels=[*names, "sleep_state"],
        )
        for state, value in (("awake", 1), ("weights_offloaded", 0), ("discard_all", 0)):
            g.add_metric([*labels, state], value)
        yield g
        g = GaugeMetricFamily(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labels=names
        )
        g.add_metric(labels, core.kv_usage)
        yield g
        c = CounterMetricFamily(
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine.",
            labels=names,
        )
        c.add_metric(labels, core.preemptions)
        yield c


class EmulatorMetrics:
    """The engine's Prometheus series; implements the driver's observer protocol."""

    def __init__(
        self,
        registry: CollectorRegistry,
        core: EngineCore,
        *,
        model_name: str,
        engine: str,
        cache_info: dict[str, str],
        deferred: Callable[[], int] = lambda: 0,
    ) -> None:
        lv = [model_name, engine]
        r = registry
        r.register(_EngineState(core, lv, deferred))

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, _LABELS, registry=r).labels(*lv)

        def hist(name: str, doc: str, buckets: Iterable[float]) -> Histogram:
            return Histogram(name, doc, _LABELS, registry=r, buckets=tuple(buckets)).labels(*lv)

        tok = token_buckets(core.model.max_model_len)
        self.queries = counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
        )
        self.hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        self.ext_queries = counter(
            "vllm:external_prefix_cache_queries",
            "External prefix cache queries from KV connector cross-instance cache sharing, "
            "in terms of number of queried tokens.",
        )
        self.ext_hits = counter(
            "vllm:external_prefix_cache_hits",
            "External prefix cache hits from KV connector cross-instance cache sharing, "
            "in terms of number of cached tokens.",
        )
        self.prompt = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        by_source = Counter(
            "vllm:prompt_tokens_by_source",
            "Number of prompt tokens by source.",
            [*_LABELS, "source"],
            registry=r,
        )
        self.computed = by_source.labels(*lv, "local_compute")
        self.cache_hit = by_source.labels(*lv, "local_cache_hit")
        self.external = by_source.labels(*lv, "external_kv_transfer")
        self.cached = counter(
            "vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external)."
        )
        self.generation = counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        )
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*_LABELS, "finished_reason"],
            registry=r,
        )
        self.success = {reason: success.labels(*lv, reason) for reason in FINISH_REASONS}
        self.req_prompt = hist(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", tok
        )
        self.req_gen = hist(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", tok
        )
        self.iteration = hist(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            _ITERATION,
        )
        self.max_gen = hist(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            tok,
        )
        self.params_n = hist(
            "vllm:request_params_n", "Histogram of the n request parameter.", (1, 2, 5, 10, 20)
        )
        self.params_max = hist(
            "vllm:request_params_max_tokens",
            "Histogram of the max_tokens request parameter.",
            tok,
        )
        self.ttft = hist(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            _TTFT,
        )
        self.itl = hist(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", _ITL
        )
        self.tpot = hist(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            _ITL,
        )
        self.e2e = hist(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            _LATENCY,
        )
        phase = "Histogram of time spent in {} phase for request."
        self.queue = hist("vllm:request_queue_time_seconds", phase.format("WAITING"), _LATENCY)
        self.inference = hist(
            "vllm:request_inference_time_seconds", phase.format("RUNNING"), _LATENCY
        )
        self.prefill = hist("vllm:request_prefill_time_seconds", phase.format("PREFILL"), _LATENCY)
        self.decode = hist("vllm:request_decode_time_seconds", phase.format("DECODE"), _LATENCY)
        self.preemptions = hist(
            "vllm:request_num_preemptions",
            "Histogram of the number of times a request was preempted.",
            (1, 2, 3, 4, 5, 10, 20),
        )
        self.kv_computed = hist(
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            tok,
        )
        info = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            ["engine", *sorted(cache_info)],
            registry=r,
        )
        info.labels(engine, *(cache_info[k] for k in sorted(cache_info))).set(1)

    # -- DriverObserver ---------------------------------------------------------------
    def on_scheduled(self, handle: GenerationHandle) -> None:
        req = handle.req
        self.queries.inc(req.prompt_tokens)
        self.hits.inc(handle.local_hits)
        if req.remote_tokens > 0:
            self.ext_queries.inc(req.prompt_tokens)
            self.ext_hits.inc(req.external_tokens)
        if req.first_scheduled is not None:
            self.queue.observe(max(0.0, req.first_scheduled - req.arrival))

    def on_step(self, outcome: StepOutcome) -> None:
        tokens = outcome.prefill_tokens + outcome.decode_tokens
        if tokens:
            self.iteration.observe(tokens)

    def on_tokens(self, handle: GenerationHandle, count: int, gap: float | None) -> None:
        self.generation.inc(count)
        req = handle.req
        if gap is None:  # the first token: the prompt is done
            local, external = handle.local_hits, req.external_tokens
            computed = req.prompt_tokens - local - external
            self.prompt.inc(req.prompt_tokens)
            self.computed.inc(computed)
            self.cache_hit.inc(local)
            self.external.inc(external)
            self.cached.inc(local + external)
            self.kv_computed.observe(computed)
            if req.first_token_time is not None:
                self.ttft.observe(max(0.0, req.first_token_time - req.arrival))
        else:
            self.itl.observe(gap / count)

    def on_finished(self, handle: GenerationHandle, reason: str, now: float) -> None:
        self.success.get(reason, self.success["error"]).inc()
        req = handle.req
        self.req_prompt.observe(req.prompt_tokens)
        self.req_gen.observe(handle.produced)
        self.max_gen.observe(handle.max_tokens)
        self.params_max.observe(handle.max_tokens)
        self.params_n.observe(1)
        self.preemptions.observe(req.preemptions)
        self.e2e.observe(max(0.0, now - req.arrival))
        first, scheduled = req.first_token_time, req.first_scheduled
        if scheduled is not None:
            self.inference.observe(max(0.0, now - scheduled))
        if first is not None and scheduled is not None:
            self.prefill.observe(max(0.0, first - scheduled))
            self.decode.observe(max(0.0, now - first))
            if handle.produced > 1:
                self.tpot.observe((now - first) / (handle.produced - 1))
