"""The engine emulator: the simulator's EngineCore in real time behind vLLM's HTTP API.

``kvgate emulate`` serves one emulated engine; tests and demos start fleets of
them to exercise the gateway without GPUs. With ``--role prefill|decode`` an
engine plays one side of vLLM's NIXL P/D protocol (:mod:`gateway.emulator.pd`).
"""

from gateway.emulator.driver import EngineDriver, GenerationHandle, TokenDelta
from gateway.emulator.server import create_emulator_app
from gateway.emulator.state import EmulatorSettings
from gateway.emulator.tokenizer import FakeTokenizer, render_chat

__all__ = [
    "EmulatorSettings",
    "EngineDriver",
    "FakeTokenizer",
    "GenerationHandle",
    "TokenDelta",
    "create_emulator_app",
    "render_chat",
]
