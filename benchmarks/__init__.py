"""kvgate's benchmarks, one package per question; run each from the repository root as
``python -m benchmarks.<family>.<name>`` (index: benchmarks/README.md)."""
