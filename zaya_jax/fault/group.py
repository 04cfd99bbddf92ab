"""A group of training processes on one host, started together and stopped together (multi-process supervision).

Each rank gets the variables zaya_jax/parallel/distributed.py reads: ZAYA_NUM_PROCESSES, ZAYA_PROCESS_ID and
JAX_COORDINATOR_ADDRESS (loopback and a port that was free at start; a fresh one at every start, since the last
group's port can still be held by the kernel), and its share of the host's devices:
  gpu  every GPU stays visible to CUDA (NCCL's peer-to-peer paths between processes need that) and
       JAX_LOCAL_DEVICE_IDS names the rank's own (jax.distributed.initialize reads it: jax_cuda_visible_devices)
  cpu  XLA_FLAGS --xla_force_host_platform_device_count=K: K emulated devices per rank (tests, smoke runs)
A group of one process gets none of these: it is the single-process trainer, as before.
NVLink multicast (NVLS) stays off in every rank (NCCL_NVLS_ENABLE=0): on shared hosts it can take the GPUs down.
Each rank leads its own process group (start_new_session), so stopping a rank reaches anything it started.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import time

PLATFORMS = ("auto", "gpu", "cpu")
NVLS_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
_FORCE_COUNT = "--xla_force_host_platform_device_count="


class GroupError(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class GroupSpec:
    nproc: int = 1
    devices_per_process: int = 1
    platform: str = "auto"  # 'auto': cpu when JAX_PLATFORMS says cpu, else gpu

    def __post_init__(self):
        if self.nproc < 1 or self.devices_per_process < 1:
            raise GroupError(f"nproc ({self.nproc}) and devices per process ({self.devices_per_process}) must be >= 1")
        if self.platform not in PLATFORMS:
            raise GroupError(f"platform must be one of {PLATFORMS}, got {self.platform!r}")


def resolve_platform(platform: str, env: dict) -> str:
    if platform != "auto":
        return platform
    return "cpu" if env.get("JAX_PLATFORMS", "").strip().lower() == "cpu" else "gpu"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(base: dict, rank: int, nproc: int, spec: GroupSpec, address: str) -> dict:
    """The environment of rank `rank` of a group of `nproc` processes."""
    env = {**base, **NVLS_OFF}
    if nproc == 1:
        return env
    env.update(ZAYA_NUM_PROCESSES=str(nproc), ZAYA_PROCESS_ID=str(rank), JAX_COORDINATOR_ADDRESS=address)
    k = spec.devices_per_process
    if resolve_platform(spec.platform, base) == "gpu":
        env["JAX_LOCAL_DEVICE_IDS"] = ",".join(str(rank * k + i) for i in range(k))
    else:
        flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(_FORCE_COUNT)]
        env["XLA_FLAGS"] = " ".join(flags + [f"{_FORCE_COUNT}{k}"])
    return env


class ProcessGroup:
    """`nproc` copies of `command`, one per rank."""

    def __init__(self, command: list[str], spec: GroupSpec, env: dict, nproc: int | None = None):
        self.nproc = spec.nproc if nproc is None else nproc
        address = f"127.0.0.1:{free_port()}"
        self.procs = [subprocess.Popen(command, env=rank_env(env, r, self.nproc, spec, address),
                                       start_new_session=True) for r in range(self.nproc)]
        self.failed: tuple[int, int] | None = None  # (rank, exit code) of the first rank seen failing

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def poll(self) -> int | None:
        """None while the group runs; else its exit code: that of the first rank seen failing (negative: killed by
        that signal), or 0 once every rank exited cleanly. Among ranks first seen failed at the same poll, one that
        aborted (SIGABRT) is named last: the distributed runtime aborts the ranks whose peer died, so the rank that
        died otherwise is the cause."""
        codes = [p.poll() for p in self.procs]
        if self.failed is None:
            bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                self.failed = min(bad, key=lambda rc: (rc[1] == -signal.SIGABRT, rc[0]))
        if self.failed is not None:
            return self.failed[1]
        return 0 if all(c == 0 for c in codes) else None

    def stop(self, grace_s: float) -> None:
        """SIGTERM every rank (the trainer finishes its in-flight checkpoint writes and exits), SIGKILL what is left
        after grace_s (at once when grace_s is 0), then reap them all."""
        alive = [p for p in self.procs if p.poll() is None]
        if grace_s > 0:
            _signal_all(alive, signal.SIGTERM)
            deadline = time.time() + grace_s
            while any(p.poll() is None for p in alive) and time.time() < deadline:
                time.sleep(0.05)
        _signal_all([p for p in self.procs if p.poll() is None], signal.SIGKILL)  # reaped pids may be reused
        for p in self.procs:
            p.wait()


def _signal_all(procs, sig) -> None:
    for p in procs:
        try:
            os.killpg(p.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
