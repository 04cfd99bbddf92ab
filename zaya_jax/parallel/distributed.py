"""Multi-process start-up: jax.distributed.initialize() when the launcher describes several processes."""

from __future__ import annotations

import os

import jax



def maybe_initialize() -> bool:
    """Initialises the distributed runtime when launched as one of several processes; a no-op otherwise.

    Explicit: ZAYA_NUM_PROCESSES, ZAYA_PROCESS_ID and JAX_COORDINATOR_ADDRESS. Otherwise jax's own cluster
    auto-detection (Slurm, Open MPI, Kubernetes) when their variables are present and describe > 1 process.
    """
    n = os.environ.get("ZAYA_NUM_PROCESSES")
    if n is not None and int(n) > 1:
        jax.distributed.initialize(coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"], num_processes=int(n),
                                   process_id=int(os.environ["ZAYA_PROCESS_ID"]))
        return True
    if os.environ.get("SLURM_NTASKS", "1") != "1" or os.environ.get("OMPI_COMM_WORLD_SIZE", "1") != "1":
        jax.distributed.initialize()
        return True
    return False
