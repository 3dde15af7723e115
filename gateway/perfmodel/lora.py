"""LoRA adapters in the engine model: vLLM's batch slot rule and its two adapter caches.

*Slots* (``vllm/v1/core/sched/scheduler.py``): a step's batch holds at most
``max_loras`` distinct adapters (``--max-loras``, vLLM's default 1). The adapters of
the running requests scheduled in the step fill the slots first; a waiting request
whose adapter is not among them while all slots are taken is *skipped* for this step
(set aside, put back at the head of the queue after the pass, in its order), and the
requests behind it may still be admitted. Base-model requests take no slot.

*Load time* (``vllm/lora/worker_manager.py``, ``LRUCacheWorkerLoRAManager``; and
``model_manager.py``, ``LRUCacheLoRAModelManager``): before a step runs, every adapter
of its batch is made active. An adapter not in the CPU cache (``max_cpu_loras``
adapters, LRU, vLLM's default = ``max_loras``) is read from disk first (the oldest
CPU entry is dropped when full; both caches see the same order of use, so the GPU
slots always hold the most recently used of the CPU's); one not in the GPU
slots (``max_loras``, LRU) is then copied into a slot, replacing the least recently
used. Both happen synchronously inside the step, so the step takes that much longer:
``lora_load_s`` per disk load plus ``lora_activate_s`` per slot copy (model
parameters, :class:`~gateway.perfmodel.model.PerfModel`). The tables hold at most
``max_cpu_loras`` and ``max_loras`` names.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from gateway.perfmodel.request import EngineRequest


class AdapterCache:
    """The adapters an engine holds: GPU slots and the CPU cache, each an LRU of names."""

    __slots__ = (
        "_activate_s",
        "_cpu",
        "_gpu",
        "_load_s",
        "activations",
        "loads",
        "max_cpu",
        "max_gpu",
    )

    def __init__(
        self, max_loras: int, max_cpu_loras: int, load_s: float, activate_s: float
    ) -> None:
        if max_loras <= 0:
            raise ValueError("max_loras must be positive")
        self.max_gpu = max_loras
        self.max_cpu = max(max_cpu_loras, max_loras) if max_cpu_loras else max_loras
        self._load_s = load_s
        self._activate_s = activate_s
        self._gpu: OrderedDict[str, None] = OrderedDict()
        self._cpu: OrderedDict[str, None] = OrderedDict()
        self.loads = 0
        """Adapters read from disk (CPU cache misses) so far."""
        self.activations = 0
        """Adapters copied into a GPU slot so far."""

    @property
    def gpu_resident(self) -> tuple[str, ...]:
        """The adapters in the GPU slots, least recently used first."""
        return tuple(self._gpu)

    @property
    def cpu_resident(self) -> tuple[str, ...]:
        """The adapters in the CPU cache, least recently used first."""
        return tuple(self._cpu)

    def activate(self, names: Iterable[str]) -> float:
        """Make a batch's adapters active (in this order); the seconds it costs the step."""
        cost = 0.0
        cpu, gpu = self._cpu, self._gpu
        for name in names:
            if name in cpu:
                cpu.move_to_end(name)
            else:
                cost += self._load_s
                self.loads += 1
                if len(cpu) >= self.max_cpu:
                    cpu.popitem(last=False)  # (its GPU slot, if any, is the next to go too)
                cpu[name] = None
            if name in gpu:
                gpu.move_to_end(name)
            else:
                cost += self._activate_s
                self.activations += 1
                if len(gpu) >= self.max_gpu:
                    gpu.popitem(last=False)
                gpu[name] = None
        return cost


def batch_adapters(reqs: Iterable[EngineRequest]) -> list[str]:
    """The distinct adapters of ``reqs``, in order of first appearance (base model left out)."""
    seen: dict[str, None] = {}
    for req in reqs:
        if req.lora:
            seen[req.lora] = None
    return list(seen)


class SlotGate:
    """One step's admission check: the adapters of the running requests (all scheduled
    whenever admission runs) fill the slots, then each admitted request's."""

    __slots__ = ("_loras", "_max", "_running")

    def __init__(self, running: Sequence[EngineRequest], max_loras: int) -> None:
        self._running = running
        self._max = max_loras
        self._loras: set[str] | None = None  # built on the first adapter request

    def blocks(self, req: EngineRequest) -> bool:
        """Whether ``req`` must wait (all slots taken by other adapters); when it may run,
        its adapter joins the batch's."""
        if not req.lora:
            return False
        loras = self._loras
        if loras is None:
            loras = self._loras = set(batch_adapters(self._running))
        if req.lora in loras:
            return False
        if len(loras) >= self._max:
            return True
        loras.add(req.lora)
        return False


@dataclass(frozen=True, slots=True)
class LoraInfo:
    """What ``vllm:lora_requests_info`` reports: adapters running, waiting, and the slots."""

    running: frozenset[str]
    waiting: frozenset[str]
    max_loras: int

    @classmethod
    def of(
        cls, running: Iterable[EngineRequest], waiting: Iterable[EngineRequest], max_loras: int
    ) -> LoraInfo:
        return cls(
            frozenset(r.lora for r in running if r.lora),
            frozenset(r.lora for r in waiting if r.lora),
            max_loras,
        )
