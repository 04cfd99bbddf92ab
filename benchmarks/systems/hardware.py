"""Hardware files for the sizing advisor: vendor/literature presets for MI300X and H200, or the JSON files the
characterization sweeps wrote (hbm.json, gemm.json, collectives.json) laid over a preset.

Preset sources (see ../shared/docs/perf_anchors.md for the full citations; V = read in the source, S = secondary):
  MI300X: 192 GB HBM3, bf16 1307.4 TFLOP/s dense (V); achievable GEMM 708 TFLOP/s (AMD max-achievable-FLOPS
          blog, V); HBM 4.33 TB/s measured in the ZAYA1 paper (S); GEMMs need ~200 GFLOP to saturate (ZAYA1, S);
          8-GPU RCCL all-reduce 316.8 GB/s busbw (Azure ND MI300X v5, V); one 400 Gb/s Pollara NIC per GPU (V).
  H200:   141 GB HBM3e, bf16 989 TFLOP/s (V); achievable GEMM 794.5 TFLOP/s (MAMF, V); HBM 4.15 TB/s STREAM
          triad (Azure, V); 8-GPU NCCL all-reduce 480 GB/s busbw (NVLS, V); one 400 Gb/s NIC per GPU (V).
The collective latency (alpha) used to estimate a gradient bucket without a measurement is an assumption.
"""

from __future__ import annotations

import dataclasses
import json
import os


@dataclasses.dataclass(frozen=True)
class HardwareSpec:
    name: str
    hbm_bytes: float
    peak_bf16_flops: float  # dense vendor peak (the MFU denominator)
    gemm_flops: float  # achievable bf16 GEMM ceiling
    hbm_bandwidth: float  # achievable copy bandwidth, bytes/s
    gemm_saturation_flops: float | None  # FLOPs per GEMM needed for 90% of gemm_flops
    devices_per_node: int
    intra_node_busbw: float  # all-reduce bus bandwidth with every GPU of a node
    inter_node_busbw: float  # per-GPU scale-out bandwidth (one rail)
    collective_latency_s: float = 30e-6  # alpha of the alpha-beta model (assumed unless measured)
    gradient_bucket_bytes: float | None = None  # measured bandwidth-saturation point; None: alpha-beta estimate
    reserved_fraction: float = 0.08  # HBM kept for the runtime, library workspaces and fragmentation
    sources: tuple = ()

    def bucket_bytes(self, fraction: float = 0.95) -> tuple[float, str]:
        """The gradient bucket: the measured saturation point, else the alpha-beta size where algbw reaches
        `fraction` of the link rate: S / (alpha + S / B) = fraction * B  =>  S = fraction / (1 - fraction) alpha B."""
        if self.gradient_bucket_bytes:
            return self.gradient_bucket_bytes, "measured (collectives sweep saturation point)"
        size = fraction / (1 - fraction) * self.collective_latency_s * self.inter_node_busbw
        return size, (f"estimated: alpha-beta model, alpha {self.collective_latency_s * 1e6:.0f} us (assumed), "
                      f"B {self.inter_node_busbw / 1e9:.0f} GB/s; measure with `characterize collectives`")

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


MI300X = HardwareSpec(name="MI300X", hbm_bytes=192e9, peak_bf16_flops=1307.4e12, gemm_flops=708e12,
                      hbm_bandwidth=4.33e12, gemm_saturation_flops=200e9, devices_per_node=8,
                      intra_node_busbw=316.8e9, inter_node_busbw=50e9, sources=("preset",))
H200 = HardwareSpec(name="H200", hbm_bytes=141e9, peak_bf16_flops=989e12, gemm_flops=794.5e12,
                    hbm_bandwidth=4.15e12, gemm_saturation_flops=None, devices_per_node=8,
                    intra_node_busbw=480e9, inter_node_busbw=50e9, sources=("preset",))
PRESETS = {"mi300x": MI300X, "h200": H200}


class HardwareError(ValueError):
    """An unknown preset or a file that describes no hardware."""


def preset(name: str) -> HardwareSpec:
    key = name.lower()
    if key not in PRESETS:
        raise HardwareError(f"unknown hardware preset {name!r}; choose one of {sorted(PRESETS)} or pass a JSON file")
    return PRESETS[key]


def from_sweeps(base: HardwareSpec, paths: list[str]) -> HardwareSpec:
    """`base` with every figure the given sweep JSON files measured (a directory means its *.json)."""
    files = []
    for p in paths:
        files += [os.path.join(p, f) for f in sorted(os.listdir(p)) if f.endswith(".json")] if os.path.isdir(p) else [p]
    update, used = {}, []
    for path in files:
        with open(path) as f:
            data = json.load(f)
        found = _measured(data)
        if found:
            update.update(found)
            used.append(os.path.basename(path))
    if not used:
        raise HardwareError(f"none of {files} holds an hbm, gemm or collectives sweep")
    return dataclasses.replace(base, **update, sources=tuple(base.sources) + tuple(used))


def load(spec: str) -> HardwareSpec:
    """'mi300x' / 'h200'; a hardware JSON written from `as_dict` (it has 'hbm_bytes'); sweep JSON files or
    directories, comma-separated, laid over the preset their device kind names (MI300X if none matches); or
    'preset:paths' to choose the preset, e.g.
    'h200:benchmarks/results/h200_hbm.json,benchmarks/results/h200_gemm.json'."""
    if spec.lower() in PRESETS:
        return preset(spec)
    head, sep, tail = spec.partition(":")
    if sep and head.lower() in PRESETS:
        return from_sweeps(preset(head), tail.split(","))
    paths = spec.split(",")
    missing = [p for p in paths if not os.path.exists(p)]
    if missing:
        raise HardwareError(f"hardware {spec!r}: {', '.join(missing)} is neither a preset ({sorted(PRESETS)}) nor "
                            "an existing file or directory")
    if len(paths) == 1 and os.path.isfile(paths[0]):
        with open(paths[0]) as f:
            data = json.load(f)
        if "hbm_bytes" in data:
            fields = {f.name for f in dataclasses.fields(HardwareSpec)}
            return HardwareSpec(**{k: (tuple(v) if k == "sources" else v) for k, v in data.items() if k in fields})
    return from_sweeps(_preset_for(paths), paths)


def _preset_for(paths: list[str]) -> HardwareSpec:
    """The preset whose name appears in the device kind the sweeps recorded (e.g. 'NVIDIA H200')."""
    for p in paths:
        for path in ([os.path.join(p, f) for f in os.listdir(p)] if os.path.isdir(p) else [p]):
            if path.endswith(".json"):
                with open(path) as f:
                    kind = json.load(f).get("device", {}).get("device_kind", "").lower()
                for key, spec in PRESETS.items():
                    if key in kind.replace(" ", ""):
                        return spec
    return MI300X


def _measured(data: dict) -> dict:
    out = {}
    if "copy_bandwidth" in data and data["copy_bandwidth"].get("xla"):
        out["hbm_bandwidth"] = data["copy_bandwidth"]["xla"]
    if "best_tflops" in data:
        out["gemm_flops"] = data["best_tflops"] * 1e12
        if data.get("saturation_flops"):
            out["gemm_saturation_flops"] = data["saturation_flops"]
    if "summary" in data and "bucket" in data:
        ar = [s for s in data["summary"] if s["collective"] == "all_reduce"]
        node = [s for s in ar if s["scope"] == "node"]
        cross = [s for s in ar if s["scope"] in ("rail", "global")]
        if node:
            out["intra_node_busbw"] = max(node, key=lambda s: s["n"])["plateau_busbw"]
        rail = [s for s in ar if s["scope"] == "rail"]
        if rail:
            out["inter_node_busbw"] = max(rail, key=lambda s: s["n"])["plateau_busbw"]
        fits = [s["fit_latency_s"] for s in (cross or node) if s.get("fit_latency_s")]
        if fits:
            out["collective_latency_s"] = max(fits)
        if data["bucket"]:
            out["gradient_bucket_bytes"] = data["bucket"]["bytes"]
    if out and data.get("device", {}).get("device_kind"):
        out["name"] = data["device"]["device_kind"]
    return out
