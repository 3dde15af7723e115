"""Held-out unique-prompt traces (no prompt shares a block) in Mooncake JSONL format.

Shapes the simulator's ``gen:no_sharing`` does not draw: long-tailed prompt lengths
(lognormal, sigma 1.2), bimodal lengths (75 % short, 25 % long) and bursty arrivals
(gamma inter-arrival times, CV 4). Used to measure DualMap against least loaded on
unique prompts (``docs/evaluation.md``)::

    python -m tests.policies.unique_traces OUT_DIR [--n 1500] [--seed 0]
    kvgate simulate --workload mooncake:OUT_DIR/longtail.jsonl --capacity \\
        --policies least_loaded,dualmap --no-timing --no-plots
"""

from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path

SHAPES = ("longtail", "bimodal", "bursty", "longtail_bursty")
RATE = 4.0  # requests/s before the capacity search scales it
MAX_TOKENS = 32_768


def _length(rnd: random.Random, shape: str) -> int:
    if shape.startswith("longtail"):
        value = rnd.lognormvariate(math.log(450), 1.2)  # median 450, mean ~930
    elif shape == "bimodal":
        value = rnd.lognormvariate(math.log(3000 if rnd.random() < 0.25 else 300), 0.3)
    else:
        value = rnd.lognormvariate(math.log(880), 0.5)  # mean ~1,000 like gen:no_sharing
    return max(1, min(MAX_TOKENS, round(value)))


def _gap(rnd: random.Random, shape: str) -> float:
    if shape.endswith("bursty"):  # gamma with CV 4: shape k = 1 / CV^2
        k = 1.0 / 16.0
        return rnd.gammavariate(k, 1.0 / (RATE * k))
    return rnd.expovariate(RATE)


def trace(shape: str, n: int, seed: int = 0) -> list[dict[str, object]]:
    """``n`` requests of ``shape``; every 512-token hash id is used once."""
    rnd = random.Random(f"{seed}:{shape}")
    t, next_id, rows = 0.0, 0, []
    for _ in range(n):
        t += _gap(rnd, shape)
        tokens = _length(rnd, shape)
        blocks = math.ceil(tokens / 512)
        out = max(1, min(2048, round(rnd.lognormvariate(math.log(113), 0.5))))
        rows.append(
            {
                "timestamp": round(t * 1000),
                "input_length": tokens,
                "output_length": out,
                "hash_ids": list(range(next_id, next_id + blocks)),
            }
        )
        next_id += blocks
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--n", type=int, default=1500)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for shape in SHAPES:
        lines = (json.dumps(r) for r in trace(shape, args.n, args.seed))
        (args.out / f"{shape}.jsonl").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
