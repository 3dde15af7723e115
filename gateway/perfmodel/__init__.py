"""The engine performance model shared by the simulator and the emulator."""

from gateway.perfmodel.engine import EngineCore
from gateway.perfmodel.kvcache import BlockPool
from gateway.perfmodel.model import PerfModel
from gateway.perfmodel.presets import DEFAULT_PRESET, available_presets, load_preset
from gateway.perfmodel.request import EngineRequest, StepOutcome

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
