"""Inference on one GPU, ours against Hugging Face's ZayaForCausalLM (PyTorch, bf16, its cache; also with its
model body under torch.compile) on the same random-initialised weights: lm-eval-style scoring throughput, greedy
decode tokens/s and time to first token at several batch sizes, peak memory, the decode bandwidth roofline (bytes
read per decode step against the measured copy bandwidth) and greedy token equality.

python -m benchmarks.bench_inference [--preset bench|zaya1_8b|tiny] [--out FILE.json] [--hf-python PYTHON]
                                     [--time-budget S] [--hf-reserve S] [--model-dir DIR] [--quick]
                                     [--kernels auto|xla]

--kernels picks our implementations (zaya_jax/inference/kernels.py): auto (default) the platform's fast kernels
(Pallas on GPU, per program: scoring, prefill, decode), xla the ModelConfig defaults (XLA attention,
lax.ragged_dot experts). The choice and the resulting per-program overrides are recorded (kernels, ours.info).

Two child processes run one after the other, each with the GPU to itself (the first has exited, and its memory is
freed, before the second starts; the HF half records the free GPU memory it finds):
  1. JAX (this file, --phase jax): initialises the model on the device (one jitted init, bf16 parameters, large
     normal draws made in row blocks), writes the prompts and scoring tokens, starts compiling every measured
     program in threads, exports the weights as a HF directory (bf16 safetensors, one layer at a time through the
     host), then, once the compiles are done, measures with the same in-memory weights: copy bandwidth, scoring,
     decode at batch 1 and 64, then 8. Compile times are reported apart from the timings (medians of 3).
  2. HF (benchmarks/bench_inference_hf.py): loads the directory in bf16 onto the GPU, measures eager scoring and
     decode at batch 1 and 64, then batch 8, then the torch.compile variants.
Each child runs named phases (benchmarks/inference_phases.py): a failing phase is recorded and the next one runs;
phases are skipped when the time budget is near; the JAX child is stopped at its share of the budget (all but
--hf-reserve seconds, unless it ends earlier) and the HF child at the budget's end. The driver re-writes --out
whenever a child's results change, so a run stopped from outside still leaves its partial results (on SIGTERM
it also ends the running child and writes a last time). The JSON: summary (ours / HF eager / HF compiled per
measurement), ratios, greedy_equality (per decode batch, ours against HF on the same prompts), scoring_agreement
(summed log-probabilities of the same tokens), then each half's raw results with a status per phase under
ours.phases and hf.phases (ok, error with the message, skipped, unfinished).

Testing the robustness on the CPU: --preset tiny --quick --hf-python .venv-ref/bin/python, with
ZAYA_BENCH_FAIL=phase,... (those phases raise) or ZAYA_BENCH_HANG=phase (it hangs until the deadline).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from inference_phases import Phases, decode_rate, timed, write_json  # noqa: E402  (as the HF half does)


def spec_for(args, model_dir, work):
    quick = args.quick
    return dict(model_dir=model_dir, work=work, dtype="bfloat16", repeats=3, compile=not quick, kernels=args.kernels,
                scoring=[[2, 64]] if quick else [[32, 1024], [8, 4096]],
                decode_batches=[1, 2] if quick else [1, 64, 8],  # batch 8 runs last on each side
                prompt=16 if quick else 512, new_tokens=8 if quick else 256, continuation=32 if not quick else 8,
                # seconds a phase needs left to start (a child is stopped at its deadline anyway)
                min_left=dict(scoring=0 if quick else 20, decode=0 if quick else 30, compiled=0 if quick else 60),
                decode_cap_s=30 if quick else 90,  # repeats of one generate measurement stop after this long
                compile_threads=2 if quick else 4,  # programs compiled at once while the weights are written
                init_chunk_elements=1 << (10 if quick else 24))  # (quick: small, to exercise the chunked init)


# ---------------------------------------------------------------------------------------------------- JAX half

def init_model(preset_name: str, chunk_elements: int = 1 << 24):
    """The model with bf16 parameters, created by one jitted init on the default device (no host copy). Normal
    draws larger than chunk_elements are made a block of leading-axis rows at a time (lax.map), so no random-bits
    temporary of a whole 5.4B-element expert stack exists even if XLA does not fuse the generator."""
    import contextlib
    import math

    import jax
    import jax._src.random as jax_random
    from flax import nnx

    from zaya_jax.config import preset
    from zaya_jax.model import ZayaForCausalLM
    cfg = preset(preset_name, dtype="bfloat16", param_dtype="bfloat16")
    original = jax_random.normal

    def normal(key, shape=(), dtype=None, *args, **kwargs):
        shape = tuple(shape)
        if (len(shape) < 2 or math.prod(shape) <= chunk_elements or args
                or any(v is not None for v in kwargs.values())):
            return original(key, shape, dtype, *args, **kwargs)
        rows = max(1, chunk_elements // math.prod(shape[1:]))
        return jax.lax.map(lambda k: original(k, shape[1:], dtype), jax.random.split(key, shape[0]),
                           batch_size=min(rows, shape[0]))

    @contextlib.contextmanager
    def chunked_normal():
        jax_random.normal = normal  # nnx/jax initializers call jax._src.random.normal by attribute
        try:
            yield
        finally:
            jax_random.normal = original

    graphdef, _ = nnx.split(nnx.eval_shape(lambda: ZayaForCausalLM(cfg, rngs=nnx.Rngs(0))))
    with chunked_normal():
        state = jax.jit(lambda: nnx.split(ZayaForCausalLM(cfg, rngs=nnx.Rngs(0)))[1])()
    return nnx.merge(graphdef, state)


def prompts_file(spec, batch):
    return os.path.join(spec["work"], f"prompt_b{batch}.npy")


def scoring_file(spec, batch, length):
    return os.path.join(spec["work"], f"scoring_{batch}x{length}.npy")


def tokens_file(spec, side, batch):
    return os.path.join(spec["work"], f"tokens_{side}_b{batch}.npy")


def start_compiles(spec, scorers, decoder, phases: Phases):
    """Compiles every program the JAX phases run, in threads, while the main thread writes the weights: scoring
    ahead of time (lower().compile() fills the cache jit calls use), decode by one prefill and one generation on
    dummy prompts of the measured shapes. Returns {phase: Future of compile seconds}; a failed one is only
    recorded (the phase then compiles on its first call)."""
    import concurrent.futures

    import numpy as np

    from zaya_jax.inference.generate import generate_padded
    from zaya_jax.inference.scoring import window_length
    record = phases.compile_record  # filled by the threads, copied into the results by the main thread
    if os.environ.get("ZAYA_BENCH_NO_PRECOMPILE"):
        return {}

    def job(name, fn):
        def run():
            start = time.perf_counter()
            try:
                if name in phases.failing:
                    raise RuntimeError(f"compile {name} failed on purpose")
                memory = fn()
            except Exception as e:
                record[name] = dict(status="error", error=f"{type(e).__name__}: {str(e)[:1000]}",
                                    seconds=round(time.perf_counter() - start, 2))
                raise
            record[name] = dict(status="ok", seconds=round(time.perf_counter() - start, 2), xla_memory_gib=memory)
            print(f"[jax] compiled {name} in {record[name]['seconds']} s", flush=True)
            return record[name]["seconds"]
        return name, run

    def memory_gib(compiled):
        """What XLA plans for one call: arguments (the weights included), outputs and temporaries, in GiB."""
        try:
            m = compiled.memory_analysis()
            return dict(arguments=m.argument_size_in_bytes / 2**30, outputs=m.output_size_in_bytes / 2**30,
                        temporaries=m.temp_size_in_bytes / 2**30,
                        total=(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                               - m.alias_size_in_bytes) / 2**30)
        except Exception as e:
            return {"error": f"{type(e).__name__}: {str(e)[:200]}"}

    def scoring(scorer, length):
        return memory_gib(scorer.program(length, window_length(length, spec["continuation"])))

    def decode(batch):
        ids = np.zeros((batch, spec["prompt"]), np.int32)
        max_length = spec["prompt"] + spec["new_tokens"]
        jax_sync(decoder.prefill(decoder.init_cache(batch, max_length), ids))
        generate_padded(decoder, ids, max_new_tokens=spec["new_tokens"])
        try:  # the compiled programs' memory plans (compiled already: a cache hit)
            import jax
            import jax.numpy as jnp

            from zaya_jax.inference.generate import decode_loop, length_bucket
            from zaya_jax.inference.sampling import GREEDY
            steps = length_bucket(spec["new_tokens"])  # the shapes generate_padded compiles for
            cache = decoder.init_cache(batch, length_bucket(spec["prompt"] + steps))
            prefill = decoder._prefill.lower(decoder.state, cache, jnp.asarray(ids), None, all_logits=False).compile()
            loop = decode_loop(decoder).lower(
                decoder.state, cache, jax.ShapeDtypeStruct((batch, decoder.cfg.vocab_size), jnp.float32),
                jax.random.key(0), jnp.asarray([-1], jnp.int32), jnp.int32(0), jnp.int32(spec["new_tokens"]),
                sampling=GREEDY, steps=steps).compile()
            return dict(prefill=memory_gib(prefill), decode_loop=memory_gib(loop))
        except Exception as e:
            return {"error": f"{type(e).__name__}: {str(e)[:200]}"}

    jobs = [job(f"scoring_{b}x{n}", lambda b=b, n=n: scoring(scorers[f"{b}x{n}"], n)) for b, n in spec["scoring"]]
    jobs += [job(f"decode_{b}", lambda b=b: decode(b)) for b in spec["decode_batches"]]
    # only the selected phases' programs: a decode warm-up runs on the device, beside the export's transfers
    jobs = [(name, run) for name, run in jobs if phases.selected(name)]
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=spec["compile_threads"])
    futures = {name: pool.submit(run) for name, run in jobs}
    pool.shutdown(wait=False)
    return futures


def jax_sync(x):
    import jax
    jax.block_until_ready(x)


def wait_for(warm, name, phases: Phases):
    """Waits for the warm-up compile of this phase, then for all the others (they run programs and autotune on the
    GPU, which would disturb the timings), the latter at most until a minute before the deadline. Returns (seconds
    the phase's compile took or None when it failed or did not run, warm-ups still running)."""
    import concurrent.futures
    try:
        compile_s = warm[name].result() if name in warm else None
    except Exception:
        compile_s = None
    if warm:
        concurrent.futures.wait(list(warm.values()), timeout=max(0.0, phases.left() - 60))
    phases.data["compile"] = phases.compile_record.copy()  # atomic under the GIL
    return compile_s, sorted(n for n, f in warm.items() if not f.done())


def run_jax(spec, preset_name, phases: Phases):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from zaya_jax.checkpoint.hf import to_hf
    from zaya_jax.inference.decoder import Decoder, inference_state
    from zaya_jax.inference.generate import decode_loop, generate_padded
    from zaya_jax.inference.kernels import PROGRAMS, kernel_overrides
    from zaya_jax.inference.scoring import Scorer
    from zaya_jax.param_count import abstract_param_counts

    device = jax.devices()[0]
    kernels = spec.get("kernels", "auto")
    phases.data["info"] = {"jax": jax.__version__, "device": device.device_kind, "platform": device.platform,
                           "kernels": kernels, "impls": {p: kernel_overrides(kernels, p) for p in PROGRAMS}}
    print(f"[jax] jax {jax.__version__} on {device.platform}: {device.device_kind}", flush=True)
    state = {}

    def peak_gib():
        stats = device.memory_stats() or {}
        return round(stats["peak_bytes_in_use"] / 2**30, 3) if "peak_bytes_in_use" in stats else None

    def sync(x):
        jax.block_until_ready(x)

    def init():
        start = time.perf_counter()
        model = init_model(preset_name, spec["init_chunk_elements"])
        jax.block_until_ready(jax.tree.leaves(model))
        leaves = jax.tree.leaves(model)
        rng = np.random.default_rng(0)
        for batch in spec["decode_batches"]:
            ids = rng.integers(3, model.cfg.vocab_size, (batch, spec["prompt"])).astype(np.int32)
            np.save(prompts_file(spec, batch), ids)
        for batch, length in spec["scoring"]:  # the HF half scores the same tokens
            tokens = rng.integers(3, model.cfg.vocab_size, (batch, length + 1)).astype(np.int32)
            np.save(scoring_file(spec, batch, length), tokens)
        state["model"] = model
        return dict(init_s=round(time.perf_counter() - start, 2), param_bytes=int(sum(a.nbytes for a in leaves)),
                    param_dtypes=sorted({str(a.dtype) for a in leaves}),
                    param_counts=abstract_param_counts(model.cfg), peak_gib=peak_gib())

    if not phases.run("init", init, min_left_s=-float("inf")):  # needed by everything else
        return
    model = state["model"]
    cfg = model.cfg
    counts = phases.data["init"]["param_counts"]
    deadline = phases.deadline
    shared = inference_state(model)  # one copy of the weights for the decoder and every scorer
    decoder = Decoder(model, kernels=kernels, state=shared)
    decode_loop(decoder)  # bound before the compile threads use it
    scorers = {f"{b}x{n}": Scorer(model, max_length=n, batch_size=b, buckets=(n,), kernels=kernels, state=shared)
               for b, n in spec["scoring"]}
    phases.compile_record = {}
    try:
        warm = start_compiles(spec, scorers, decoder, phases)  # compiles while the weights are written
    except Exception as e:  # each phase then compiles on its first call
        phases.compile_record["start"] = {"status": "error", "error": f"{type(e).__name__}: {str(e)[:500]}"}
        warm = {}

    def export():
        start = time.perf_counter()
        out = {}
        if os.path.isfile(os.path.join(spec["model_dir"], "config.json")):
            out["export"] = "reused the existing directory (the same seed and preset are assumed)"
        else:
            to_hf(model, spec["model_dir"], dtype=jnp.bfloat16)
        out["export_s"] = round(time.perf_counter() - start, 2)
        files = [os.path.join(spec["model_dir"], f) for f in os.listdir(spec["model_dir"])]
        out["export_bytes"] = int(sum(os.path.getsize(f) for f in files))
        out["export_gb_per_s"] = round(out["export_bytes"] / max(out["export_s"], 1e-9) / 1e9, 2)
        return out

    if not phases.run("export", export, min_left_s=-float("inf")):
        return

    def copy_bandwidth():
        busy = wait_for(warm, "", phases)[1]
        x = jnp.ones((64, 1024, 1024) if spec["quick"] else (1024, 1024, 1024), jnp.float32)  # read + written
        t = timed(lambda: x + 1, sync, repeats=5, deadline=deadline)
        t.pop("value")
        return dict(gb_per_s=2 * x.nbytes / t["median_s"] / 1e9, bytes=2 * x.nbytes, **t,
                    warmups_running_meanwhile=busy)

    phases.run("copy_bandwidth", copy_bandwidth)

    for batch, length in spec["scoring"]:
        def score(batch=batch, length=length):
            compile_s, busy = wait_for(warm, f"scoring_{batch}x{length}", phases)
            scorer = scorers[f"{batch}x{length}"]
            tokens = np.load(scoring_file(spec, batch, length)).tolist()
            c = spec["continuation"]
            requests = [(t[:-c], t[-c:]) for t in tokens]  # the loss over each row's last c tokens
            t = timed(lambda: scorer.loglikelihood(requests), sync, repeats=spec["repeats"], deadline=deadline)
            logp = [float(x[0]) for x in t.pop("value")]
            return dict(tokens_per_s=batch * length / t["median_s"], compile_s=compile_s, peak_gib=peak_gib(), **t,
                        logp=logp, warmups_running_meanwhile=busy)
        phases.run(f"scoring_{batch}x{length}", score, min_left_s=spec["min_left"]["scoring"])

    for batch in spec["decode_batches"]:
        def decode(batch=batch):
            compile_s, busy = wait_for(warm, f"decode_{batch}", phases)
            ids = np.load(prompts_file(spec, batch))
            new = spec["new_tokens"]
            max_length = spec["prompt"] + new

            def prefill():
                return decoder.prefill(decoder.init_cache(batch, max_length), ids)

            ttft = timed(prefill, sync, repeats=spec["repeats"], deadline=deadline)
            ttft.pop("value")
            gen = timed(lambda: generate_padded(decoder, ids, max_new_tokens=new).tokens, lambda v: None,
                        repeats=spec["repeats"], deadline=deadline, cap_s=spec["decode_cap_s"])
            tokens = gen.pop("value")
            np.save(tokens_file(spec, "ours", batch), tokens)
            cache = jax.eval_shape(lambda: decoder.init_cache(batch, max_length))
            cache_bytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(cache))
            cache_bytes *= (spec["prompt"] + new / 2) / max_length  # the mean slots attended (sliding: fewer)
            experts_read = cfg.num_experts * (1 - (1 - 1 / cfg.num_experts) ** batch)  # distinct experts per layer
            expert_params = (counts["non_embedding"] - counts["active_non_embedding"]) / (cfg.num_experts - 1)
            weight_bytes = 2 * (counts["active_non_embedding"] + (experts_read - 1) * expert_params
                                + cfg.vocab_size * cfg.hidden_size)  # bf16; the head reads the whole vocabulary
            step_bytes = weight_bytes + cache_bytes
            bw = phases.data.get("copy_bandwidth", {}).get("gb_per_s")
            out = dict(compile_s=compile_s, ttft_s=ttft["median_s"],
                       decode_tokens_per_s=decode_rate(batch * new, gen["median_s"], ttft["median_s"]),
                       tokens_per_s_with_prefill=batch * new / gen["median_s"], generate_s=gen["median_s"],
                       step_bytes=step_bytes, weight_bytes=weight_bytes, cache_bytes=cache_bytes,
                       roofline_tokens_per_s=batch * bw * 1e9 / step_bytes if bw else None,
                       peak_gib=peak_gib(), ttft_timing=ttft, generate_timing=gen, warmups_running_meanwhile=busy)
            if batch == 1:
                out["tokens"] = tokens[0].tolist()
            return out
        phases.run(f"decode_{batch}", decode, min_left_s=spec["min_left"]["decode"])
    phases.data["peak_gib"] = peak_gib()
    phases.save()


# -------------------------------------------------------------------------------------------------------- driver

def greedy_equality(spec):
    """Ours against HF eager (else compiled) greedy tokens on the same prompts, per decode batch size."""
    import numpy as np
    out = {}
    for batch in spec["decode_batches"]:
        ours = tokens_file(spec, "ours", batch)
        hf = next((f for f in (tokens_file(spec, v, batch) for v in ("hf_eager", "hf_compiled")) if os.path.isfile(f)),
                  None)
        if not (os.path.isfile(ours) and hf):
            continue
        a, b = np.load(ours), np.load(hf)
        n = min(a.shape[1], b.shape[1])
        a, b = a[:, :n], b[:, :n]
        differ = a != b
        prefix = np.where(differ.any(axis=1), differ.argmax(axis=1), n)  # equal leading tokens per row
        out[str(batch)] = dict(against=os.path.basename(hf), rows=int(a.shape[0]), tokens_per_row=n,
                               rows_all_equal=int((prefix == n).sum()), mean_equal_prefix=float(prefix.mean()),
                               min_equal_prefix=int(prefix.min()), tokens_equal_fraction=float((~differ).mean()))
    return out


def scoring_agreement(ours, hf):
    """Per scoring shape: the largest difference between our and HF's summed continuation log-probabilities."""
    out = {}
    for name, row in ours.items():
        if name.startswith("scoring_") and isinstance(row, dict) and row.get("logp"):
            shape = name[len("scoring_"):]
            for v in ("eager", "compiled"):
                theirs = hf.get(f"scoring_{v}_{shape}", {}).get("logp")
                if theirs and len(theirs) == len(row["logp"]):
                    diff = [abs(a - b) for a, b in zip(row["logp"], theirs)]
                    out[f"{shape}_vs_hf_{v}"] = dict(max_abs_diff=max(diff), mean_abs_logp=sum(
                        abs(a) for a in theirs) / len(theirs))
    return out


def summary(ours, hf):
    """The headline numbers side by side: {measurement: {ours, hf_eager, hf_compiled}} (None where missing)."""
    def get(d, name, key):
        row = d.get(name)
        return row.get(key) if isinstance(row, dict) else None

    out = {}
    for name in ours:
        for kind, keys in (("scoring", ("tokens_per_s", "peak_gib")),
                           ("decode", ("decode_tokens_per_s", "ttft_s", "peak_gib"))):
            if name.startswith(kind + "_"):
                shape = name[len(kind) + 1:]
                for key in keys:
                    out[f"{name}_{key}"] = dict(ours=get(ours, name, key),
                                                hf_eager=get(hf, f"{kind}_eager_{shape}", key),
                                                hf_compiled=get(hf, f"{kind}_compiled_{shape}", key))
                if kind == "decode":
                    out[f"{name}_roofline_tokens_per_s"] = get(ours, name, "roofline_tokens_per_s")
                # ours peak_gib is the process's peak so far (the init's temporaries included); XLA's plan for
                # the phase's programs (weights + cache + temporaries) is the comparable figure
                plan = (ours.get("compile") or {}).get(name, {}).get("xla_memory_gib") or {}
                totals = [p.get("total") for p in ([plan] if "total" in plan else plan.values())
                          if isinstance(p, dict) and p.get("total")]
                out[f"{name}_ours_xla_plan_gib"] = max(totals, default=None)
    return out


def ratios(ours, hf):
    """ours / HF's best variant, per measurement; missing measurements are left out."""
    out = {}
    for kind, key in (("scoring", "tokens_per_s"), ("decode", "decode_tokens_per_s")):
        for name, row in ours.items():
            if not (name.startswith(kind + "_") and isinstance(row, dict) and row.get(key)):
                continue
            shape = name[len(kind) + 1:]
            theirs = {v: hf.get(f"{kind}_{v}_{shape}", {}).get(key) for v in ("eager", "compiled")}
            theirs = {v: x for v, x in theirs.items() if x}
            for v, x in theirs.items():
                out[f"{name}_vs_hf_{v}"] = row[key] / x
            if theirs:
                out[f"{name}_vs_hf_best"] = row[key] / max(theirs.values())
            if kind == "decode":
                if row.get("roofline_tokens_per_s"):
                    out[f"{name}_of_roofline"] = row[key] / row["roofline_tokens_per_s"]
                if hf.get(f"decode_eager_{shape}", {}).get("ttft_s"):
                    out[f"ttft_{shape}_hf_eager_over_ours"] = hf[f"decode_eager_{shape}"]["ttft_s"] / row["ttft_s"]
    return out


def mark_unfinished(path, ended):
    """A phase a child was in when it ended is marked so (stopped at the deadline, or the process died)."""
    try:
        data = json.load(open(path))
    except (OSError, ValueError):
        return
    changed = False
    for record in data.get("phases", {}).values():
        if record.get("status") == "running":
            record["status"] = "unfinished"
            record["reason"] = f"the process {ended} during this phase"
            changed = True
    if changed:
        write_json(path, data)


def child_env():
    return {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}


RUNNING: list = []  # the child process now running, for the driver's SIGTERM handler


def stop_running_child(signum, frame):
    """The driver was told to stop: end the child's process group (it runs in its own session), then unwind so the
    results file is written a last time."""
    for proc in RUNNING:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    raise SystemExit(f"stopped by signal {signum}")


def run_child(cmd, deadline, on_poll, env=None):
    """Runs cmd in its own process group until it exits or the deadline (then SIGTERM, SIGKILL to the group);
    on_poll() every 2 s. Returns (exit code or None, how it ended)."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True)
    RUNNING[:] = [proc]
    ended = "exited"
    while proc.poll() is None:
        if time.time() > deadline:
            ended = "stopped at its deadline"
            for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 20)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
            break
        time.sleep(2)
        on_poll()
    try:  # reap; the group's other processes (compile workers) are ended with it
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    on_poll()
    return proc.returncode, ended


def work_parent(args):
    """Where the work directory (with the exported weights, unless --model-dir) goes: $BENCH_TMP, else the first
    of the temporary directory, the repository and /dev/shm with room for the bf16 weights and 2 GB more."""
    if os.environ.get("BENCH_TMP"):
        return os.environ["BENCH_TMP"]
    try:
        from zaya_jax.config import preset  # no JAX import
        need = 2 * preset(args.preset).param_counts()["total"] + 2e9
    except Exception:
        return None
    if args.model_dir:
        need = 1e9
    for d in (tempfile.gettempdir(), ROOT, "/dev/shm"):
        try:
            if shutil.disk_usage(d).free > need and os.access(d, os.W_OK):
                return d
        except OSError:
            continue
    print(f"[driver] no directory with {need / 1e9:.0f} GB free found; trying the default", flush=True)
    return None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="bench", help="model preset (bench, zaya1_8b, tiny)")
    ap.add_argument("--out", default=None, help="results JSON, re-written as phases finish "
                                                "(default bench_inference_<preset>.json)")
    ap.add_argument("--hf-python", default=sys.executable, help="python with torch and transformers >= 5.23")
    ap.add_argument("--time-budget", type=float, default=540, help="seconds for the whole run (default 540)")
    ap.add_argument("--hf-reserve", type=float, default=None,
                    help="seconds of the budget kept for the HF half (default 40%% of the budget)")
    ap.add_argument("--model-dir", default=None, help="where the HF weights go (default a temporary directory, "
                                                      "removed at the end); an existing one is reused")
    ap.add_argument("--quick", action="store_true", help="tiny shapes (a CPU check of the script)")
    ap.add_argument("--kernels", choices=["auto", "xla"], default="auto",
                    help="our implementations: auto = the platform's fast kernels (Pallas on GPU), xla = XLA's")
    ap.add_argument("--phases", default=None, help="comma-separated fnmatch patterns of the measurements to run on "
                    "both sides (e.g. 'compile,decode_compiled_*'; default all); loading and export always run")
    ap.add_argument("--phase", choices=["jax"], help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if not (shutil.which(args.hf_python) or os.access(args.hf_python, os.X_OK)):
        ap.error(f"--hf-python {args.hf_python}: no such executable")
    if args.phase:  # the JAX child
        spec = json.load(open(args.spec))
        phases = Phases(spec["jax_out"], spec["jax_deadline"], "jax", spec.get("phases"))
        run_jax(spec, args.preset, phases)
        phases.save()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # without waiting for a warm-up compile still running (its phase was skipped)

    t0 = time.time()
    out_path = os.path.abspath(args.out or f"bench_inference_{args.preset}.json")
    hf_reserve = 0.4 * args.time_budget if args.hf_reserve is None else args.hf_reserve
    work = tempfile.mkdtemp(prefix="bench_inference_", dir=work_parent(args))
    model_dir = os.path.abspath(args.model_dir) if args.model_dir else os.path.join(work, "model")
    spec = spec_for(args, model_dir, work)
    spec["phases"] = args.phases.split(",") if args.phases else None
    spec.update(quick=args.quick, jax_out=os.path.join(work, "jax.json"), hf_out=os.path.join(work, "hf.json"),
                jax_deadline=t0 + args.time_budget - hf_reserve - 15, hf_deadline=t0 + args.time_budget - 10)
    spec_path = os.path.join(work, "spec.json")
    write_json(spec_path, spec)
    result = dict(preset=args.preset, kernels=args.kernels, status="running",
                  started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)), time_budget_s=args.time_budget,
                  hf_reserve_s=hf_reserve, work_dir=work,
                  work_free_gb=round(shutil.disk_usage(work).free / 1e9, 1),
                  spec={k: v for k, v in spec.items() if k not in ("jax_out", "hf_out", "work")},
                  children={}, summary={}, ratios={}, greedy_equality={}, scoring_agreement={}, ours={}, hf={})

    def refresh():
        for side, path in (("ours", spec["jax_out"]), ("hf", spec["hf_out"])):
            try:
                result[side] = json.load(open(path))
            except (OSError, ValueError):
                pass
        derived = dict(greedy_equality=lambda: greedy_equality(spec),
                       summary=lambda: summary(result["ours"], result["hf"]),
                       scoring_agreement=lambda: scoring_agreement(result["ours"], result["hf"]),
                       ratios=lambda: ratios(result["ours"], result["hf"]))
        for key, derive in derived.items():  # partial results: whatever cannot be derived yet says why
            try:
                result[key] = derive()
            except Exception as e:
                result[key] = {"error": f"{type(e).__name__}: {e}"}
        result["elapsed_s"] = round(time.time() - t0, 1)
        write_json(out_path, result)

    signal.signal(signal.SIGTERM, stop_running_child)
    signal.signal(signal.SIGHUP, stop_running_child)
    signal.signal(signal.SIGINT, stop_running_child)
    print(f"[driver] writing {out_path}; work directory {work}", flush=True)
    refresh()
    try:
        me = [sys.executable, "-m", "benchmarks.bench_inference", "--preset", args.preset, "--spec", spec_path,
              "--phase", "jax"]
        rc, ended = run_child(me, spec["jax_deadline"] + 10, refresh, env=child_env())
        result["children"]["jax"] = dict(returncode=rc, ended=ended, at_s=round(time.time() - t0, 1))
        mark_unfinished(spec["jax_out"], ended)
        print(f"[driver] jax child: {ended}, exit {rc}, {time.time() - t0:.0f} s", flush=True)
        if os.path.isfile(os.path.join(model_dir, "config.json")):
            hf_cmd = [args.hf_python, os.path.join(HERE, "bench_inference_hf.py"), spec_path]
            rc, ended = run_child(hf_cmd, spec["hf_deadline"] + 5, refresh)
            result["children"]["hf"] = dict(returncode=rc, ended=ended, at_s=round(time.time() - t0, 1))
            mark_unfinished(spec["hf_out"], ended)
            print(f"[driver] hf child: {ended}, exit {rc}, {time.time() - t0:.0f} s", flush=True)
        else:
            result["children"]["hf"] = dict(ended="not run: no exported weights")
        result["status"] = "done"
    except BaseException as e:
        result["status"] = f"driver interrupted: {type(e).__name__}: {e}"
        raise
    finally:
        refresh()
        shutil.rmtree(work, ignore_errors=True)  # with the weights, unless --model-dir put them elsewhere
    print(json.dumps({k: result[k] for k in ("ratios", "greedy_equality", "scoring_agreement")}, indent=1))
    print(f"[driver] wrote {out_path} in {time.time() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
