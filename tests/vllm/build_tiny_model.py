"""Build a tiny random Llama and its tokenizer offline, for the real-engine test tier.

Runs in the vLLM virtual environment (it needs torch, transformers and tokenizers):

    .venv-vllm/bin/python tests/vllm/build_tiny_model.py OUT_DIR

The tokenizer is a byte-level BPE trained here on generated sentences, with
Llama-3-style special tokens and chat template; the model is a 2-layer Llama
with random (seeded) weights. Nothing is downloaded. About 10 s, under 1 MB.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

WORDS = [
    "the",
    "a",
    "an",
    "router",
    "engine",
    "cache",
    "prefix",
    "block",
    "token",
    "request",
    "decode",
    "prefill",
    "batch",
    "queue",
    "latency",
    "memory",
    "model",
    "gateway",
    "policy",
    "load",
    "balance",
    "hit",
    "miss",
    "route",
    "serve",
    "stream",
    "chunk",
    "first",
    "second",
    "time",
    "system",
    "user",
    "assistant",
    "question",
    "answer",
    "tool",
    "document",
    "summary",
    "data",
    "kv",
    "vllm",
    "gpu",
    "cpu",
    "fast",
    "slow",
    "small",
    "large",
    "shared",
    "unique",
    "long",
    "short",
    "hot",
    "cold",
    "replica",
    "ring",
    "hash",
    "tree",
    "node",
    "leaf",
    "root",
    "window",
    "share",
    "spread",
    "pick",
    "choose",
    "send",
    "keep",
    "move",
    "free",
    "full",
]
SPECIAL = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|pad|>",
]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def sentences(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(4, 16))]
        out.append(" ".join(words).capitalize() + rng.choice([".", "?", "!", ","]))
    out += [str(i) for i in range(1000)] + list("0123456789,.;:!?()[]{}<>'\"-_=+*/\\|@#$%&~`^")
    return out


def build(out: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(sentences(5000), trainer=trainer)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A",
        pair="<|begin_of_text|> $A $B",
        special_tokens=[("<|begin_of_text|>", bos)],
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
        pad_token="<|pad|>",
        model_max_length=4096,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=bos,
        eos_token_id=fast.convert_tokens_to_ids("<|eot_id|>"),
        pad_token_id=fast.convert_tokens_to_ids("<|pad|>"),
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)
    print(
        f"tiny model: vocab {len(fast)}, {sum(p.numel() for p in model.parameters())} "
        f"parameters -> {out}"
    )


if __name__ == "__main__":
    build(Path(sys.argv[1] if len(sys.argv) > 1 else ".cache/tiny-llama"))
