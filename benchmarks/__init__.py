"""Benchmarks, probes and tuning sweeps: the tooling that measures the library, kept out of the packages users import.

Commands (`python -m benchmarks.NAME`): bench_train, bench_kernels, bench_moe, bench_muon, bench_ce,
bench_attention_bwd, tune_kernels, characterize, scaling, size_model, routing_sweep, routing_probe (and the scripts
bench_routing_solve.py, d2h_probe.py, h200_lifecycle.sh). Their code lives in the subpackages:
  training/  the training-step benchmark (JAX variants next to the HF PyTorch reference)
  kernels/   timings and launch sweeps of the Pallas kernels
  systems/   hardware characterization (collectives, HBM, GEMM, attention), step breakdown, sizing, scaling runs
  results/   the results of record that README.md cites (JSON, PNG); the commands' default --out. Every other
             record is a row of docs/experiments.md (change, result, file), the file itself in git history.
"""
