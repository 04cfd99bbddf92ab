"""Does a device->host transfer from a worker thread hold up the GPU work of the main thread? 16 GiB of device
arrays go to host memory in a thread (pinned: device_put to the pinned_host memory kind, what Orbax does on GPUs;
pageable: copy_to_host_async + np.asarray) while the main thread times 20 chained bf16 8192^3 products per step.
pinned_warm: the same pinned transfer once on the main thread first (timed), its host arrays freed, so that the
thread's transfer finds XLA's pinned-host pool already grown to the state's size.

python benchmarks/d2h_probe.py pinned|pinned_warm|pageable"""

import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

mode = sys.argv[1]
leaves = [jnp.ones((256, 1024, 1024), jnp.float32) + i for i in range(16)]
a = jnp.ones((8192, 8192), jnp.bfloat16)
f = jax.jit(lambda a: (a @ a).sum())
f(a).block_until_ready()


def step():
    t = time.perf_counter()
    [f(a) for _ in range(20)][-1].block_until_ready()
    return time.perf_counter() - t


base = np.median([step() for _ in range(5)])


pinned = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
if mode == "pinned_warm":
    t = time.perf_counter()
    jax.block_until_ready([jax.device_put(x, pinned) for x in leaves])
    print(mode, "first transfer (pool grows) s", round(time.perf_counter() - t, 2), flush=True)


def worker():
    t = time.perf_counter()
    if mode.startswith("pinned"):
        jax.block_until_ready([jax.device_put(x, pinned) for x in leaves])
    else:
        for x in leaves:
            x.copy_to_host_async()
        [np.asarray(x) for x in leaves]
    print(mode, "transfer s", round(time.perf_counter() - t, 2), flush=True)


thread = threading.Thread(target=worker)
thread.start()
times = []
while thread.is_alive():
    times.append(step())
print(mode, "step s base", round(base, 3), "during transfer max", round(max(times), 3), "n", len(times), flush=True)
if mode == "pinned_warm":
    t = time.perf_counter()
    jax.block_until_ready([jax.device_put(x, pinned) for x in leaves])
    print(mode, "transfer on an idle device, pool grown, s", round(time.perf_counter() - t, 2), flush=True)
