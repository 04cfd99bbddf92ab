python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export PYTHONPATH=/tmp/site:. JAX_COMPILATION_CACHE_DIR=/tmp/jaxcache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
nvidia-smi --query-gpu=name --format=csv,noheader
"$@"
