"""Benchmarks, probes and tuning sweeps: the tooling that measures the library, kept out of the packages users import.

Commands (`python -m benchmarks.NAME`): bench_train, bench_kernels, bench_moe, bench_muon, bench_ce,
bench_attention_bwd, bench_inference, tune_kernels, characterize, scaling, size_model, routing_sweep, routing_probe,
train_solve_variant (and the scripts bench_routing_solve.py, d2h_probe.py, h200_lifecycle.sh; bench_inference_hf.py
is bench_inference's PyTorch half, routing_bench_config.py the run config of docs/routing.md). Their code lives in
the subpackages:
  training/  the training-step benchmark (JAX variants next to the HF PyTorch reference)
  kernels/   timings and launch sweeps of the Pallas kernels
  systems/   hardware characterization (collectives, HBM, GEMM, attention), step breakdown, sizing, scaling runs
  results/   the results of record that README.md cites (JSON, PNG); the commands' default --out. Every other
             record is a row of docs/experiments.md (change, result, file), the file itself in git history.
"""
