"""Runs the HF PyTorch reference (benchmarks/training/bench_hf.py) as a separate process next to the JAX benchmark: it
warms up / torch.compiles while JAX compiles, times after JAX has finished compiling, and exits before any JAX
timing (so neither side's timings share the GPU and the JAX side then has the memory to itself)."""

from __future__ import annotations

import json
import os
import subprocess


class HFProcess:
    def __init__(self, workdir: str, log):
        self.workdir, self.log = workdir, log
        self.proc: subprocess.Popen | None = None
        self.out = os.path.join(workdir, "hf.json")
        self.log_path = os.path.join(workdir, "hf.log")

    def command(self, python: str, *, experts: str, batch: int, seq: int, steps: int, warmup: int,
                ceiling_size: int, wait_deadline: float, timing_deadline: float, compile_model: bool = True,
                accum: tuple[int, ...] = ()):
        """The HF process's command line (bench_hf.parse_args reads everything after the script)."""
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_hf.py")
        cmd = [python, script, "--config", os.path.join(self.workdir, "hf_config.json"), "--batch", str(batch),
               "--seq", str(seq), "--steps", str(steps), "--warmup", str(warmup), "--workdir", self.workdir,
               "--experts", experts, "--ceiling-size", str(ceiling_size), "--wait-deadline", str(wait_deadline),
               "--timing-deadline", str(timing_deadline), "--accum", ",".join(map(str, accum)), "--out", self.out]
        return cmd + ([] if compile_model else ["--no-compile"])

    def start(self, python: str, hf_config: dict, **kw):
        """Write our config.json dict for the HF side and start it (keywords: see command)."""
        with open(os.path.join(self.workdir, "hf_config.json"), "w") as f:
            json.dump(hf_config, f)
        cmd = self.command(python, **kw)
        self.log("HF: " + " ".join(cmd))
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)

    def jax_compiled(self):
        """Tell the HF process it may time now."""
        open(os.path.join(self.workdir, "jax_compiled"), "w").close()

    def wait_exit(self, timeout_s: float) -> str:
        """Wait for the HF process to finish; stop it past the timeout. Returns how it ended."""
        if self.proc is None:
            return "not started"
        try:
            rc = self.proc.wait(timeout=max(1.0, timeout_s))
            return f"exited {rc}"
        except subprocess.TimeoutExpired:
            self.log("HF still running at its deadline: stopping it")
            self.proc.kill()
            self.proc.wait()
            return "killed at the deadline"

    def results(self) -> dict:
        """hf.json (whatever it got to) and the tail of its log."""
        out = {}
        if os.path.exists(self.out):
            with open(self.out) as f:
                out = json.load(f)
        try:
            with open(self.log_path) as f:
                out["log_tail"] = f.read()[-4000:]
        except OSError:
            pass
        return out
