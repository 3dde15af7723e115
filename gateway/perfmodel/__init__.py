"""The engine performance model shared by the simulator and the emulator."""

from gateway.perfmodel.engine import EngineCore, EngineRequest, StepOutcome
from gateway.perfmodel.kvcache import BlockPool
from gateway.perfmodel.model import PerfModel
from gateway.perfmodel.presets import DEFAULT_PRESET, available_presets, load_preset

__all__ = [
    "DEFAULT_PRESET",
    "BlockPool",
    "EngineCore",
    "EngineRequest",
    "PerfModel",
    "StepOutcome",
    "available_presets",
    "load_preset",
]
