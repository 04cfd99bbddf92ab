"""Measurements behind `python -m benchmarks.bench_kernels`: ceilings, norm and attention timings, launch sweeps.

Timing: each measurement jits the function, runs it a few times to compile and warm up, then takes the median
over `reps` repeats of (n back-to-back calls, then block_until_ready) / n, n large enough for a ~20 ms sample.
Inputs are fresh random arrays (never zeros) and larger than the L2 cache. Bytes count each input read once and each
output written once; attention FLOPs count the causal forward as 2*B*T^2*H*d (half of the dense 4*B*T^2*H*d) and
forward+backward as 3.5x that.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import _attention_blocks as blocks_lib
from pallas_kernels import _attention_kernels as attn_kern
from pallas_kernels import _norm_kernels as norm_kern
from pallas_kernels import cca_attention, platform, rmsnorm
from pallas_kernels import cca_conv as cca_conv_kernels
from pallas_kernels import qk_norm_rope as qk_kernels
from pallas_kernels.platform import AttentionBlocks, NormLaunch
from zaya_jax.model.cca import same_segment_masks
from zaya_jax.ops import attention as attn_ops
from zaya_jax.ops import rmsnorm as norm_ops
from zaya_jax.ops import qk_norm_rope as qk_ops
from zaya_jax.ops.cca_conv import halo, qk_mix
from benchmarks.systems.timing import calls_for, seconds_per_call

BF16, F32 = jnp.bfloat16, jnp.float32
EPS = 1e-5


def time_call(fn, *args, reps: int = 7, calls: int = 10, warmup: int = 2, min_sample_s: float = 0.02) -> float:
    """Median seconds per call of an already-jitted fn. Each sample holds at least `calls` calls and enough of them
    to last about `min_sample_s`: a 0.1 ms kernel timed over 10 calls would carry the first dispatch's latency
    (tens of microseconds) as a few percent of its time."""
    probe = seconds_per_call(fn, *args, reps=1, calls=1, warmup=warmup)
    return seconds_per_call(fn, *args, reps=reps, calls=max(calls, calls_for(probe, min_sample_s)), warmup=0)


def attempt(fn, *args, **kwargs):
    """(fn(*args, **kwargs), None), or (None, the error's text) when it raises: a config that does not compile
    (shared memory, registers) is recorded in a sweep, not fatal to the measurements around it."""
    try:
        return fn(*args, **kwargs), None
    except Exception as e:  # noqa: BLE001 - Triton/XLA compile errors come in many types
        return None, f"{type(e).__name__}: {str(e)[:300]}"


def _normal(key, shape, dtype, scale=1.0):
    return (scale * jax.random.normal(key, shape, F32)).astype(dtype)


# ------------------------------------------------------------------------------------------------- ceilings
def gemm_ceiling_tflops(n: int = 8192) -> float:
    ka, kb = jax.random.split(jax.random.key(0))
    a, b = _normal(ka, (n, n), BF16), _normal(kb, (n, n), BF16)
    t = time_call(jax.jit(lambda a, b: a @ b), a, b, calls=5)
    return 2 * n ** 3 / t / 1e12


def copy_ceiling_tbps(n_bytes: int = 2 ** 30) -> float:
    """Read + write bandwidth of a streaming scale (y = 1.5 x) over an fp32 buffer of n_bytes."""
    x = _normal(jax.random.key(1), (n_bytes // 4,), F32)
    t = time_call(jax.jit(lambda x: x * 1.5), x)
    return 2 * n_bytes / t / 1e12


# ---------------------------------------------------------------------------------------------------- norms
def norm_problem(rows: int, d: int):
    k = jax.random.split(jax.random.key(2), 10)
    vecs = [1.0 + 0.1 * jax.random.normal(k[i], (d,)) for i in range(6)]
    return dict(branch=_normal(k[6], (rows, d), BF16), residual=_normal(k[7], (rows, d), F32, 4.0),
                dh=_normal(k[8], (rows, d), F32), dy=_normal(k[9], (rows, d), BF16), vecs=vecs)


def _norm_fns(kind: str, impl: str):
    """(fwd, fwd+bwd) jitted functions over a problem dict, and their byte counts per element."""
    ops = {"pallas": rmsnorm, "xla": None}[impl]
    if kind == "merge_rms_norm":
        fn = ops.merge_rms_norm if ops else norm_ops.merge_rms_norm_reference
        fwd = jax.jit(lambda p: fn(p["branch"], p["residual"], *p["vecs"][:5], EPS, BF16))

        def fwd_bwd(p):
            out, pull = jax.vjp(lambda b, r, *v: fn(b, r, *v, EPS, BF16), p["branch"], p["residual"],
                                *p["vecs"][:5])
            return out, pull((p["dh"], p["dy"]))
        return fwd, jax.jit(fwd_bwd), (2 + 4 + 4 + 2), (2 + 4 + 4 + 2) + (2 + 4 + 4 + 2 + 2 + 4)
    if kind == "rms_norm":
        fn = ops.rms_norm if ops else norm_ops.rms_norm_reference
        fwd = jax.jit(lambda p: fn(p["residual"], p["vecs"][0], EPS, BF16))

        def fwd_bwd(p):
            out, pull = jax.vjp(lambda x, w: fn(x, w, EPS, BF16), p["residual"], p["vecs"][0])
            return out, pull(p["dy"])
        return fwd, jax.jit(fwd_bwd), 4 + 2, (4 + 2) + (4 + 2 + 4)
    fn = ops.layer_norm if ops else norm_ops.layer_norm_reference
    fwd = jax.jit(lambda p: fn(p["residual"], p["vecs"][0], p["vecs"][1], EPS, BF16))

    def fwd_bwd(p):
        out, pull = jax.vjp(lambda x, w, b: fn(x, w, b, EPS, BF16), p["residual"], p["vecs"][0], p["vecs"][1])
        return out, pull(p["dy"])
    return fwd, jax.jit(fwd_bwd), 4 + 2, (4 + 2) + (4 + 2 + 4)


def bench_norms(shapes, copy_tbps: float):
    rows_out = []
    for rows, d in shapes:
        p = norm_problem(rows, d)
        for kind in ("merge_rms_norm", "rms_norm", "layer_norm"):
            entry = dict(kind=kind, rows=rows, d=d)
            for impl in ("pallas", "xla"):
                fwd, fwd_bwd, fwd_bytes, total_bytes = _norm_fns(kind, impl)
                for phase, fn, nbytes in (("fwd", fwd, fwd_bytes), ("fwdbwd", fwd_bwd, total_bytes)):
                    t = time_call(fn, p)
                    tbps = rows * d * nbytes / t / 1e12
                    entry[f"{impl}_{phase}_ms"] = t * 1e3
                    entry[f"{impl}_{phase}_tbps"] = tbps
                    entry[f"{impl}_{phase}_vs_copy"] = tbps / copy_tbps
            for phase in ("fwd", "fwdbwd"):
                entry[f"{phase}_speedup_vs_xla"] = entry[f"xla_{phase}_ms"] / entry[f"pallas_{phase}_ms"]
            rows_out.append(entry)
            e = entry
            print(f"  {kind:15s} rows={rows:6d} fwd {e['pallas_fwd_ms']:.3f} ms ({e['pallas_fwd_tbps']:.2f} TB/s, "
                  f"xla x{e['fwd_speedup_vs_xla']:.2f})  fwd+bwd {e['pallas_fwdbwd_ms']:.3f} ms "
                  f"({e['pallas_fwdbwd_tbps']:.2f} TB/s, xla x{e['fwdbwd_speedup_vs_xla']:.2f})", flush=True)
    return rows_out


NORM_PASS_BYTES = {"fwd": 12, "bwd": 18}  # per element of the fused merge: see _norm_fns


def _cca_conv_fns(impl: str, heads: int, same_segment):
    def fwd(xp, w1, b1, w2, b2):
        return qk_mix(xp, w1, b1, w2, b2, heads, same_segment, impl=impl)

    def fwd_bwd(xp, w1, b1, w2, b2, dout):
        out, pull = jax.vjp(fwd, xp, w1, b1, w2, b2)
        return out, pull(dout)
    return jax.jit(fwd), jax.jit(fwd_bwd)


def bench_cca_conv(shapes, copy_tbps: float, t0: int = 2, t1: int = 2, sweep=()):
    """CCA's q/k mixing (both convolutions and the mean residual paths; bf16 [B, T + halo, C] in, [B, T, C] out):
    Pallas vs XLA on the same inputs, bandwidth against the copy ceiling counting the arrays the op must move (forward:
    xp in, out; backward: xp and d out in, d xp out). With `documents`, same-document masks of packed rows (a
    document boundary every ~64 positions)."""
    out = []
    for B, T, heads, kv, d, documents in shapes:
        k = jax.random.split(jax.random.key(B * T + heads), 6)
        P, G = halo(t0, t1), heads + kv
        C = G * d
        xp = _normal(k[0], (B, T + P, C), BF16)
        w1, b1 = _normal(k[1], (C, t0), F32, 0.5), _normal(k[2], (C,), F32, 0.1)
        w2, b2 = _normal(k[3], (G, d, d, t1), BF16, d ** -0.5), _normal(k[4], (C,), F32, 0.1)
        dout = _normal(k[5], (B, T, C), BF16)
        same = same_segment_masks(jnp.broadcast_to(jnp.arange(T) // 64, (B, T)), P) if documents else None
        nbytes = {"fwd": 2 * 2 * B * T * C, "fwdbwd": 5 * 2 * B * T * C}
        entry = dict(B=B, T=T, heads=heads, kv=kv, d=d, t0=t0, t1=t1, documents=documents)
        for impl in ("pallas", "xla"):
            fwd, fwd_bwd = _cca_conv_fns(impl, heads, same)
            for phase, t in (("fwd", time_call(fwd, xp, w1, b1, w2, b2)),
                             ("fwdbwd", time_call(fwd_bwd, xp, w1, b1, w2, b2, dout))):
                entry[f"{impl}_{phase}_ms"] = t * 1e3
                entry[f"{impl}_{phase}_vs_copy"] = nbytes[phase] / t / 1e12 / copy_tbps
        for phase in ("fwd", "fwdbwd"):
            entry[f"{phase}_speedup_vs_xla"] = entry[f"xla_{phase}_ms"] / entry[f"pallas_{phase}_ms"]
        if sweep:  # other tiles of the three kernels, end to end (cca_conv.tiles_override's arguments)
            entry["sweep"] = []
            for head, depthwise, *per_cu in sweep:
                with cca_conv_kernels.tiles_override(head, depthwise, *per_cu):
                    fwd, fwd_bwd = _cca_conv_fns("pallas", heads, same)
                    times = {"fwd_ms": time_call(fwd, xp, w1, b1, w2, b2) * 1e3,
                             "fwdbwd_ms": time_call(fwd_bwd, xp, w1, b1, w2, b2, dout) * 1e3}
                entry["sweep"].append(dict(head=head, depthwise=depthwise, programs_per_cu=per_cu, **times))
                print(f"    tiles head={head} depthwise={depthwise} programs/CU {per_cu}: "
                      f"fwd {times['fwd_ms']:.3f} ms, fwd+bwd {times['fwdbwd_ms']:.3f} ms", flush=True)
        e = entry
        print(f"  cca qk mix B={B} T={T} heads={heads}+{kv}x{d} documents={documents}: fwd {e['pallas_fwd_ms']:.3f} ms "
              f"({e['pallas_fwd_vs_copy']:.2f} of copy, xla x{e['fwd_speedup_vs_xla']:.2f})  fwd+bwd "
              f"{e['pallas_fwdbwd_ms']:.3f} ms ({e['pallas_fwdbwd_vs_copy']:.2f} of copy, "
              f"xla x{e['fwdbwd_speedup_vs_xla']:.2f})", flush=True)
        out.append(entry)
    return out


QK_CHAIN = 16  # decode-sized forward calls chained in one program: one alone would time host dispatch


def _qk_fns(impl: str, heads: int, chained: bool):
    fn = qk_ops.qk_norm_rope_reference if impl == "xla" else qk_ops.qk_norm_rope_kernel

    def chain(qk, temp, cos, sin):  # each call's outputs concatenated into the next one's input (a small copy)
        return jax.lax.fori_loop(0, QK_CHAIN, lambda _, x: jnp.concatenate(fn(x, temp, cos, sin, heads), 2), qk)

    def fwd_bwd(qk, temp, cos, sin, dq, dk):
        out, pull = jax.vjp(lambda qk, temp: fn(qk, temp, cos, sin, heads), qk, temp)
        return pull((dq, dk))

    return jax.jit(chain if chained else lambda *a: fn(*a, heads)), jax.jit(fwd_bwd)


def bench_qk_norm_rope(shapes, copy_tbps: float, sweep=()):
    """CCA's QK norm + RoPE (bf16 [B, T, H + KV, d] in, q and k out): the Pallas forward against XLA's on the same
    inputs, per call (decode sizes, B * T < 4096: per call of a chain of QK_CHAIN dependent calls in one program);
    forward+backward (the kernel's backward is XLA's) at the larger sizes. Bandwidth against the copy ceiling counts
    qk read and q, k written."""
    out = []
    for B, T, heads, kv, d, r in shapes:
        k = jax.random.split(jax.random.key(B * T), 5)
        qk = _normal(k[0], (B, T, heads + kv, d), BF16)
        temp = 1.0 + 0.1 * jax.random.normal(k[1], (kv,))
        cos, sin = qk_ops.rope_tables(jax.random.randint(k[2], (B, T), 0, 1 << 20), qk_ops.rope_inv_freq(1e4, 2 * r),
                                      BF16)
        dq, dk = _normal(k[3], (B, T, heads, d), BF16), _normal(k[4], (B, T, kv, d), BF16)
        entry = dict(B=B, T=T, heads=heads, kv=kv, d=d, rotary_half=r)
        small = B * T < 4096
        calls = QK_CHAIN if small else 1
        entry["timed_as_chain"] = small
        for impl in ("pallas", "xla"):
            fwd, fwd_bwd = _qk_fns(impl, heads, small)
            entry[f"{impl}_fwd_us"] = time_call(fwd, qk, temp, cos, sin) / calls * 1e6
            if not small:
                entry[f"{impl}_fwdbwd_us"] = time_call(fwd_bwd, qk, temp, cos, sin, dq, dk) * 1e6
        entry["fwd_speedup_vs_xla"] = entry["xla_fwd_us"] / entry["pallas_fwd_us"]
        entry["pallas_fwd_vs_copy"] = 2 * qk.nbytes / (entry["pallas_fwd_us"] * 1e-6) / 1e12 / copy_tbps
        if "xla_fwdbwd_us" in entry:
            entry["fwdbwd_speedup_vs_xla"] = entry["xla_fwdbwd_us"] / entry["pallas_fwdbwd_us"]
        if sweep and not small:
            entry["sweep"] = []
            for rows, warps in sweep:
                with qk_kernels.tiles_override(rows, warps):
                    fwd, _ = _qk_fns("pallas", heads, small)
                    us = time_call(fwd, qk, temp, cos, sin) * 1e6
                entry["sweep"].append(dict(rows=rows, warps=warps, fwd_us=us))
                print(f"    tiles rows={rows} warps={warps}: fwd {us:.1f} us", flush=True)
        print(f"  qk norm + rope B={B} T={T}: fwd {entry['pallas_fwd_us']:.1f} us against xla "
              f"{entry['xla_fwd_us']:.1f} (x{entry['fwd_speedup_vs_xla']:.2f}, {entry['pallas_fwd_vs_copy']:.2f} of "
              f"copy)" + (f"; fwd+bwd x{entry['fwdbwd_speedup_vs_xla']:.2f}" if "fwdbwd_speedup_vs_xla" in entry
                          else ""), flush=True)
        out.append(entry)
    return out


def merge_pass_fn(p, phase: str, launch: NormLaunch):
    """The fused merge's forward or backward kernel alone under `launch`, jitted, over a norm_problem dict (the
    backward reads p["rstd"], set here from the table's forward if p has none)."""
    if phase == "fwd":
        return jax.jit(lambda p: norm_kern.merge_forward(p["branch"], p["residual"], *p["vecs"][:5], eps=EPS,
                                                         out_dtype=BF16, launch=launch))
    if "rstd" not in p:
        p["rstd"] = norm_kern.merge_forward(p["branch"], p["residual"], *p["vecs"][:5], eps=EPS, out_dtype=BF16)[2]
    return jax.jit(lambda p: norm_kern.merge_backward(p["branch"], p["residual"], p["dh"], p["dy"], p["rstd"],
                                                      *p["vecs"][:5], launch=launch))


def time_norm_pass(p, phase: str, launch: NormLaunch) -> float:
    """Seconds per call of the fused merge's forward or backward kernel alone under `launch`."""
    return time_call(merge_pass_fn(p, phase, launch), p)


def time_merge_fwd_bwd(p, impl: str) -> float:
    """Seconds per call of the fused merge's forward + backward (jax.vjp), 'pallas' (current tables) or 'xla'."""
    return time_call(_norm_fns("merge_rms_norm", impl)[1], p)


def sweep_norm_launch(rows: int, d: int, fwd_launches, bwd_launches):
    """Times the fused merge kernels alone under each launch; returns the timings and the fastest of each."""
    p = norm_problem(rows, d)
    timings = {phase: {L: time_norm_pass(p, phase, L) for L in launches}
               for phase, launches in (("fwd", fwd_launches), ("bwd", bwd_launches))}

    def table(phase):
        nbytes = rows * d * NORM_PASS_BYTES[phase]
        return [dict(dataclasses.asdict(L), ms=t * 1e3, tbps=nbytes / t / 1e12) for L, t in timings[phase].items()]
    return (dict(fwd=table("fwd"), bwd=table("bwd")), min(timings["fwd"], key=timings["fwd"].get),
            min(timings["bwd"], key=timings["bwd"].get))


# ------------------------------------------------------------------------------------------------ attention
def attention_flops(B, T, H, d, fwd_bwd: bool) -> float:
    return 2.0 * B * T * T * H * d * (3.5 if fwd_bwd else 1.0)


def _attention_problem(B, T, H, KV, d):
    k = jax.random.split(jax.random.key(3), 4)
    return (_normal(k[0], (B, T, H, d), BF16), _normal(k[1], (B, T, KV, d), BF16),
            _normal(k[2], (B, T, KV, d), BF16), _normal(k[3], (B, T, H, d), BF16))


def _attention_fns(impl: str, blocks: AttentionBlocks | None):
    if impl == "pallas":
        def fn(q, k, v):
            return cca_attention.attention(q, k, v, blocks=blocks)
    elif impl == "pallas_positions":  # what the model calls: explicit position arrays, loop ranges built per call
        def fn(q, k, v):
            pos = jnp.broadcast_to(jnp.arange(q.shape[1], dtype=jnp.int32), q.shape[:2])
            return cca_attention.attention(q, k, v, q_positions=pos, kv_positions=pos, blocks=blocks)
    elif impl == "cudnn":
        def fn(q, k, v):
            return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    else:
        def fn(q, k, v):
            return attn_ops.attention_reference(q, k, v)

    def fwd_bwd(q, k, v, do):
        o, pull = jax.vjp(fn, q, k, v)
        return o, pull(do)
    return jax.jit(fn), jax.jit(fwd_bwd)


def bench_attention(shapes, impls_for):
    """Each shape with the library's own tiles for it (the table row of its sequence length)."""
    out = []
    for (B, T, H, KV, d) in shapes:
        q, k, v, do = _attention_problem(B, T, H, KV, d)
        blocks = platform.attention_blocks(d, T)
        entry = dict(B=B, T=T, H=H, KV=KV, d=d, blocks=dataclasses.asdict(blocks))
        for impl in impls_for(T):
            fwd, fwd_bwd = _attention_fns(impl, blocks)
            try:
                t_f = time_call(fwd, q, k, v, calls=5)
                t_fb = time_call(fwd_bwd, q, k, v, do, calls=3)
            except Exception as e:
                entry[f"{impl}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
                print(f"  {impl} T={T}: {entry[f'{impl}_error']}", flush=True)
                continue
            entry[f"{impl}_fwd_ms"], entry[f"{impl}_fwdbwd_ms"] = t_f * 1e3, t_fb * 1e3
            entry[f"{impl}_fwd_tflops"] = attention_flops(B, T, H, d, False) / t_f / 1e12
            entry[f"{impl}_fwdbwd_tflops"] = attention_flops(B, T, H, d, True) / t_fb / 1e12
            print(f"  {impl:17s} B={B} T={T:6d}: fwd {t_f * 1e3:8.3f} ms {entry[f'{impl}_fwd_tflops']:6.1f} TF/s | "
                  f"fwd+bwd {t_fb * 1e3:8.3f} ms {entry[f'{impl}_fwdbwd_tflops']:6.1f} TF/s", flush=True)
        for base in ("xla", "cudnn"):
            for phase in ("fwd", "fwdbwd"):
                if f"{base}_{phase}_ms" in entry and f"pallas_{phase}_ms" in entry:
                    entry[f"pallas_{phase}_vs_{base}"] = entry[f"{base}_{phase}_ms"] / entry[f"pallas_{phase}_ms"]
        out.append(entry)
    return out


@dataclasses.dataclass
class AttentionPassProblem:
    """Inputs of the three attention kernels at one shape: q, k, v, do and the forward's lse2 / delta."""
    q: jax.Array
    k: jax.Array
    v: jax.Array
    do: jax.Array
    pos: jax.Array
    np_pos: np.ndarray
    lse2: jax.Array
    delta: jax.Array

    @property
    def flops_fwd(self) -> float:
        B, T, H, d = self.q.shape
        return attention_flops(B, T, H, d, False)


def attention_pass_problem(B, T, H, KV, d, base: AttentionBlocks) -> AttentionPassProblem:
    q, k, v, do = _attention_problem(B, T, H, KV, d)
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    np_pos = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))
    rg = blocks_lib.ranges(np_pos, np_pos, None, None, None, base.fwd_q, base.fwd_k, per_kv_block=False, static=True)
    o, lse2 = attn_kern.forward(q, k, v, pos, pos, None, None, None, rg, scale=d ** -0.5, blocks=base)
    delta = jnp.einsum("bthd,bthd->bht", o.astype(F32), do.astype(F32))
    return AttentionPassProblem(q, k, v, do, pos, np_pos, lse2, delta)


# matmuls per tile relative to the forward's 2 (qk, pv): dq 3 (qk, dp, dq), dk/dv 4 (qk, dv, dp, dk); the 'tiles'
# backward's dk/dv kernel does the dk/dv matmuls (and writes dS), its dq kernel one matmul (dS . K)
PASS_FLOPS = {"fwd": 1.0, "dq": 1.5, "dkv": 2.0, "dkv_tiles": 2.0, "dq_tiles": 0.5}


def _tiles_pass(prob: AttentionPassProblem, phase: str, blocks: AttentionBlocks, scale, reps, calls):
    """Seconds of the 'tiles' backward's dk/dv kernel (writing dS) or of its dq kernel (reading it) alone."""
    np_rg = blocks_lib.ranges(prob.np_pos, prob.np_pos, None, None, None, blocks.dkv_q, blocks.dkv_k,
                              per_kv_block=True, static=True, as_numpy=True)
    kv_rg, n_tiles, _ = attn_kern.ds_tile_plan(prob.q.shape, prob.k.shape, prob.q.dtype, blocks, np_rg, True)
    pos = prob.pos
    dkv = jax.jit(lambda q, k, v, do, lse2, delta, rg: attn_kern.backward_dkv_tiles(
        q, k, v, do, lse2, delta, pos, pos, None, None, None, rg, scale=scale, blocks=blocks, n_tiles=n_tiles))
    dkv_args = (prob.q, prob.k, prob.v, prob.do, prob.lse2, prob.delta, kv_rg)
    if phase == "dkv_tiles":
        return time_call(dkv, *dkv_args, reps=reps, calls=calls)
    ds = dkv(*dkv_args)[2]
    q_rg = blocks_lib.ranges(prob.np_pos, prob.np_pos, None, None, None, blocks.dkv_q, blocks.dkv_k,
                             per_kv_block=False, static=True)
    dq = jax.jit(lambda ds, k, q_rg, kv_rg: attn_kern.backward_dq_tiles(
        ds, k, q_rg, kv_rg, scale=scale, blocks=blocks, q_shape=prob.q.shape, q_dtype=prob.q.dtype))
    return time_call(dq, ds, prob.k, q_rg, kv_rg, reps=reps, calls=calls)


def time_attention_pass(prob: AttentionPassProblem, phase: str, blocks: AttentionBlocks, *, reps=5,
                        calls=3) -> float:
    """Seconds per call of one attention kernel ('fwd', 'dq', 'dkv', 'dkv_tiles' or 'dq_tiles') alone."""
    scale = prob.q.shape[-1] ** -0.5
    if phase in ("dkv_tiles", "dq_tiles"):
        return _tiles_pass(prob, phase, blocks, scale, reps, calls)
    bq, bk = getattr(blocks, f"{phase}_q"), getattr(blocks, f"{phase}_k")
    rg = blocks_lib.ranges(prob.np_pos, prob.np_pos, None, None, None, bq, bk, per_kv_block=phase == "dkv",
                           static=True)
    pos = prob.pos
    if phase == "fwd":
        fn = jax.jit(lambda q, k, v, rg: attn_kern.forward(q, k, v, pos, pos, None, None, None, rg, scale=scale,
                                                           blocks=blocks))
        args = (prob.q, prob.k, prob.v, rg)
    else:
        kern_fn = {"dq": attn_kern.backward_dq, "dkv": attn_kern.backward_dkv}[phase]
        fn = jax.jit(lambda q, k, v, do, lse2, delta, rg: kern_fn(
            q, k, v, do, lse2, delta, pos, pos, None, None, None, rg, scale=scale, blocks=blocks))
        args = (prob.q, prob.k, prob.v, prob.do, prob.lse2, prob.delta, rg)
    return time_call(fn, *args, reps=reps, calls=calls)


def sweep_attention_blocks(B, T, H, KV, d, fwd_cfgs, dq_cfgs, dkv_cfgs, base: AttentionBlocks):
    """Times each attention kernel alone under each tile config; returns the timings and the fastest blocks."""
    prob = attention_pass_problem(B, T, H, KV, d, base)
    results = {"fwd": [], "dq": [], "dkv": []}
    best = {}
    for phase, cfgs in (("fwd", fwd_cfgs), ("dq", dq_cfgs), ("dkv", dkv_cfgs)):
        timings = {}
        for cfg in cfgs:
            try:
                t = time_attention_pass(prob, phase, dataclasses.replace(base, **cfg), reps=7, calls=5)
            except Exception as e:
                results[phase].append(dict(cfg, error=f"{type(e).__name__}: {str(e)[:160]}"))
                continue
            timings[tuple(sorted(cfg.items()))] = t
            results[phase].append(dict(cfg, ms=t * 1e3, tflops=prob.flops_fwd * PASS_FLOPS[phase] / t / 1e12))
            print(f"  sweep {phase:3s} {cfg}: {t * 1e3:.3f} ms", flush=True)
        if timings:
            best.update(dict(min(timings, key=timings.get)))
    return results, dataclasses.replace(base, **best)


def device_summary() -> dict:
    dev = jax.devices()[0]
    return dict(device_kind=dev.device_kind, platform=jax.default_backend(), vendor=platform.vendor(),
                jax_version=jax.__version__, core_count=getattr(dev, "core_count", None))


__all__ = ["PASS_FLOPS", "attempt", "AttentionBlocks", "AttentionPassProblem", "NormLaunch", "attention_flops",
           "attention_pass_problem", "bench_attention", "bench_norms", "norm_problem", "time_attention_pass",
           "time_merge_fwd_bwd", "time_norm_pass",
           "bench_qk_norm_rope", "copy_ceiling_tbps", "device_summary", "gemm_ceiling_tflops",
           "sweep_attention_blocks", "sweep_norm_launch", "time_call"]
