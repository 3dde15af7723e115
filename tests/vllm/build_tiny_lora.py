"""Build tiny LoRA adapters for the tiny Llama offline, for the real-engine test tier.

Runs in the vLLM virtual environment (it needs torch and safetensors):

    .venv-vllm/bin/python tests/vllm/build_tiny_lora.py MODEL_DIR OUT_DIR

Writes one PEFT-format adapter per name in :data:`ADAPTERS` under ``OUT_DIR``
(``adapter_config.json`` + ``adapter_model.safetensors``): rank 8 on ``q_proj``
and ``v_proj`` of every layer, random weights from the adapter's own seed (B is
not zero, so each adapter changes the model's outputs). Nothing is downloaded;
a few KB each, under a second.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ADAPTERS = {"tiny-lora-a": 1, "tiny-lora-b": 2, "tiny-lora-c": 3}
"""Adapter name -> seed. ``a`` and ``b`` are served from the start, ``c`` is loaded at run time."""
RANK = 8
TARGETS = ("q_proj", "v_proj")


def build(model_dir: Path, out: Path) -> None:
    import torch
    from safetensors.torch import save_file

    config = json.loads((model_dir / "config.json").read_text())
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    out_features = {
        "q_proj": config["num_attention_heads"] * head_dim,
        "v_proj": config["num_key_value_heads"] * head_dim,
    }
    for name, seed in ADAPTERS.items():
        gen = torch.Generator().manual_seed(seed)
        tensors = {}
        for layer in range(config["num_hidden_layers"]):
            for target in TARGETS:
                prefix = f"base_model.model.model.layers.{layer}.self_attn.{target}"
                a = torch.randn(RANK, hidden, generator=gen) / hidden**0.5
                b = torch.randn(out_features[target], RANK, generator=gen) / RANK**0.5
                tensors[f"{prefix}.lora_A.weight"] = a.contiguous()
                tensors[f"{prefix}.lora_B.weight"] = b.contiguous()
        adapter_dir = out / name
        adapter_dir.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(adapter_dir / "adapter_model.safetensors"))
        adapter_config = {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": str(model_dir),
            "r": RANK,
            "lora_alpha": 2 * RANK,
            "lora_dropout": 0.0,
            "target_modules": list(TARGETS),
            "bias": "none",
            "fan_in_fan_out": False,
            "modules_to_save": None,
            "use_rslora": False,
            "use_dora": False,
        }
        (adapter_dir / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
        print(f"LoRA adapter {name}: rank {RANK}, {len(tensors)} tensors -> {adapter_dir}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: build_tiny_lora.py MODEL_DIR OUT_DIR")
    build(Path(sys.argv[1]), Path(sys.argv[2]))
