"""Compiles and times the training benchmark's variants on one device: train states shared by variants with the same
state key (rebuilt after a failure, since a failed call may have consumed its donated state), lowering on the
calling thread and compiling on a pool, the memory searches, and the memory checks before every timed run."""

from __future__ import annotations

import concurrent.futures as cf
import math
import threading
import time
import traceback

import jax

from benchmarks.training import bench_memory as mem
from benchmarks.training.bench_programs import lower, make_state_creator, variant_batch
from benchmarks.training.bench_timing import Clock, time_calls
from benchmarks.training.bench_variants import Search, Variant
from zaya_jax.train.flops import flops_per_token

SPEC_PEAK_TFLOPS = 989.0  # H100/H200 SXM dense bf16


class Runner:
    def __init__(self, args, report: dict, clock: Clock, log):
        self.args, self.report, self.clock, self.log = args, report, clock, log
        self.errors = report.setdefault("errors", {})
        self.results = report.setdefault("variants", {})
        self.search_report = report.setdefault("searches", {})
        self.states, self.shapes, self.creators = {}, {}, {}
        self.state_lock = threading.Lock()
        self.pool = cf.ThreadPoolExecutor(max_workers=args.compile_threads)
        self.items: dict[str, dict] = {}  # variant name -> {variant, future, cfg, ...}
        self.searches: dict[str, cf.Future] = {}  # search name -> future of the chosen variant's name (or None)
        self.searches_closed: set[str] = set()  # searches taken at their deadline (their choice is final)
        self.limit_gib = mem.memory_limit_gib(args.memory_limit_gib)

    # -- train states ------------------------------------------------------------------------------------------
    def state_shapes_for(self, v: Variant, cfg, tx):
        with self.state_lock:
            if v.state_key not in self.shapes:
                self.creators[v.state_key] = make_state_creator(cfg, tx)
                self.shapes[v.state_key] = jax.eval_shape(self.creators[v.state_key])
            return self.shapes[v.state_key]

    def ensure_state(self, key: str):
        """The state of `key`, created on first use and after a failure dropped it."""
        with self.state_lock:
            if key not in self.states:
                self.states[key] = jax.jit(self.creators[key])()
                jax.block_until_ready(self.states[key])
            return self.states[key]

    def release_states(self, keep: set[str]):
        for key in [k for k in self.states if k not in keep]:
            del self.states[key]

    # -- compile -----------------------------------------------------------------------------------------------
    def _lower(self, v: Variant) -> dict | None:
        t = time.time()
        try:
            item = lower(v, self.args.preset, self.args.dtype, self.state_shapes_for)
        except Exception as e:  # noqa: BLE001 - e.g. a config override not available yet: this variant only
            self.errors[v.name] = f"lower: {e!r}"[:2000]
            self.log(f"{v.name}: lowering failed: {e!r}"[:500])
            return None
        item.update(variant=v, lower_s=time.time() - t)
        self.items[v.name] = item
        return item

    @staticmethod
    def _compile(item: dict):
        t = time.time()
        compiled = item["lowered"].compile()
        item["compile_s"] = time.time() - t
        item["memory"] = mem.memory_of(compiled)
        return compiled

    def compile_all(self, variants: list[Variant], searches: list[Search], deadline: float):
        """Lower here (tracing stays on this thread), compile on the pool: the first variant, then the searches (each
        walks its candidates one compile after another on one pool thread: the longest chains), then the rest in
        priority order."""

        def submit(v: Variant):
            if time.time() > deadline:
                self.errors[v.name] = "not lowered before the compile deadline"
                return
            item = self._lower(v)
            if item is not None:
                item["future"] = self.pool.submit(self._compile, item)

        for v in variants[:1]:
            submit(v)
        for s in searches:
            lowered = [self._lower(c) for c in s.candidates if time.time() < deadline]
            self.start_search(s, [x for x in lowered if x is not None], deadline)
        for v in variants[1:]:
            submit(v)

    def start_search(self, s: Search, items: list[dict], deadline: float):
        """Walk the lowered candidates of `s` on a pool thread (candidates starting after `deadline` are skipped)."""
        self.search_report[s.name] = {"mode": s.mode, "limit_gib": self.limit_gib, "chosen": None, "tried": []}
        self.searches[s.name] = self.pool.submit(self._search, s, items, deadline)

    def _search(self, s: Search, items: list[dict], deadline: float) -> str | None:
        """Compile candidates in order and keep, by XLA's memory analysis against the limit, the first that fits
        ('first') or the last of the upward walk ('largest'). Nothing here runs on the device. The report entry is
        kept current, so a search still walking at its deadline is taken with what it has chosen so far (and stops
        changing its choice: see search_choice)."""
        rep = self.search_report[s.name]
        tried, chosen = rep["tried"], None
        for item in items:
            v = item["variant"]
            if time.time() > deadline or s.name in self.searches_closed:
                tried.append({"variant": v.name, "skipped": "compile deadline"})
                break
            try:
                compiled = self._compile(item)
            except Exception as e:  # noqa: BLE001
                tried.append({"variant": v.name, "error": f"compile: {e!r}"[:1000]})
                if s.mode == "largest":
                    break
                continue
            fits = mem.fits_alone(item["memory"], self.limit_gib)
            tried.append({"variant": v.name, "peak_estimate_gib": item["memory"].get("peak_estimate_gib"),
                          "fits": fits, "compile_s": item["compile_s"]})
            if not fits:
                if s.mode == "largest":
                    break
                continue
            with self.state_lock:
                if s.name in self.searches_closed:  # taken at its deadline: the choice made then stands
                    tried[-1]["skipped"] = "search closed at its deadline"
                    break
                item["compiled"] = compiled
                chosen = rep["chosen"] = v.name
            if s.mode == "first":
                break
        return chosen

    def compiled(self, name: str, until: float, record_timeout: bool = True):
        """The executable of a variant (waiting for its compile until `until`), or None with the reason recorded."""
        item = self.items[name]
        if "compiled" in item:
            return item["compiled"]
        if "future" not in item:  # a search candidate that was not chosen
            self.errors[name] = "not compiled (search candidate not chosen)"
            return None
        try:
            item["compiled"] = item["future"].result(timeout=min(max(0.0, until - time.time()), 1e6))
        except cf.TimeoutError:
            if record_timeout:
                self.errors[name] = "not compiled in time"
            return None
        except Exception as e:  # noqa: BLE001
            self.errors[name] = f"compile: {e!r}"[:2000]
            self.log(f"{name}: compile failed: {e!r}"[:500])
            return None
        return item["compiled"]

    def search_choice(self, name: str, until: float) -> Variant | None:
        try:
            chosen = self.searches[name].result(timeout=min(max(0.0, until - time.time()), 1e6))
        except cf.TimeoutError:
            with self.state_lock:
                self.searches_closed.add(name)
                chosen = self.search_report[name]["chosen"]
            self.search_report[name]["closed_at_deadline"] = True
        except Exception as e:  # noqa: BLE001
            self.errors[name] = f"search: {e!r}"[:2000]
            return None
        if chosen is None:
            self.errors.setdefault(name, "no candidate fits (see searches)")
            return None
        return self.items[chosen]["variant"]

    # -- timing ------------------------------------------------------------------------------------------------
    def run_variant(self, v: Variant, until: float) -> dict | None:
        """Time one compiled variant if it fits in memory now; on failure drop its state (possibly donated)."""
        if v.name not in self.items:
            return None
        if self.clock.left() < 15:
            self.errors[v.name] = "skipped: out of time"
            return None
        c = self.compiled(v.name, until)
        if c is None:
            return None
        item = self.items[v.name]
        self.ensure_state(v.state_key)
        ok, why = mem.fits_now(item["memory"], self.args.memory_limit_gib)
        if not ok:
            self.errors[v.name] = f"skipped: {why} (memory_analysis)"
            self.log(f"{v.name}: skipped, {why}")
            return None
        try:
            res = self._time(v, item, c)
        except Exception as e:  # noqa: BLE001
            self.errors[v.name] = f"run: {e!r}"[:2000]
            self.log(f"{v.name}: failed: {e!r}"[:500])
            traceback.print_exc()
            with self.state_lock:
                self.states.pop(v.state_key, None)  # a failed call may have consumed the donated state
            return None
        self.results[v.name] = res
        tps = f" {res['tokens_per_s']:,.0f} tok/s" if res.get("tokens_per_s") else ""
        mfu = f" MFU {res['mfu'] * 100:.1f}%" if "mfu" in res else ""
        self.log(f"{v.name}: median {res['median_s'] * 1e3:.1f} ms{tps}{mfu} (peak est "
                 f"{item['memory'].get('peak_estimate_gib', 0):.1f} GiB, compile {item.get('compile_s') or 0:.0f}s)")
        return res

    def _time(self, v: Variant, item: dict, c) -> dict:
        cfg, key = item["cfg"], v.state_key
        state = self.states[key]
        if v.kind == "opt":
            grads = jax.tree.map(lambda p: (p * 1e-3).astype(p.dtype), state["params"])
            params, opt_state = state["params"], state["opt_state"]
            self.states.pop(key)  # donated by the first call; put back below

            def call():
                nonlocal params, opt_state
                params, opt_state = c(params, opt_state, grads)
                return params
        elif v.kind in ("step", "accum"):
            batch = variant_batch(cfg, v, seed=1)
            losses = []
            self.states.pop(key)

            def call():
                nonlocal state
                state, metrics = c(state, batch)
                losses.append(metrics["loss"])
                return state
        else:
            batch = variant_batch(cfg, v, seed=1)

            def call():
                return c(state, batch)

        capped = v.max_steps is not None
        timing = time_calls(call, min(self.args.steps, v.max_steps or self.args.steps),
                            1 if capped else self.args.warmup, self.clock.left(), pipelined=not capped)
        if v.kind == "opt":
            self.states[key] = {**state, "params": params, "opt_state": opt_state}
        elif v.kind in ("step", "accum"):
            self.states[key] = state
            lv = [float(x) for x in jax.device_get(losses)]
            timing.update(loss_first=lv[0], loss_last=lv[-1], loss_finite=all(math.isfinite(x) for x in lv))
        return {**self.describe(v, item), **timing, "device_memory": mem.device_memory(),
                **self.throughput(v, cfg, timing)}

    @staticmethod
    def describe(v: Variant, item: dict) -> dict:
        return {"note": v.note, "kind": v.kind, "batch": v.batch, "seq": v.seq, "accum": v.accum,
                "tokens_per_call": v.tokens,
                "attention_impl": v.attention_impl, "remat": v.remat, "moe_impl": v.moe_impl, "ce_chunk": v.ce_chunk,
                "ce_impl": v.ce_impl, "norm_impl": v.norm_impl, "conv_impl": v.conv_impl, "scan_layers": v.scan_layers,
                **({"cast_weights_once": v.cast_weights_once, "per_layer_view": v.per_layer_view,
                    "grads_per_pass": v.grads_per_pass, "defer_expert_wgrad": v.defer_expert_wgrad}
                   if v.kind == "accum" else {}),
                **({"moe_tiling": dict(v.moe_tiling)} if v.moe_tiling else {}),
                "optimizer": v.optimizer, "compile_s": item.get("compile_s"), "lower_s": item.get("lower_s"),
                "memory_analysis": item["memory"]}

    def throughput(self, v: Variant, cfg, timing: dict) -> dict:
        if v.kind == "opt":
            return {}
        fpt = flops_per_token(cfg, v.seq)
        out = {"flops_per_token": fpt, "tokens_per_s": v.tokens / timing["median_s"]}
        if "pipelined_mean_s" in timing:
            out["tokens_per_s_pipelined"] = v.tokens / timing["pipelined_mean_s"]
        if v.kind in ("step", "accum"):  # full training work: MFU
            out["achieved_tflops"] = out["tokens_per_s"] * fpt / 1e12
            out["mfu"] = out["achieved_tflops"] / SPEC_PEAK_TFLOPS
            ceiling = self.report.get("gemm_ceiling_tflops_jax")
            if ceiling:
                out["mfu_vs_gemm_ceiling"] = out["achieved_tflops"] / ceiling
        return out
