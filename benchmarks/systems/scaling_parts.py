"""The five parts of the multi-GPU scaling report, each run in its own process by benchmarks/scaling.py:

  collectives  all-reduce, reduce-scatter, all-gather, all-to-all over 2..N local devices (nccl-tests bus bandwidth),
               next to the public nccl-tests figure for 8 x H100/H200 (NVLink 4, ring, no NVLink SHARP)
  dp           data parallel + ZeRO-1 weak scaling 1 -> N on the bench preset (scaling_dp.py)
  cp           context parallelism CP = 2..N at 32k and 128k tokens vs one device (scaling_cp.py)
  restore      save on N devices, restore on N/2, continue (scaling_runs.py)
  supervisor   N processes under launch.supervise, one killed with SIGKILL, the group resumes (scaling_runs.py)
`Settings` holds every size; `Settings.gpu(n)` is the H200 run, `Settings.cpu_smoke(n)` the same code on tiny shapes.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time

PARTS = ("collectives", "dp", "cp", "restore", "supervisor")
WEIGHTS = {"collectives": 1.0, "dp": 2.0, "cp": 2.5, "restore": 2.5, "supervisor": 1.5}  # shares of the budget
# (restore: two whole trainer runs, ~85 s on 4 H200 mostly start-up and compilation; supervisor: one, ~55 s)

# NVIDIA/nccl-tests issue #212 (2024-05-06), NCCL maintainer: 450 GB/s is NVLink 4's line rate per direction;
# with ~20% protocol overhead NCCL reaches ~370 GB/s effective, seen as busbw of non-all-reduce collectives or of
# all-reduce with NCCL_ALGO=RING; all-reduce over NVLink SHARP (NVLS, off on these machines) peaks near 480 GB/s
# on 8 GPUs. H200 SXM has H100's NVLink 4 (900 GB/s bidirectional per GPU), so the same figures apply.
NCCL_REFERENCE = {
    "all_reduce_busbw_ring_8gpu": 370e9,
    "all_reduce_busbw_nvls_8gpu": 480e9,
    "nvlink4_line_rate_per_direction": 450e9,
    "conditions": "8 x H100/H200 SXM (NVLink 4 + NVSwitch), nccl-tests all_reduce_perf, large messages; ring = "
                  "NCCL_ALGO=RING / NVLS off (as on the lent machines, NCCL_NVLS_ENABLE=0)",
    "source": "https://github.com/NVIDIA/nccl-tests/issues/212 (comment by the NCCL maintainer, 2024-05-06: "
              "~370 GB/s effective NVLink bandwidth as busbw with NCCL_ALGO=RING; ~480 GB/s all-reduce busbw with "
              "NVLink SHARP); issue 11 of this project quotes about 365 GB/s ring",
}


@dataclasses.dataclass(frozen=True)
class Settings:
    devices: int
    smoke: bool
    # collectives
    coll_min_bytes: int
    coll_max_bytes: int
    coll_step: int
    # dp
    dp_preset: str
    dp_overrides: tuple
    dp_seq: int
    dp_rows_per_device: int
    dp_warmup: int
    dp_steps: int
    dp_ce_chunk: int | None
    # cp
    cp_overrides: tuple
    cp_lengths: tuple
    cp_check_steps: int
    cp_steps: int
    cp_attention: str
    cp_tolerance: dict
    # restore / supervisor
    run_steps: int
    run_checkpoint_every: int
    run_rows: int
    run_seq: int
    run_kill_at: int
    nproc: int
    devices_per_process: int

    @classmethod
    def gpu(cls, n: int, dp_layers: int = 8, cp_lengths=(32768, 131072), dp_attention: str = "xla",
            cp_attention: str = "pallas") -> Settings:
        # dp: not cuDNN attention, which XLA cannot lower inside the DP gradients' shard_map (scaling_step.py)
        return cls(devices=n, smoke=False, coll_min_bytes=64 << 10, coll_max_bytes=1 << 30, coll_step=4,
                   dp_preset="bench",
                   dp_overrides=(("num_hidden_layers", dp_layers), ("attention_impl", dp_attention),
                                 ("remat", "none")),
                   dp_seq=4096, dp_rows_per_device=2, dp_warmup=2, dp_steps=3, dp_ce_chunk=4096,
                   # ZAYA1 attention (CCA, 8 x 128 query heads, 2 KV heads), 2 layers, 4 experts, 2k vocabulary: a
                   # 128k-token step fits one H200 for the reference; Pallas flash attention takes any positions
                   # ('xla' materialises [S, S] scores per head: lengths up to ~16k)
                   cp_overrides=(("num_hidden_layers", 2), ("num_experts", 4), ("vocab_size", 2048),
                                 ("attention_impl", cp_attention), ("remat", "full")),
                   cp_lengths=tuple(cp_lengths), cp_check_steps=3, cp_steps=2, cp_attention="allgather",
                   # bf16 compute: different GEMM shapes and attention blocking round differently
                   cp_tolerance={"loss_rel": 5e-3, "grad_rel_l2": 5e-2},
                   run_steps=100, run_checkpoint_every=20, run_rows=16, run_seq=128, run_kill_at=45,
                   nproc=n, devices_per_process=1)

    @classmethod
    def cpu_smoke(cls, n: int, cp_attention: str = "xla") -> Settings:
        if n < 2 or n % 2:
            raise ValueError(f"the CPU smoke run needs an even number of emulated devices >= 2, got {n}")
        tiny = (("num_hidden_layers", 2), ("dtype", "float32"), ("remat", "none"))
        cp_tiny = tiny + (("attention_impl", cp_attention),)  # 'pallas' runs in interpret mode on CPU
        return cls(devices=n, smoke=True, coll_min_bytes=1 << 10, coll_max_bytes=16 << 10, coll_step=4,
                   dp_preset="tiny", dp_overrides=tiny, dp_seq=64, dp_rows_per_device=2, dp_warmup=1, dp_steps=1,
                   dp_ce_chunk=None, cp_overrides=cp_tiny, cp_lengths=(64,), cp_check_steps=2, cp_steps=1,
                   cp_attention="allgather", cp_tolerance={"loss_rel": 1e-4, "grad_rel_l2": 1e-3},
                   run_steps=6, run_checkpoint_every=2, run_rows=8, run_seq=32, run_kill_at=3,
                   nproc=2, devices_per_process=n // 2)

    def run_plan(self):
        from benchmarks.systems.scaling_runs import RunPlan
        return RunPlan(steps=self.run_steps, checkpoint_every=self.run_checkpoint_every, rows=self.run_rows,
                       seq_len=self.run_seq, kill_at=self.run_kill_at)


def counts_from_one(n: int) -> list[int]:
    from benchmarks.systems.topology import counts_up_to
    return [1] + counts_up_to(n)


def run_part(name: str, s: Settings, deadline: float, workdir: str, save, log=print) -> dict:
    """Runs one part in this process (jax is imported here, not in the orchestrator)."""
    if name in ("restore", "supervisor"):  # the trainers own the devices: this process must not take GPU memory
        return _runs(name, s, deadline, workdir)
    from benchmarks.systems.timing import device_summary
    head = {"device": device_summary()}
    if name == "collectives":
        return {**head, **_collectives(s)}
    if name == "dp":
        from zaya_jax.config import preset
        from benchmarks.systems import scaling_dp
        cfg = preset(s.dp_preset, **dict(s.dp_overrides))
        return scaling_dp.run(cfg, counts_from_one(s.devices), seq_len=s.dp_seq, rows_per_device=s.dp_rows_per_device,
                              warmup=s.dp_warmup, steps=s.dp_steps, ce_chunk=s.dp_ce_chunk, deadline=deadline,
                              save=lambda r: save({**head, **r}), log=log) | head
    if name == "cp":
        from zaya_jax.config import preset
        from benchmarks.systems import scaling_cp
        base = "tiny" if s.smoke else "zaya1_8b"
        cfg = preset(base, **{**dict(s.cp_overrides), "max_position_embeddings": max(s.cp_lengths)})
        cps = counts_from_one(s.devices)[1:]
        return scaling_cp.run(cfg, list(s.cp_lengths), cps, check_steps=s.cp_check_steps, warmup=1, steps=s.cp_steps,
                              attention=s.cp_attention, deadline=deadline, tolerance=s.cp_tolerance,
                              save=lambda r: save({**head, **r}), log=log) | head
    raise ValueError(f"unknown part {name!r}; parts: {PARTS}")


def _collectives(s: Settings) -> dict:
    from benchmarks.systems import collective_sweep
    names = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all")
    result = collective_sweep.sweep(min_bytes=s.coll_min_bytes, max_bytes=s.coll_max_bytes, step=s.coll_step,
                                    names=names, scopes=("node",))
    ref = NCCL_REFERENCE["all_reduce_busbw_ring_8gpu"]
    result["vs_reference"] = [{"n": row["n"], "collective": row["collective"], "peak_busbw": row["peak_busbw"],
                               "fraction_of_reference_ring_busbw": row["peak_busbw"] / ref}
                              for row in result["summary"]]
    return result


def _runs(name: str, s: Settings, deadline: float, workdir: str) -> dict:
    from benchmarks.systems import scaling_runs
    plan, gpu = s.run_plan(), not s.smoke
    ref_dir = os.path.join(workdir, "reference")
    out = {"plan": dataclasses.asdict(plan), "xla_deterministic_ops": gpu}
    if not os.path.exists(os.path.join(ref_dir, "metrics.jsonl")):
        shutil.rmtree(ref_dir, ignore_errors=True)  # an unfinished reference from an earlier try
        out["reference"] = scaling_runs.reference(ref_dir, plan, s.devices, max(30.0, deadline - time.time()), gpu=gpu)
        if "error" in out["reference"]:
            return out
    if name == "restore":
        fewer = max(1, s.devices // 2)
        out.update(scaling_runs.restore_on_fewer(ref_dir, os.path.join(workdir, f"restore_on_{fewer}"), plan,
                                                 s.devices, fewer, max(30.0, deadline - time.time()), gpu=gpu))
    else:
        out.update(scaling_runs.supervised_kill(ref_dir, os.path.join(workdir, "supervised"), plan, s.nproc,
                                                max(30.0, deadline - time.time()),
                                                platform="gpu" if gpu else "cpu",
                                                devices_per_process=s.devices_per_process))
    return out


def part_deadline(parts, now: float, end: float) -> float:
    """Deadline of the first of `parts`: its weight's share of the time left (time a part leaves unused goes to
    the parts after it)."""
    total = sum(WEIGHTS[p] for p in parts)
    return now + (end - now) * WEIGHTS[parts[0]] / total
