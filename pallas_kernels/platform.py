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


BACKWARDS = ("split", "atomic", "tiles")
FORWARD_SHIFTS = ("bound", "online")


@dataclasses.dataclass(frozen=True)
class AttentionBlocks:
    """Tile sizes and launch parameters of the three attention kernels (forward, dq, dk/dv).

    `*_q` / `*_k` are query / key positions per tile; `*_heads` query heads of one KV head stacked into the same
    tile (rows = positions x heads, see `_attention_kernels`; clipped to a power of two dividing the group)."""
    fwd_q: int = 128
    fwd_k: int = 64
    fwd_warps: int = 8
    fwd_stages: int = 3
    fwd_heads: int = 1
    # Softmax shift of the forward: 'bound' subtracts each row's Cauchy-Schwarz bound on its logits where that is
    # small enough (no running maximum, no rescaling; see _attention_kernels), 'online' always keeps a running max.
    fwd_shift: str = "bound"
    dq_q: int = 128
    dq_k: int = 64
    dq_warps: int = 8
    dq_stages: int = 3
    dq_heads: int = 1
    dkv_q: int = 32
    dkv_k: int = 128
    dkv_warps: int = 8
    dkv_stages: int = 3
    dkv_heads: int = 1
    dkv_split: int = 0  # programs per KV head in dk/dv (0: enough to fill the GPU, see backward_dkv)
    # Backward: 'split' = a dq kernel over key blocks + a dk/dv kernel over query blocks (deterministic);
    # 'atomic' = one kernel with the dk/dv tiling adding dq with fp32 atomics (5 matmuls per tile instead of 7,
    # summation order of dq not fixed); 'tiles' = the dk/dv kernel also writes each dS tile whole and contiguous,
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
    # H200, 8 q / 2 kv heads, d=128 (benchmarks/attention_fwd_variants_h200.json): forward 128 x 128 tiles with 8
    # warps, 0.354 ms at B=4, T=4096 against 0.372 for 64 x 64 with 4 warps (4.66 against 4.93 ms at T=32768 in
    # that run; 4.80-4.90 in later ones);
    # 256-row tiles and stacked heads measured slower, and so did two loop variants since removed: the next block's
    # QK^T issued before this block's softmax (Triton waits for it at once: 1.2-1.7x the time) and the accumulator
    # rescaled only when a row maximum grows past 2^8 (FA4's lazy rescale: 1.03-1.08x the time). dq with 4
    # pipeline stages: level with 3 within noise (5.54 against 5.59 ms at 32k). dk/dv with 2 stacked query heads:
    # fwd+bwd 0.90x cuDNN at B=4, T=4096 against 0.82x unstacked (benchmarks/attention_bwd_h200.json). A backward
    # whose dk/dv kernel also stored dS for a one-matmul dq kernel (5 matmuls per tile, like cuDNN's, against the
    # split path's 7) measured 16.7 against 13.7 ms at T=32768 (the scattered dS stores) and level at 4096
    # (benchmarks/attention_stored_ds_h200.json); it was removed again. The fused backward ('atomic') with relaxed
    # atomics (_relaxed_atomic.py) measured fwd+bwd 22.1 against 40.7 ms with acq_rel at T=32768 (1.60 against
    # 3.04 at 4096), still behind split's 18.4 / 1.31: its 4.3G fp32 adds at 32k, one per (query row, head, key
    # block), cost ~7.5 ms (benchmarks/attention_relaxed_atomic_h200.json). The 'tiles' backward (dS written as
    # whole tiles, a one-matmul dq kernel): at B=4, T=4096 fwd+bwd 1.250 / 1.253 ms against split's 1.309 / 1.313
    # in two runs (dk/dv + dS 0.59 ms against 0.53, dq 0.29 against 0.41); at T=32768 level or 1% slower (dk/dv +
    # dS 9.6 against 7.8 ms, dq 4.1 against 5.6), so the long row keeps split (benchmarks/attention_tiles_h200*.json).
    # Measured slower and removed: 2 or 4 query tiles per dq program, and dS slots laid out query-major (dq loads at
    # affine addresses, the dk/dv kernel's stores through a per-step table: dk/dv + dS 0.67 against 0.59 ms at 4k,
    # benchmarks/attention_tiles_querymajor_h200.json); 128-row dS tiles (32 positions x 4 heads, one K byte per dS
    # byte in the dq kernel) exceed shared memory at 3 stages and run the dk/dv kernel 3-4x slower at 2
    # (benchmarks/attention_tiles128_h200.json). Triton's Hopper warp specialization (a producer warp group feeding
    # the matmuls, as FA3 and cuDNN do) cannot be reached from Pallas: with `tt.warp_specialize` set on the loops of
    # the lowered module and 4 warps, XLA's Triton pipeline aborts ("unsupported load type for producer commit"), for
    # a plain matmul loop too; its producer partition needs TMA descriptor loads, which the Pallas Triton lowering
    # does not emit (benchmarks/warp_specialize_probe_h200.json). Exponentials of
    # the unmasked tiles moved off the special-function unit onto the FMA pipes (a cubic polynomial and an exponent
    # add, FlashAttention-4's trick; half or all of each key tile) made every kernel slower at both shapes: forward
    # 5.20 / 5.80 ms for half / all against 4.73 at T=32768, dq 6.60 against 5.56 with all, split dk/dv tiles 2.8x
    # slower (benchmarks/attention_fma_exp_h200.json). The ~8 added FMA-pipe ops per logit cost what they would if
    # run alone, so the kernels are bound by issued instructions next to the matmuls, not by the exp unit; the
    # option was removed. Flushing denormals (XLA_FLAGS=--xla_gpu_ftz=true) drops the fix-up every exp2 carries without
    # it (FSETP + two predicated FMULs around MUFU.EX2: forward 26.2M -> 19.6M executed instructions, dk/dv 51.1M ->
    # 44.7M at B=1, T=4096; benchmarks/attention_sass_ftz_h200.json) yet made the forward slower, 4.59 / 4.58 against
    # 4.29 / 4.32 ms at T=32768 in alternating runs (fwd+bwd 18.52 / 18.34 against 18.15 / 18.13; 4096 likewise):
    # the exponentials then issue back to back and stall on the MUFU pipe (benchmarks/attention_ftz_ab_h200.json,
    # earlier benchmarks/attention_ftz_h200.json). One warpgroup per program, so that two programs per SM keep
    # separate barriers and one's exponentials can meet the other's matmuls: forward 128 x 64 / 128 x 32 / 64 x 64
    # tiles at 4 warps 5.69 / 4.95 / 4.79 ms against 4.23, dq and dk/dv likewise slower
    # (benchmarks/attention_one_warpgroup_h200.json). Issue order, measured and removed: dO . V^T issued right after
    # Q . K^T in dq and dk/dv (before the exponentials), and each forward step as two half-width key tiles with both
    # Q . K^T first (the second half's exponentials beside the first half's P . V): kernels 1-2% faster alone, fwd+bwd
    # at T=32768 18.20 / 18.15 / 18.20 against 18.03 / 18.08 / 18.13 ms in three alternating runs
    # (benchmarks/attention_issue_order_h200.json). 128-row tiles of stacked heads (each K/V tile read once for 2 or 4
    # query heads) at T=32768: forward 32 x 4 / 64 x 2 rows 4.63 / 4.70 against 4.32 ms, dq 6.58 / 6.64 against 5.88
    # (benchmarks/attention_stacked_heads_32k_h200.json): K/V traffic does not limit them. The loop-invariant matmul
    # operands (forward q; dq's q and dO; dk/dv's k and v) doubled in registers (exact), so that Triton feeds them to
    # the tensor cores from registers, not shared memory: forward 4.73 against 4.27 ms, dq 6.65 against 5.54, dk/dv
    # 8.99 against 7.92 at T=32768, slower at 4096 too (benchmarks/attention_regs_h200.json); removed. The bulk
    # reduce-add of the tensor memory accelerator, with which FA3 and cuDNN add dq tiles (the fused backward's 5
    # matmuls without per-element atomics), is not reachable: a device-side tensor descriptor faults because XLA passes
    # Triton's global scratch buffer as a null pointer, and building one by hand needs TritonNvidiaGPU ops XLA does not
    # parse (benchmarks/attention_tma_probe_h200.json). The forward's key-norm
    # bound shift (fwd_shift='bound': no running maximum or rescaling) took T=32768 from 4.70 to 4.22 ms, level at
    # 4096 (benchmarks/attention_fwd_shift_h200.json); under it the 128 x 128 forward tile with 8 warps and 3 stages
    # stays the fastest of 11 at 32k (256 x 64 with 16 warps 4.34, 128 x 64 4.77 against 4.26 ms;
    # benchmarks/attention_fwd_bound_tiles_h200.json). Its row sums as p . ones[block_k, 16] on the tensor cores,
    # reduced once at the end: 128 x 128 tiles then exceed shared memory, 128 x 64 ones took 4.83 ms
    # (benchmarks/attention_fwd_rowsum_h200.json); removed. Nsight Compute at B=1, T=16384
    # (benchmarks/attention_ncu_16k_h200.json): the split dq and dk/dv kernels keep the
    # tensor pipe 62% active, cuDNN's backward 64%: the backward's gap is its 7 matmuls per tile against cuDNN's 5,
    # not their efficiency. The forward 54% against cuDNN's 74% (its cp.async loads issued by every thread, CTA-wide
    # barriers keeping the two warpgroups in step; cuDNN's TMA producer warps let them alternate). The fused
    # 'atomic' backward at 128 keys x 64 rows needs 255 registers and spills (28M spilling instructions, tensor 34%
    # active); 64-key tiles halve its accumulators but double its dq atomics: 28.0 against split's 13.8 ms at
    # T=32768, and 32-row tiles 18.7 (benchmarks/attention_atomic_k64_h200.json). Two kernels over key blocks, dv
    # alone (2 matmuls per tile) then dk with dq added atomically (4; one accumulator live in each, correct on the
    # H200): backward 18.8 against split's 14.1 ms at T=32768, 1.25 against 0.89 at 4096: the atomic dq adds, not the
    # spills, cost most; removed (benchmarks/attention_two_pass_h200.json).
    "cuda": AttentionBlocks(fwd_q=128, fwd_k=128, fwd_warps=8, fwd_stages=3, dq_stages=4, dkv_q=32, dkv_heads=2,
                            bwd="tiles", tiles_dq_stages=2),
    # MI300X: 64-lane wavefronts (4 waves = 256 lanes), AMD's Triton pipeliner wants num_stages 1-2.
    "rocm": AttentionBlocks(fwd_q=128, fwd_k=64, fwd_warps=4, fwd_stages=1, dq_q=128, dq_k=64, dq_warps=4,
                            dq_stages=1, dkv_q=64, dkv_k=128, dkv_warps=4, dkv_stages=1),
    # Interpret mode: small tiles keep the CPU interpreter quick and exercise the multi-block paths.
    # Two stacked query heads per tile, so the tests cover stacking wherever the group allows it.
    "cpu": AttentionBlocks(fwd_q=32, fwd_k=16, dq_q=32, dq_k=16, dkv_q=16, dkv_k=32, fwd_heads=2, dq_heads=2,
                           dkv_heads=2),
}


# Long query sequences (q_len >= the key): fields that replace the table's. On the H200 at B=1, T=32768, dk/dv with 16
# positions x 4 stacked heads: 0.77x cuDNN against 0.69x unstacked (benchmarks/attention_bwd_h200.json).
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
# ahead. On the H200 (D=2048, 16384 rows; benchmarks/norm_h200.json, kernels_h200.json) the fused merge backward runs
# at 0.79 of copy bandwidth with 16 warps x 1 program per SM and 3 tiles ahead (8 warps x 2, 1 ahead: 0.74). The
# forward stays at 8 warps x 6 programs, 1 ahead (0.84-0.86 in bench_kernels): 16 warps x 2, 3 ahead measured 0.86
# alone in the tuner but 0.78-0.84 in bench_kernels. `python -m benchmarks.kernels.tune_norm` prints new rows.
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
