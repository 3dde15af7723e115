"""Routing quality in the simulator: which policy serves most, and why (no processes)."""
