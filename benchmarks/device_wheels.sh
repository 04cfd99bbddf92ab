#!/usr/bin/env bash
# The wheels that travel to the GPU machine (its image has jax, torch, flax, optax and orbax but not these), for
# Python 3.12 on x86_64, from this project's venv's versions:
#   .whl       launch.train's extras and transformers (the HF reference ZayaForCausalLM)
#   .whl-eval  lm_eval and what it needs beyond the image (benchmarks/lm_eval_h200.py); three are source-only on
#              PyPI and are built here (pure Python)
# On the device: pip install --no-index --no-deps --target /tmp/site .whl/*.whl .whl-eval/*.whl
#   bash benchmarks/device_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
pip=(.venv/bin/python -m pip)
version() { .venv/bin/python -c "import importlib.metadata as m; print(m.version('$1'))"; }
binary() {
  local dir=$1; shift
  local specs=(); for p in "$@"; do specs+=("$p==$(version "$p")"); done
  "${pip[@]}" download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
    --platform manylinux_2_28_x86_64 -d "$dir" "${specs[@]}"
}
mkdir -p .whl .whl-eval
binary .whl ml_collections tensorboardX grain array_record portpicker
cp ../shared/wheels/transformers-5.2[3-9]*.whl .whl/
binary .whl-eval lm_eval datasets dill multiprocess evaluate more-itertools pytablewriter DataProperty mbstrdecoder \
  pathvalidate tabledata tcolorpy typepy chardet nltk fsspec pytz
"${pip[@]}" wheel -q --no-deps -w .whl-eval "rouge_score==$(version rouge_score)" "sqlitedict==$(version sqlitedict)" \
  "word2number==$(version word2number)"
du -sh .whl .whl-eval
