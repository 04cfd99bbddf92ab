"""Several processes of one jax.distributed job, started as `launch.supervise --nproc 2` starts them
(zaya_jax/fault/group.py): each joins from the launcher's variables (zaya_jax/parallel/distributed.py), the mesh
has one node per process, and rows held by each process are reduced across both the way the trainer reduces its
gradients (reduce-scatter in the node, all-reduce on the rail, all-gather in the node: collectives.py).

Seconds per process. The trainer itself on 2 processes x 4 devices is tests/test_parallel_train.py's slow test."""

import json
import os
import sys

import numpy as np

from zaya_jax.fault.group import GroupSpec, ProcessGroup

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# One rank: its 2 rows (one per local device) into a global [4, 5] array, summed over the rows.
RANK = """
import json, os, sys
import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from zaya_jax.parallel.collectives import LOCAL, NODE, hierarchical_psum, hierarchical_view
from zaya_jax.parallel.distributed import maybe_initialize
from zaya_jax.parallel.mesh import describe_mesh, make_mesh

joined = maybe_initialize()
mesh = make_mesh()
rank = jax.process_index()
rows = np.arange(10, dtype=np.float32).reshape(2, 5) + 100 * rank
x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("data")), rows)
total = jax.jit(jax.shard_map(lambda r: hierarchical_psum(r[0]), mesh=hierarchical_view(mesh),
                              in_specs=P((NODE, LOCAL)), out_specs=P()))(x)
out = {"joined": joined, "rank": rank, "processes": jax.process_count(), "devices": jax.device_count(),
       "local": jax.local_device_count(), "shape": list(x.shape), "mesh": describe_mesh(mesh).splitlines()[0],
       "total": np.asarray(total.addressable_data(0)).tolist()}
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
    json.dump(out, f)
"""


def test_two_processes_join_and_reduce_over_nodes_and_rails(tmp_path, monkeypatch):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    monkeypatch.setenv("PYTHONPATH", ROOT)
    group = ProcessGroup([sys.executable, str(script), str(tmp_path)],
                         GroupSpec(nproc=2, devices_per_process=2, platform="cpu"), dict(os.environ))
    try:
        for p in group.procs:
            p.wait(timeout=300)
    finally:
        group.stop(0.0)
    assert group.poll() == 0, [p.returncode for p in group.procs]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    want = (np.arange(10, dtype=np.float32).reshape(2, 5).sum(0) * 2 + 2 * 100).tolist()
    for r, out in enumerate(ranks):
        assert (out["joined"], out["rank"], out["processes"], out["devices"], out["local"]) == (True, r, 2, 4, 2)
        assert out["shape"] == [4, 5] and out["total"] == want
        assert "over 4 cpu devices on 2 node(s) x 2" in out["mesh"], out["mesh"]


class _Ended:
    def __init__(self, code):
        self.code = code

    def poll(self):
        return self.code


def test_a_rank_that_died_is_named_before_one_that_aborted_after_it():
    """Seen at the same poll: rank 0 aborted (the runtime's reaction to a lost peer), rank 1 was killed."""
    import signal
    group = ProcessGroup.__new__(ProcessGroup)
    group.procs, group.failed = [_Ended(-signal.SIGABRT), _Ended(-signal.SIGKILL)], None
    assert group.poll() == -signal.SIGKILL and group.failed == (1, -signal.SIGKILL)
    group.procs, group.failed = [_Ended(-signal.SIGABRT), _Ended(None)], None
    assert group.poll() == -signal.SIGABRT and group.failed == (0, -signal.SIGABRT)
    group.procs, group.failed = [_Ended(None), _Ended(1), _Ended(-signal.SIGKILL)], None
    assert group.poll() == 1 and group.failed == (1, 1)
