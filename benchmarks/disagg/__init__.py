"""Disaggregated (prefill/decode) serving in the simulator: goodput, pool splits, the P/D rule."""
