"""Flow control under overload: the gateway in front of emulated engines, and the simulator."""
