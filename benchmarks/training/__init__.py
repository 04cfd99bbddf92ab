"""The training-step benchmark behind `python -m benchmarks.bench_train` (bench.py is the entry point)."""
