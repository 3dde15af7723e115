"""The /metrics scraper: vLLM's LoRA info gauge (the latest series wins) and the rest."""

from __future__ import annotations

import pytest

from gateway.cluster.scraper import MAX_LORA_NAMES, MetricsParseError, parse_vllm_metrics

BASE = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
"""


# vLLM keeps every label set it ever set; the value is the time of each set.
def lora_page(*series: tuple[str, str, float]) -> str:
    lines = [
        f'vllm:lora_requests_info{{max_lora="4",running_lora_adapters="{r}",'
        f'waiting_lora_adapters="{w}"}} {v}'
        for r, w, v in series
    ]
    return BASE + "# TYPE vllm:lora_requests_info gauge\n" + "\n".join(lines) + "\n"


@pytest.mark.parametrize(
    ("series", "running", "waiting"),
    [
        (
            [("sql,chat", "math", 1700000030.0), ("sql", "", 1700000020.0)],
            ("sql", "chat"),
            ("math",),
        ),
        (
            [("sql", "", 1700000020.0), ("sql,chat", "math", 1700000030.0)],
            ("sql", "chat"),
            ("math",),
        ),
        ([("sql,chat", "math", 1700000010.0), ("", "", 1700000040.0)], (), ()),
        ([("", "sql", 1700000001.0)], (), ("sql",)),
    ],
)
def test_lora_info_latest_series_wins(
    series: list[tuple[str, str, float]], running: tuple[str, ...], waiting: tuple[str, ...]
) -> None:
    m = parse_vllm_metrics(lora_page(*series))
    assert (m.lora_running, m.lora_waiting, m.max_lora) == (running, waiting, 4)
    assert (m.running, m.waiting) == (3.0, 1.0)


def test_no_lora_info_leaves_it_unknown() -> None:
    m = parse_vllm_metrics(BASE)
    assert (m.max_lora, m.lora_running, m.lora_waiting) == (None, (), ())


def test_lora_names_are_bounded() -> None:
    many = ",".join(f"a{i}" for i in range(MAX_LORA_NAMES + 5))
    m = parse_vllm_metrics(lora_page((many, "", 1.0)))
    assert len(m.lora_running) == MAX_LORA_NAMES


def test_a_page_without_vllm_metrics_is_an_error() -> None:
    with pytest.raises(MetricsParseError):
        parse_vllm_metrics("# TYPE foo gauge\nfoo 1\n")
