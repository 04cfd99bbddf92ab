"""Systems characterization: the measurements the ZAYA1 paper used to size its training run, as a library.

    collectives    all-reduce / reduce-scatter / all-gather / broadcast / all-to-all sweeps (nccl-tests conventions)
    hbm            read / write / copy bandwidth over buffer sizes (XLA and a Pallas kernel, hbm_pallas)
    gemm           the model's GEMM shapes over M; the FLOP size where throughput saturates
    attention_sweep  attention throughput over context length (where it turns compute bound)
    breakdown      a profiled training step split into attention, experts, router, norms, optimizer, ...
    advisor        the paper's sizing rules (microbatch, CP/TP/EP, bucket) over hardware + memory_model
    storage        the Appendix B data-loading I/O model
    suite          everything in one run, writing JSON + PNG per sweep and a hardware file for the advisor

CLI: `python -m benchmarks.characterize SUBCOMMAND` and `python -m benchmarks.size_model`.
"""
