"""Whether the train state (parameters, optimizer state, balancing biases) fits where it will live, checked on its
abstract shapes before any of it is created: a model too large for the machine (the 8B config on a laptop's CPU)
is refused in one line instead of swapping or being killed by the OS, and on accelerators before XLA's allocator
fails deep inside the first jit. Activations are not counted: a state that does not fit can never train."""

from __future__ import annotations

import jax

from zaya_jax.parallel.sharding import bytes_per_device
from zaya_jax.train.errors import TrainConfigError

GIB = 2 ** 30


def host_available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (Linux), else None: nothing to check against."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def device_limit_bytes(device) -> int | None:
    """What the device's allocator may hold (XLA's bytes_limit), else None."""
    try:
        stats = device.memory_stats()
    except Exception:  # platforms without memory statistics
        return None
    return (stats or {}).get("bytes_limit")


def check_state_fits(abstract_state, mesh) -> None:
    """abstract_state: ShapeDtypeStructs with their shardings. CPU devices share the host's memory, so there the
    state on every local device counts against MemAvailable; on an accelerator, one device's share against its
    allocator's limit."""
    local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    if not local:
        return
    cpu = local[0].platform == "cpu"
    copies = len(local) if cpu else 1
    need = bytes_per_device(abstract_state)[1] * copies
    params = bytes_per_device(abstract_state["params"])[1] * copies
    have = host_available_bytes() if cpu else device_limit_bytes(local[0])
    where = "this machine's available memory" if cpu else f"one {local[0].device_kind}'s memory"
    if have is not None and need > have:
        raise TrainConfigError(
            f"the train state needs {need / GIB:.1f} GiB (parameters {params / GIB:.1f} GiB, the rest optimizer "
            f"state) but {where} is {have / GIB:.1f} GiB: train on more or larger devices (ZeRO-1 shards the "
            "optimizer state over data-parallel devices) or a smaller model (configs/default.py on a CPU)")


__all__ = ["check_state_fits", "host_available_bytes", "device_limit_bytes"]
