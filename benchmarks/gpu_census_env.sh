#!/usr/bin/env bash
# What benchmarks/gpu_census.py needs to compile for an NVIDIA target on a machine without a GPU, installed into DIR
# (not the project's venv: ~3 GB of CUDA libraries the project itself never loads): the CUDA PJRT plugin of the
# venv's jax version, ptxas and libdevice (nvcc), and the libraries the plugin opens at start.
#   bash benchmarks/gpu_census_env.sh DIR; then PYTHONPATH=DIR:. .venv/bin/python -m benchmarks.gpu_census
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:?usage: bash benchmarks/gpu_census_env.sh DIR}
jax=$(.venv/bin/python -c "import jax; print(jax.__version__)")
.venv/bin/python -m pip install -q --no-deps --target "$dir" "jax-cuda12-plugin==$jax" "jax-cuda12-pjrt==$jax" \
  nvidia-cuda-nvcc-cu12 nvidia-cuda-runtime-cu12 nvidia-cublas-cu12 nvidia-cudnn-cu12 nvidia-nvjitlink-cu12 \
  nvidia-cuda-nvrtc-cu12
du -sh "$dir"
