"""Parse an engine's ``GET /v1/models`` answer: base models and LoRA adapters.

vLLM lists each served base model as a card with ``root`` = the model's path and
no ``parent``, and each loaded LoRA adapter (``--lora-modules`` or
``/v1/load_lora_adapter``) as a card with ``parent`` = its base model's name and
``root`` = the adapter's path (``vllm/entrypoints/openai/models/serving.py``,
``show_available_models``). A card with a ``parent`` is therefore an adapter.
At most :data:`MAX_MODELS` cards are read per engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway.cluster.registry import LoraAdapter

MAX_MODELS = 4096
"""Cards read from one ``/v1/models`` answer; the rest are ignored (logged by the caller)."""


class ModelListError(ValueError):
    """The answer is not an OpenAI model list, or lists no model."""


@dataclass(frozen=True, slots=True)
class ModelList:
    """Every name an engine serves, in its order, and the adapters among them."""

    models: tuple[str, ...]
    lora: dict[str, LoraAdapter] = field(default_factory=dict)
    truncated: bool = False


def parse_model_list(payload: Any) -> ModelList:
    """The names and adapters of a decoded ``/v1/models`` JSON body."""
    try:
        cards = payload["data"]
    except (KeyError, TypeError, IndexError):
        raise ModelListError("/v1/models is not an OpenAI model list") from None
    if not isinstance(cards, list):
        raise ModelListError("/v1/models is not an OpenAI model list")
    names: dict[str, None] = {}
    lora: dict[str, LoraAdapter] = {}
    for card in cards[:MAX_MODELS]:
        if not isinstance(card, dict) or not isinstance(card.get("id"), str) or not card["id"]:
            raise ModelListError("/v1/models has a card without a string id")
        name = card["id"]
        names.setdefault(name, None)
        parent = card.get("parent")
        if isinstance(parent, str) and parent:
            root = card.get("root")
            lora[name] = LoraAdapter(name, parent, root if isinstance(root, str) else "")
    if not names:
        raise ModelListError("/v1/models lists no model")
    return ModelList(tuple(names), lora, truncated=len(cards) > MAX_MODELS)
