"""The official clients through a real ``kvgate serve`` in front of emulated engines: the
``openai`` SDK (Responses two-turn conversations, embeddings), the ``anthropic`` SDK
(Messages, count_tokens), LoRA adapters found at runtime and cache salts."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from procs import MODEL, Proc, start_emulator, start_gateway

from tests.promtext import sample_sum

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

pytestmark = pytest.mark.e2e

EMBED = "e2e-embed"
EVENTS = [  # KV events on: the engine reports sha256 block ids, which kvgate reproduces
    "--kv-events-config",
    '{"enable_kv_cache_events":true,"endpoint":"tcp://127.0.0.1:0",'
    '"replay_endpoint":"tcp://127.0.0.1:0"}',
]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, list[Proc]]]:
    logdir = tmp_path_factory.mktemp("api")
    lora = ["--enable-lora", "--max-loras", "2", "--allow-runtime-lora"]
    procs: list[Proc] = []
    try:
        procs = [
            start_emulator(
                logdir,
                0,
                extra=[*lora, "--lora-modules", "ad-a=/adapters/a", *EVENTS],
            ),
            start_emulator(logdir, 1, extra=lora),
            start_emulator(
                logdir, 2, extra=["--runner", "pooling", "--model", EMBED], name="embed"
            ),
        ]
        gateway = start_gateway(
            logdir,
            [p.url for p in procs],
            policy="round_robin",
            extra=["--config", str(_config(logdir))],
        )
        procs.append(gateway)
        yield gateway, procs[:3]
    finally:
        for p in procs:
            p.stop()


def _config(logdir: Path) -> Path:
    path = logdir / "kvgate.yaml"
    path.write_text("health: {interval_s: 0.2, models_refresh_s: 0.5}\n")
    return path


@pytest.mark.parametrize("stream", [False, True])
def test_responses_follow_ups_reach_the_engine_that_stored_them(
    fleet: tuple[Proc, list[Proc]], stream: bool
) -> None:
    gateway, _ = fleet
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="none", max_retries=0)
    first_raw = client.responses.with_raw_response.create(
        model=MODEL, input="Tell me about KV caches.", max_output_tokens=8
    )
    first = first_raw.parse()
    owner = first_raw.headers["x-kvgate-engine"]
    previous = first.id
    for turn in range(3):  # round robin alone would alternate between the two engines
        if stream:
            events = list(
                client.responses.create(
                    model=MODEL,
                    input=f"And then? ({turn})",
                    previous_response_id=previous,
                    stream=True,
                    max_output_tokens=8,
                )
            )
            done = [e for e in events if e.type == "response.completed"]
            assert done, [e.type for e in events]
            previous = done[0].response.id
        else:
            raw = client.responses.with_raw_response.create(
                model=MODEL,
                input=f"And then? ({turn})",
                previous_response_id=previous,
                max_output_tokens=8,
            )
            assert raw.headers["x-kvgate-engine"] == owner
            previous = raw.parse().id
    got = client.responses.retrieve(previous)
    assert got.id == previous
    assert got.previous_response_id is not None
    direct = httpx.get(f"{owner}/v1/responses/{previous}", timeout=5)
    assert direct.status_code == 200  # the last turn is stored on the first turn's engine


def test_anthropic_sdk_messages_stream_and_not(fleet: tuple[Proc, list[Proc]]) -> None:
    gateway, _ = fleet
    client = anthropic.Anthropic(base_url=gateway.url, api_key="none", max_retries=0)
    message = client.messages.create(
        model=MODEL,
        max_tokens=8,
        system="You are terse.",
        messages=[{"role": "user", "content": "Hello"}],
    )
    assert message.type == "message" and message.usage.output_tokens > 0
    with client.messages.stream(
        model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "Hello"}]
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.usage.output_tokens > 0
    counted = client.messages.count_tokens(
        model=MODEL, messages=[{"role": "user", "content": "Hello"}]
    )
    assert counted.input_tokens > 0
    with pytest.raises(anthropic.NotFoundError) as missing:  # kvgate's error, Anthropic-shaped
        client.messages.create(
            model="no-such-model", max_tokens=8, messages=[{"role": "user", "content": "x"}]
        )
    assert missing.value.body["type"] == "error"  # type: ignore[index]


def test_embeddings_go_to_the_pooling_engine(fleet: tuple[Proc, list[Proc]]) -> None:
    gateway, _ = fleet
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="none", max_retries=0)
    out = client.embeddings.create(model=EMBED, input=["kv caches", "routing"])
    assert len(out.data) == 2 and len(out.data[0].embedding) > 0
    tokens = httpx.post(gateway.url + "/tokenize", json={"model": MODEL, "prompt": "hi there"})
    assert tokens.status_code == 200 and tokens.json()["count"] > 0


def test_an_adapter_loaded_at_runtime_becomes_routable(fleet: tuple[Proc, list[Proc]]) -> None:
    gateway, engines = fleet
    body = {"model": "ad-late", "prompt": "hello", "max_tokens": 2}
    before = httpx.post(gateway.url + "/v1/completions", json=body, timeout=10)
    assert before.status_code == 404
    loaded = httpx.post(
        engines[1].url + "/v1/load_lora_adapter",
        json={"lora_name": "ad-late", "lora_path": "/adapters/late"},
        timeout=10,
    )
    assert loaded.status_code == 200, loaded.text
    deadline = time.monotonic() + 30  # the models refresh runs every 0.5 s
    with httpx.Client(timeout=10) as client:
        while True:
            r = client.post(gateway.url + "/v1/completions", json=body)
            if r.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.05)  # polling for the condition: the refresh is on the gateway's timer
        assert r.status_code == 200, r.text
        assert r.headers["x-kvgate-engine"] == engines[1].url
        models = client.get(gateway.url + "/v1/models").json()["data"]
    (card,) = [m for m in models if m["id"] == "ad-late"]
    assert card["parent"] == MODEL


def test_salted_and_adapter_prompts_are_not_credited_as_hits(
    fleet: tuple[Proc, list[Proc]], tmp_path: Path
) -> None:
    _, engines = fleet
    # the default policy credits cached prefixes (round robin credits none)
    gateway = start_gateway(tmp_path, [e.url for e in engines], policy="predicted_ttft")
    try:
        _no_hit_across_partitions(gateway)
    finally:
        gateway.stop()


def _no_hit_across_partitions(gateway: Proc) -> None:
    prompt = "A long shared system prompt for every tenant. " * 40

    def hits() -> float:
        text = httpx.get(gateway.url + "/metrics", timeout=5).text
        return sample_sum(text, "kvgate_routed_expected_hit_tokens_total")

    with httpx.Client(timeout=10) as client:
        client.post(
            gateway.url + "/v1/completions",
            json={"model": MODEL, "prompt": prompt, "max_tokens": 1},
        )
        start = hits()
        for body in (
            {"cache_salt": "tenant-1"},
            {"cache_salt": "tenant-2"},
            {"model": "ad-a"},
        ):
            r = client.post(
                gateway.url + "/v1/completions",
                json={"model": MODEL, "prompt": prompt, "max_tokens": 1, **body},
            )
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert hits() == start  # kvgate predicted no hit where the engines had none
        again = client.post(
            gateway.url + "/v1/completions",
            json={"model": MODEL, "prompt": prompt, "max_tokens": 1, "cache_salt": "tenant-1"},
        )
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert hits() > start  # and a hit where they had one


def test_expected_hits_match_the_engines_on_a_mixed_workload(
    fleet: tuple[Proc, list[Proc]], tmp_path: Path
) -> None:
    """Base model, an adapter and three salts over the same prompts: kvgate's expected hit
    tokens within 10 % of what the engines report as prefix-cache hits."""
    _, engines = fleet
    generate = engines[:1]  # the engine serving the adapter: every request meets one cache
    config = tmp_path / "tokens.yaml"
    config.write_text("keying: tokens\n")  # exact token keys: hits counted as the engine counts
    gateway = start_gateway(
        tmp_path,
        [e.url for e in generate],
        policy="predicted_ttft",
        extra=["--config", str(config)],
    )
    partitions: list[dict[str, str]] = [
        {},
        {"model": "ad-a"},
        {"cache_salt": "t1"},
        {"cache_salt": "t2"},
        {"cache_salt": "t3", "model": "ad-a"},
    ]

    def engine_hits() -> float:
        return sum(
            sample_sum(
                httpx.get(e.url + "/metrics", timeout=5).text, "vllm:prefix_cache_hits_total"
            )
            for e in generate
        )

    try:
        with httpx.Client(timeout=20) as client:
            expected0 = sample_sum(
                client.get(gateway.url + "/metrics").text, "kvgate_routed_expected_hit_tokens_total"
            )
            hits0 = engine_hits()
            for round_ in range(3):
                for i, extra in enumerate(partitions):
                    for doc in range(2):
                        prompt = f"Document {doc} of a shared corpus. " * (30 + 5 * doc)
                        body = {
                            "model": MODEL,
                            "prompt": prompt + f" q{round_}{i}",
                            "max_tokens": 1,
                        }
                        r = client.post(gateway.url + "/v1/completions", json={**body, **extra})
                        assert r.status_code == 200, r.text
            expected = (
                sample_sum(
                    client.get(gateway.url + "/metrics").text,
                    "kvgate_routed_expected_hit_tokens_total",
                )
                - expected0
            )
        delivered = engine_hits() - hits0
        keys = httpx.get(gateway.url + "/metrics").text
        exact = sample_sum(keys, "kvgate_routing_keys_total", mode="tokens")
    finally:
        gateway.stop()
    assert exact == 30  # every request keyed on the engine's own tokens
    assert delivered > 0
    assert abs(expected - delivered) <= 0.10 * delivered, (expected, delivered)
