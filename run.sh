#!/usr/bin/env bash
# One entry point for a fresh machine: sets up the virtual environments on first use.
#   ./run.sh [train] [ARGS...]   main job: train the default (tiny) model on the CPU
#   ./run.sh test [PYTEST ARGS]  the test suite (what .ci/run runs)
#   ./run.sh test-newest [ARGS]  the model, kernel, parallel and training test files on the newest jax setup.cfg
#                                admits (.venv-newest: no constraints.txt); ZAYA_NEWEST_TESTS replaces the file list
#   ./run.sh python ARGS...      any python command inside the project venv
set -euo pipefail
cd "$(dirname "$0")"

find_python() {  # $1 = minor version, e.g. 3.12
  local v=$1 p
  for p in "python$v" "$(pyenv root 2>/dev/null)/versions/$v"*/bin/"python$v" /root/.pyenv/versions/"$v"*/bin/"python$v"; do
    if command -v "$p" >/dev/null 2>&1; then command -v "$p"; return 0; fi
  done
  return 1
}

ensure_venv() {  # the project venv: Python >= 3.12, jax, flax, optax, orbax ...
  local stamp=.venv/.installed
  if [[ -f $stamp && $stamp -nt setup.cfg && $stamp -nt constraints.txt ]]; then return; fi
  local py; py=$(find_python 3.12) || { echo "run.sh: Python 3.12 not found (install it, e.g. with pyenv)" >&2; exit 1; }
  [[ -x .venv/bin/python ]] || "$py" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -c constraints.txt -e ".[test]"
  touch "$stamp"
}

ensure_newest_venv() {  # what a plain `pip install -e ".[test]"` resolves: the newest jax, flax, ... setup.cfg admits
  local stamp=.venv-newest/.installed
  if [[ -f $stamp && $stamp -nt setup.cfg ]]; then return; fi
  local py; py=$(find_python 3.12) || { echo "run.sh: Python 3.12 not found (install it, e.g. with pyenv)" >&2; exit 1; }
  [[ -x .venv-newest/bin/python ]] || "$py" -m venv .venv-newest
  .venv-newest/bin/python -m pip install -q --upgrade pip
  .venv-newest/bin/python -m pip install -q --upgrade --upgrade-strategy eager -e ".[test]"
  touch "$stamp"
}

# test-newest's files: the model, kernels, parallelism and training on the newest jax, leaving out files whose
# paths another listed file already compiles (kept to about 10-15 minutes on 2 cores)
NEWEST_TESTS=(tests/test_parallel_train.py tests/test_parallel_context.py tests/test_pallas_attention.py tests/test_train.py tests/test_pallas_grouped_matmul.py tests/test_pallas_cca_conv.py tests/test_parallel_zero1.py tests/test_pallas_rmsnorm.py tests/test_pallas_qk_norm_rope.py tests/test_pallas_softmax_xent.py tests/test_pallas_balancing_solve.py tests/test_muon.py tests/test_symmetric_matmul.py tests/test_activations.py tests/test_unrolled_layers.py tests/test_parallel_mesh.py tests/test_parallel_distributed.py tests/test_checkpoint_manager.py tests/test_loss.py tests/test_bf16_forward.py)

ensure_ref_venv() {  # the Hugging Face reference: PyTorch (CPU) + transformers >= 5.23, used by the parity tests,
  # and lm_eval with its hf backend (tests/test_lm_eval_hf_backend.py)
  local stamp=.venv-ref/.installed
  [[ -f $stamp && $stamp -nt run.sh ]] && return
  local py; py=$(find_python 3.11) || { echo "run.sh: no Python 3.11 for the reference venv; HF parity tests will skip" >&2; return; }
  [[ -x .venv-ref/bin/python ]] || "$py" -m venv .venv-ref
  local tf="transformers>=5.23"
  local wheel; wheel=$(ls ../shared/wheels/transformers-5.2[3-9]*.whl 2>/dev/null | tail -n 1 || true)
  [[ -n $wheel ]] && tf=$wheel
  # torch 2.13.0 is the CPU build kept on disk for Python 3.11; a plain 'torch' would pull a multi-GB CUDA build.
  .venv-ref/bin/python -m pip install -q torch==2.13.0 "$tf" safetensors numpy "lm_eval>=0.4.13,<0.5" accelerate
  touch "$stamp"
}

cmd=${1:-train}
if [[ $cmd == -* ]]; then cmd=train; else [[ $# -gt 0 ]] && shift; fi  # ./run.sh --workdir X ...: train's flags
case $cmd in
  train) ensure_venv; exec .venv/bin/python -m launch.train "$@" ;;
  # two workers, one test file each: most of the suite is single-threaded compilation (2 cores in CI); files in
  # collection order, which tests/conftest.py starts with the longest ones
  # the two environments install side by side (downloads and unpacking overlap); either failing stops the run
  test) ensure_ref_venv & ref_setup=$!; ensure_venv; wait "$ref_setup"
        exec .venv/bin/python -m pytest -n "${ZAYA_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@" ;;
  test-newest) ensure_ref_venv & ref_setup=$!; ensure_newest_venv; wait "$ref_setup"
        read -r -a files <<< "${ZAYA_NEWEST_TESTS:-${NEWEST_TESTS[*]}}"
        .venv-newest/bin/python -c 'import jax, flax, optax; print("newest:", "jax", jax.__version__, "flax", flax.__version__, "optax", optax.__version__)'
        exec .venv-newest/bin/python -m pytest -n "${ZAYA_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "${files[@]}" "$@" ;;
  python) ensure_venv; exec .venv/bin/python "$@" ;;
  *) echo "usage: ./run.sh [train|test|test-newest|python] [ARGS...]" >&2; exit 2 ;;
esac
