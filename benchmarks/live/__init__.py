"""kvgate in front of emulated engines, real processes: live routing quality and TTFT."""
