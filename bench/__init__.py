"""Benchmarks for gpu-train, measured side by side in one run: `make bench` (or `python -m bench`)."""
