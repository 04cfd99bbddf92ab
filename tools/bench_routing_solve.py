import time, jax, jax.numpy as jnp, numpy as np, sys
sys.path.insert(0, '.')
from zaya_jax.model.routing_stats import balancing_correction
N, E = 8192, 16
x = jax.random.uniform(jax.random.key(0), (N, E)) * 1e-3
f = jax.jit(lambda s: balancing_correction(s, jnp.ones(N, bool)))
f(x).block_until_ready()
ts = []
for _ in range(5):
    t = time.perf_counter()
    for _ in range(50): r = f(x)
    r.block_until_ready(); ts.append((time.perf_counter() - t) / 50)
print("solve [8192,16] median us", np.median(ts) * 1e6, "per step (16 mb x 8 layers)", np.median(ts) * 128 * 1e3, "ms")
