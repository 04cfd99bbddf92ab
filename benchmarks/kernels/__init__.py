"""Timings and launch-parameter sweeps of the Pallas kernels (bench_kernels, bench_moe, bench_muon, tune_kernels)."""
