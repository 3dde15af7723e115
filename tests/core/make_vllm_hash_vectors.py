"""Write ``data/vllm_hash_vectors.json``: block hashes computed by vLLM itself.

Run with the real vLLM install (not kvgate's venv; about 15 s, mostly importing torch)::

    .venv-vllm/bin/python tests/core/make_vllm_hash_vectors.py

Each vector holds the token ids, block size, hash algorithm and NONE_HASH seed
(``null`` = ``PYTHONHASHSEED`` unset), and what vLLM computes for them:
``NONE_HASH``, every full block's 32-byte digest (from a real ``vllm.v1.request.Request``
with vLLM's own request block hasher, checked against ``hash_block_tokens`` chained by
hand), and the 64-bit ids its KV events publish (``maybe_convert_block_hash`` with
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` at its default). Keyed vectors add a request's
``lora`` (a ``LoRARequest``: name, int id, path) and/or ``cache_salt``, the ``extra_keys``
vLLM hashed per block (``generate_block_hash_extra_keys``, as JSON lists) and the untagged
per-block ``extra_keys`` its KV events publish (``to_event_extra_keys``).
``tests/core/test_vllm_hash.py`` checks ``gateway.core.vllm_hash`` against the file.
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path
from typing import Any

OUT = Path(__file__).with_name("data") / "vllm_hash_vectors.json"


def token_sequences() -> dict[str, list[int]]:
    rng = random.Random(20261129)
    # ids on the encoding boundaries of pickle (1/2/4-byte ints, then LONG1) and CBOR
    # (inline < 24, then 1/2/4/8-byte heads)
    edges = [0, 1, 23, 24, 255, 256, 65535, 65536, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40]
    return {
        "empty": [],
        "short_15": list(range(15)),
        "range_16": list(range(16)),
        "range_17": list(range(17)),
        "range_64": list(range(64)),
        "llama_like_100": [128000] + [rng.randrange(128256) for _ in range(99)],
        "small_vocab_257": [rng.randrange(1000) for _ in range(257)],
        "repeated_96": [7] * 96,
        "edges_48": [edges[i % len(edges)] for i in range(48)],
    }


# (name, lora (name, int id, path) or None, cache_salt or None)
KEYED: list[tuple[str, tuple[str, int, str] | None, str | None]] = [
    ("salt", None, "tenant-a"),
    ("salt_unicode", None, "sel-\u00fc-\u6f22"),
    ("salt_empty", None, ""),
    ("lora", ("adapter-a", 1, "/models/adapters/a"), None),
    ("lora_other_path", ("adapter-a", 1, "/models/adapters/a-v2"), None),
    ("lora_other_id", ("adapter-a", 7, "/models/adapters/a"), None),
    ("lora_salt", ("adapter-b", 2, "/models/adapters/b"), "tenant-a"),
]
KEYED_TOKENS = ("short_15", "range_16", "range_64", "llama_like_100")


def keyed_vectors(
    kcu: Any, algos: dict[str, Any], request_cls: Any, params_cls: Any, lora_cls: Any
) -> list[dict[str, Any]]:
    """Salted / LoRA vectors from a real Request with vLLM's own request block hasher."""
    out: list[dict[str, Any]] = []
    sequences = token_sequences()
    for algo, fn in algos.items():
        for seed in (None, "12345"):
            if seed is None:
                os.environ.pop("PYTHONHASHSEED", None)
            else:
                os.environ["PYTHONHASHSEED"] = seed
            kcu.init_none_hash(fn)
            for block_size in (16, 32):
                for key_name, lora, salt in KEYED:
                    for name in KEYED_TOKENS:
                        tokens = sequences[name]
                        lora_request = (
                            None
                            if lora is None
                            else lora_cls(lora_name=lora[0], lora_int_id=lora[1], lora_path=lora[2])
                        )
                        request = request_cls(
                            f"{key_name}-{name}-{block_size}",
                            list(tokens),
                            params_cls(max_tokens=1),
                            None,
                            lora_request=lora_request,
                            cache_salt=salt,
                            block_hasher=kcu.get_request_block_hasher(block_size, fn),
                        )
                        digests = [bytes(h) for h in request.block_hashes]
                        assert len(digests) == len(tokens) // block_size
                        hashed = [
                            kcu.generate_block_hash_extra_keys(
                                request, k * block_size, (k + 1) * block_size, 0
                            )[0]
                            for k in range(len(digests))
                        ]
                        out.append(
                            {
                                "name": f"{key_name}-{name}",
                                "algo": algo,
                                "seed": seed,
                                "block_size": block_size,
                                "tokens": tokens,
                                "lora": None
                                if lora is None
                                else {"name": lora[0], "int_id": lora[1], "path": lora[2]},
                                "cache_salt": salt,
                                "none_hash": bytes(kcu.NONE_HASH).hex(),
                                "digests": [d.hex() for d in digests],
                                "event_ids": [kcu.maybe_convert_block_hash(d) for d in digests],
                                "hashed_extra_keys": hashed,
                                "event_extra_keys": kcu.to_event_extra_keys(hashed),
                            }
                        )
    return out


def main() -> int:
    os.environ.pop("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", None)
    import vllm
    import vllm.v1.core.kv_cache_utils as kcu
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256, sha256_cbor
    from vllm.v1.request import Request

    algos = {"sha256": sha256, "sha256_cbor": sha256_cbor}
    vectors: list[dict[str, Any]] = []
    for algo, fn in algos.items():
        for seed in (None, "0", "12345"):
            if seed is None:
                os.environ.pop("PYTHONHASHSEED", None)
            else:
                os.environ["PYTHONHASHSEED"] = seed
            kcu.init_none_hash(fn)
            none_hash = bytes(kcu.NONE_HASH)
            for block_size in (16, 32):
                for name, tokens in token_sequences().items():
                    request = Request(
                        f"{name}-{block_size}",
                        list(tokens),
                        SamplingParams(max_tokens=1),
                        None,
                        block_hasher=kcu.get_request_block_hasher(block_size, fn),
                    )
                    digests = [bytes(h) for h in request.block_hashes]
                    # the same chain by hand, through hash_block_tokens
                    parent = None
                    for k, digest in enumerate(digests):
                        block = tokens[k * block_size : (k + 1) * block_size]
                        parent = kcu.hash_block_tokens(fn, parent, block, None)
                        assert bytes(parent) == digest, (name, block_size, k)
                    assert len(digests) == len(tokens) // block_size
                    vectors.append(
                        {
                            "name": name,
                            "algo": algo,
                            "seed": seed,
                            "block_size": block_size,
                            "tokens": tokens,
                            "none_hash": none_hash.hex(),
                            "digests": [d.hex() for d in digests],
                            "event_ids": [kcu.maybe_convert_block_hash(d) for d in digests],
                        }
                    )
    vectors += keyed_vectors(kcu, algos, Request, SamplingParams, LoRARequest)
    os.environ.pop("PYTHONHASHSEED", None)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    head = {"generator": "tests/core/make_vllm_hash_vectors.py", "vllm_version": vllm.__version__}
    lines = ",\n".join(json.dumps(v, separators=(",", ":")) for v in vectors)
    text = json.dumps(head)[:-1] + ', "vectors": [\n' + lines + "\n]}\n"  # one vector a line
    json.loads(text)
    OUT.write_text(text, encoding="utf-8")
    print(f"wrote {len(vectors)} vectors to {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
