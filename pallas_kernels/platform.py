"""Which backend the kernels run on, and the launch parameters tuned for it.

Pallas reaches ROCm only through its Triton lowering, so every kernel here uses `plgpu.CompilerParams` (never
Mosaic GPU). On the CPU the same kernels run in interpret mode (slow, exact), which is what the tests use.
A ROCm wavefront is 64 lanes against a CUDA warp's 32, so `num_warps` on ROCm is half the CUDA value for the same
number of threads per program, and Triton's software pipelining on ROCm is driven by num_stages <= 2.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu


@functools.cache
def vendor() -> str:
    """'cpu', 'cuda' or 'rocm' for the default backend."""
    if jax.default_backend() == "cpu":
        return "cpu"
    dev = jax.devices()[0]
    text = f"{getattr(dev.client, 'platform_version', '')} {dev.device_kind}".lower()
    return "rocm" if ("rocm" in text or "amd" in text or "instinct" in text) else "cuda"


def interpret() -> bool:
    """Interpret mode on the CPU (Pallas has no CPU lowering), or when ZAYA_PALLAS_INTERPRET=1 forces it."""
    return vendor() == "cpu" or os.environ.get("ZAYA_PALLAS_INTERPRET") == "1"


def compiler_params(num_warps: int, num_stages: int) -> plgpu.CompilerParams:
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def dot_precision(dtype):
    """Precision of a kernel's dots: fp32 operands get full-precision dots (Triton would otherwise use TF32), bf16
    the tensor cores' native path."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


BACKWARDS = ("split", "tiles")
FORWARD_SHIFTS = ("bound", "online")


@dataclasses.dataclass(frozen=True)
class AttentionBlocks:
    """Tile sizes and launch parameters of the three attention kernels (forward, dq, dk/dv).

    `*_q` / `*_k` are query / key positions per tile; `dkv_heads` query heads of one KV head stacked into the same
    dk/dv tile (rows = positions x heads, see `_attention_kernels`; clipped to a power of two dividing the group)."""
    fwd_q: int = 128
    fwd_k: int = 64
    fwd_warps: int = 8
    fwd_stages: int = 3
    # Softmax shift of the forward: 'bound' subtracts each row's Cauchy-Schwarz bound on its logits where that is
    # small enough (no running maximum, no rescaling; see _attention_kernels), 'online' always keeps a running max.
    fwd_shift: str = "bound"
    dq_q: int = 128
    dq_k: int = 64
    dq_warps: int = 8
    dq_stages: int = 3
    dkv_q: int = 32
    dkv_k: int = 128
    dkv_warps: int = 8
    dkv_stages: int = 3
    dkv_heads: int = 1
    dkv_split: int = 0  # programs per KV head in dk/dv (0: enough to fill the GPU, see backward_dkv)
    # Backward: 'split' = a dq kernel over key blocks + a dk/dv kernel over query blocks (deterministic);
    # 'tiles' = the dk/dv kernel also writes each dS tile whole and contiguous,
    # and a dq kernel reads them back (5 matmuls per tile, deterministic, dS held in between; the split path is
    # used where dS would exceed TILES_MAX_BYTES).
    bwd: str = "split"
    tiles_dq_warps: int = 4  # the dq-from-dS-tiles kernel (one dk/dv query tile of rows per program)
    tiles_dq_stages: int = 3

    def __post_init__(self):
        if self.bwd not in BACKWARDS:
            raise ValueError(f"AttentionBlocks.bwd={self.bwd!r}: expected one of {BACKWARDS}")
        if self.fwd_shift not in FORWARD_SHIFTS:
            raise ValueError(f"AttentionBlocks.fwd_shift={self.fwd_shift!r}: expected one of {FORWARD_SHIFTS}")

    def clipped(self, q_len: int, kv_len: int) -> AttentionBlocks:
        """Shrinks tiles for short sequences (never below 16, the smallest Triton dot)."""
        def fit(block, n):
            return max(16, min(block, next_pow2(n)))
        return dataclasses.replace(
            self, fwd_q=fit(self.fwd_q, q_len), fwd_k=fit(self.fwd_k, kv_len), dq_q=fit(self.dq_q, q_len),
            dq_k=fit(self.dq_k, kv_len), dkv_q=fit(self.dkv_q, q_len), dkv_k=fit(self.dkv_k, kv_len))


# The attention tuning table. `python -m benchmarks.tune_kernels` prints a replacement row for the backend it runs on.
# ROCm values are untuned starting points.
_ATTENTION = {
    # Keys: the backend (`vendor()`). Fields (AttentionBlocks): fwd_* / dq_* / dkv_* are the forward, dq and dk/dv
    # kernels' tiles (`_q` query positions, `_k` key positions per tile), warps and software-pipeline stages;
    # `dkv_heads` stacks that many query heads of one KV head in a dk/dv tile; `bwd` picks the backward ('split' or
    # 'tiles'), `tiles_dq_*` launch the dq-from-dS-tiles kernel. Unset fields take the dataclass defaults.
    # CUDA row (H200, 8 q / 2 kv heads, d=128): 128 x 128 forward tiles with 8 warps and 3 stages were the fastest
    # forward under the bound shift; dk/dv stacks 2 query heads (closer to cuDNN than unstacked); the 'tiles'
    # backward is faster than 'split' at 4k (the long-row override below keeps 'split'). Variants measured slower
    # or not reachable from Pallas (lazy rescale, FMA-pipe exponentials, denormal flushing, one warpgroup per
    # program, register operands, warp specialization, TMA reduce-add, two-pass and fused atomic-dq backwards,
    # ...) were removed; their figures are in docs/experiments.md.
    "cuda": AttentionBlocks(fwd_q=128, fwd_k=128, fwd_warps=8, fwd_stages=3, dq_stages=4, dkv_q=32, dkv_heads=2,
                            bwd="tiles", tiles_dq_stages=2),
    # MI300X: 64-lane wavefronts (4 waves = 256 lanes), AMD's Triton pipeliner wants num_stages 1-2.
    "rocm": AttentionBlocks(fwd_q=128, fwd_k=64, fwd_warps=4, fwd_stages=1, dq_q=128, dq_k=64, dq_warps=4,
                            dq_stages=1, dkv_q=64, dkv_k=128, dkv_warps=4, dkv_stages=1),
    # Interpret mode: small tiles keep the CPU interpreter quick and exercise the multi-block paths.
    # Two stacked query heads per dk/dv tile, so the tests cover stacking wherever the group allows it.
    "cpu": AttentionBlocks(fwd_q=32, fwd_k=16, dq_q=32, dq_k=16, dkv_q=16, dkv_k=32, dkv_heads=2),
}


# Long query sequences (q_len >= the key): fields that replace the table's. On the H200 at long rows, dk/dv with 16
# positions x 4 stacked heads runs closer to cuDNN than unstacked, and 'split' is level with or faster than 'tiles'
# (docs/experiments.md).
_ATTENTION_LONG = {
    "cuda": (16384, dict(dkv_q=16, dkv_heads=4, bwd="split")),
}


def attention_blocks(head_dim: int, q_len: int = 0) -> AttentionBlocks:
    blocks = _ATTENTION[vendor()]
    long = _ATTENTION_LONG.get(vendor())
    if long is not None and q_len >= long[0]:
        blocks = dataclasses.replace(blocks, **long[1])
    if head_dim > 128 and vendor() != "cpu":  # fp32 accumulators of a q tile in registers, K/V stages in shared memory
        blocks = dataclasses.replace(blocks, fwd_q=64, fwd_k=64, fwd_warps=4, dq_q=64, dkv_k=64,
                                     dq_stages=min(blocks.dq_stages, 3))
    return blocks


@dataclasses.dataclass(frozen=True)
class NormLaunch:
    """Launch of a row-wise norm kernel: each of `programs_per_cu` x (compute units) programs walks a contiguous
    range of rows, `rows` rows (a [rows, block_d] tile) per loop step, with `num_warps` warps. programs_per_cu = 0
    launches one program per tile instead (no loop: many small resident programs hide the memory latency).
    `prefetch` tiles are loaded ahead of the one being reduced (held in registers: more bytes in flight per program
    at the cost of registers, see `_norm_kernels._row_loop`); 0 loads each tile in its own step."""
    rows: int
    num_warps: int
    programs_per_cu: int = 4
    num_stages: int = 1
    prefetch: int = 1

    def __post_init__(self):
        if self.prefetch < 0:
            raise ValueError(f"NormLaunch.prefetch must be >= 0 tiles ahead, got {self.prefetch}")


@dataclasses.dataclass(frozen=True)
class NormTuning:
    """Launch rule of one norm pass for any width: a loop step covers `step_elems` elements (whole rows, at most
    4), each lane holds `lane_elems` of them (this sets num_warps), `programs_per_cu` programs per compute unit,
    `prefetch` tiles loaded ahead (see NormLaunch)."""
    step_elems: int = 2048
    lane_elems: int = 8
    programs_per_cu: int = 4
    num_stages: int = 1
    prefetch: int = 1

    def launch(self, block_d: int) -> NormLaunch:
        rows = max(1, min(4, self.step_elems // block_d))
        lanes = 64 if vendor() == "rocm" else 32
        warps = max(1, min(16 if lanes == 32 else 8, rows * block_d // (self.lane_elems * lanes)))
        return NormLaunch(rows=rows, num_warps=_pow2_floor(warps), programs_per_cu=self.programs_per_cu,
                          num_stages=self.num_stages, prefetch=self.prefetch)


# The [D] parameter vectors (and, in the backward, the [D] partial sums) stay in registers for the whole row loop,
# so wide rows get more lanes rather than more registers per lane, and the bytes in flight come from tiles loaded
# ahead. On the H200 (D=2048) the fused merge backward reaches the most copy bandwidth with 16 warps x 1 program per
# SM and 3 tiles ahead; the forward stays at 8 warps x 6 programs, 1 ahead, which held up best in bench_kernels (a
# wider launch that won alone in the tuner did not; docs/experiments.md). `python -m benchmarks.kernels.tune_norm`
# prints new rows.
_NORM = {
    "cuda": {"fwd": NormTuning(2048, 8, 6, 1), "bwd": NormTuning(2048, 4, 1, 1, 3)},
    "rocm": {"fwd": NormTuning(2048, 8, 8, 1), "bwd": NormTuning(2048, 8, 4, 1)},
    "cpu": {"fwd": NormTuning(2048, 8, 8, 1), "bwd": NormTuning(2048, 8, 4, 1)},
}


@contextlib.contextmanager
def norm_tuning_override(fwd: NormTuning, bwd: NormTuning):
    """Kernels traced inside use these rules for this backend (the tuner times candidate rows end to end)."""
    saved = _NORM[vendor()]
    _NORM[vendor()] = {"fwd": fwd, "bwd": bwd}
    try:
        yield
    finally:
        _NORM[vendor()] = saved


def norm_tuning_of(launch: NormLaunch, block_d: int) -> NormTuning:
    """The table row that reproduces `launch` at width block_d (for printing tuned launches)."""
    lanes = 64 if vendor() == "rocm" else 32
    return NormTuning(step_elems=launch.rows * block_d, lane_elems=launch.rows * block_d // (launch.num_warps * lanes),
                      programs_per_cu=launch.programs_per_cu, num_stages=launch.num_stages, prefetch=launch.prefetch)


def norm_launch(block_d: int, phase: str = "fwd") -> NormLaunch:
    if phase not in ("fwd", "bwd"):
        raise ValueError(f"norm phase must be 'fwd' or 'bwd', got {phase!r}")
    return _NORM[vendor()][phase].launch(block_d)


def pad_to_multiple(x, axis: int, multiple: int):
    """x zero-padded at the end of `axis` to a whole number of `multiple` (unchanged when it already is)."""
    extra = -x.shape[axis] % multiple
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)


def compute_units() -> int:
    """SMs (CUDA) or CUs (ROCm) of the first device; a nominal 132 where the backend does not say."""
    return int(getattr(jax.devices()[0], "core_count", None) or 132)


def norm_programs(launch: NormLaunch, n_rows: int) -> int:
    if launch.programs_per_cu < 0:
        raise ValueError(f"programs_per_cu must be >= 0 (0: one program per tile), got {launch.programs_per_cu}")
    if launch.programs_per_cu == 0:
        return -(-n_rows // launch.rows)
    if vendor() == "cpu":
        return 4
    return launch.programs_per_cu * compute_units()


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, int(n)).bit_length() - 1)
