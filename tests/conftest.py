"""Test session setup: 8 emulated CPU devices (set before jax is imported) and the `gpu` marker."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if os.environ.get("ZAYA_TEST_GPU"):  # run the gpu-marked tests on a real accelerator
    os.environ.pop("JAX_PLATFORMS")
elif "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    # The tests' programs are tiny and compiled once or twice each: compile time dominates the suite, and LLVM's
    # optimisation passes are most of it (tests/test_train.py cold: 98 s instead of 133 s). Subprocesses inherit it.
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
# Tests compile the same small programs many times (every trainer run builds fresh closures): cache them.
# ZAYA_TEST_CACHE_DIR: another (e.g. empty) cache directory, to measure a cold run without deleting this one.
jax.config.update("jax_compilation_cache_dir", os.environ.get("ZAYA_TEST_CACHE_DIR")
                  or os.path.join(os.path.dirname(__file__), "..", ".jax_cache"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


# The files that take longest on 2 cores (cold compilation cache), run first: with one file per xdist worker
# (run.sh: --dist loadfile --no-loadscope-reorder) a long file scheduled last leaves the other worker idle.
# Measured per file on 2 cores, longest first (test_train after test_parallel_train and test_train_accumulation:
# its 4-device program is theirs, compiled once).
LONGEST_FIRST = ("test_parallel_train", "test_compute_view", "test_train_accumulation", "test_deferred_wgrad",
                 "test_parallel_context", "test_pallas_attention", "test_train", "test_pallas_grouped_matmul",
                 "test_hf_parity", "test_pallas_model", "test_chunked_loss", "test_bench_train", "test_pallas_cca_conv",
                 "test_parallel_zero1", "test_balancing", "test_pallas_rmsnorm", "test_pallas_softmax_xent",
                 "test_document_reset", "test_muon", "test_inference_cache", "test_symmetric_matmul")


def _file_rank(item):
    name = os.path.splitext(os.path.basename(str(item.fspath)))[0]
    return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)


def pytest_collection_modifyitems(config, items):
    items.sort(key=_file_rank)  # stable: the order inside a file and among the other files is kept
    if jax.default_backend() != "cpu":
        return
    skip = pytest.mark.skip(reason="needs a GPU (run with ZAYA_TEST_GPU=1 -m gpu on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
