"""How close the simulator comes to real engines (vLLM CPU)."""
