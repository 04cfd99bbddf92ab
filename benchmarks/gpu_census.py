"""How many kernels a greedy decode step launches on an NVIDIA GPU, counted on a machine without one: the decode loop
compiled ahead of time for an H100 or H200 target (XLA's deviceless compilation through the CUDA PJRT plugin), and
the kernels of its while body counted in the optimized HLO (fusions, Pallas/Triton custom calls, library calls,
copies). A batch-1 step is bound by its launches (~2.5 us each in a command buffer: docs/experiments.md), so this count
is what a decode change has to lower; the GPU profile (benchmarks/profile_decode.py) times it.

Two layer counts are compiled and the per-layer kernels are their difference, by kernel kind and by the model op
that emitted them; the total is extrapolated to the preset's depth. The GPU's own autotuning does not run here (no
device), so GEMM fusions may split differently on the card.

Needs the CUDA plugin matching the installed jax, no GPU (bash benchmarks/gpu_census_env.sh DIR installs it):

PYTHONPATH=DIR:. python -m benchmarks.gpu_census [--preset zaya1_8b] [--layers 2,4] [--batch 1] [--target h100]
                                                 [--list] [--out FILE.json]"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import re

import jax
import jax.numpy as jnp

# XLA's device description of each target (its stream_executor GpuDeviceInfo fields): what fusion and tiling
# decisions read in place of a present card
TARGETS = {
    "h100": dict(kind="NVIDIA H100 80GB HBM3", memory=84929347584, bandwidth=3352320000000),
    "h200": dict(kind="NVIDIA H200", memory=150754820096, bandwidth=4800000000000),
}
# opcodes that launch nothing: views, tuples and constants
FREE = {"get-tuple-element", "bitcast", "tuple", "parameter", "constant", "opt-barrier", "after-all"}


def target_config(name: str) -> str:
    t = TARGETS[name]
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: {t['bandwidth']} l2_cache_size: 52428800 clock_rate_ghz: 1.98
  device_memory_size: {t['memory']} shared_memory_per_block_optin: 232448
  cuda_compute_capability {{ major: 9 }} registers_per_core_limit: 65536 registers_per_block_limit: 65536
}}
platform_name: "CUDA" dnn_version_info {{ major: 9 minor: 8 }} runtime_version {{ major: 12 minor: 9 }}
device_description_str: "{t['kind']}"
"""


def computations(hlo: str) -> dict[str, list[str]]:
    """The optimized module's computations by name, each as its lines."""
    return {m.group(1): m.group(0).split("\n")
            for m in re.finditer(r"^(?:ENTRY )?%([\w.\-]+) \(.*?\n\}", hlo, flags=re.S | re.M)}


def loop_kernels(hlo: str) -> list[tuple[str, str]]:
    """(kind, emitting op) of every kernel one iteration of the module's outermost while loop launches: the body's
    instructions that are not views or tuples, calls and conditionals followed into what they call."""
    comps = computations(hlo)
    body = re.search(r" while\(.*?body=%([\w.\-]+)", hlo).group(1)
    return _kernels(comps, body)


def _kernels(comps, name):
    found = []
    for line in comps[name][1:]:
        m = re.match(r"\s*(?:ROOT )?%[\w.\-]+ = .*? ([a-z\-]+)\(", line)
        if not m or m.group(1) in FREE:
            continue
        op = m.group(1)
        if op in ("call", "conditional", "while"):
            for callee in re.findall(r"(?:to_apply|calls|body)=%([\w.\-]+)", line):
                found += _kernels(comps, callee)
            for branches in re.findall(r"branch_computations=\{([^}]*)\}", line):
                found += [k for b in branches.split(",") for k in _kernels(comps, b.strip().lstrip("%"))]
            continue
        if op == "fusion":
            kind = re.search(r"kind=k(\w+)", line).group(1)
            custom = re.search(r'"kind":"_*(\w+?)"', line)
            op = f"fusion {kind}" + (f" {custom.group(1)}" if custom else "")
        elif op == "custom-call":
            op = "custom-call " + re.search(r'custom_call_target="([^"]+)"', line).group(1)
        source = re.search(r'op_name="(?:[^"]*/while/body/)?([^"]*)"', line)
        found.append((op, source.group(1) if source else "(none)"))
    return found


def decode_loop_hlo(preset_name: str, layers: int, batch: int, target: str, *, vocab: int, cache: int) -> str:
    """The optimized HLO of the greedy decode loop (64 new tokens) of a bf16 model of `preset_name` cut to `layers`
    layers and a `vocab`-row head, compiled for `target` with the kernels a GPU decode runs."""
    from flax import nnx
    from jax.experimental import topologies
    from jax._src.pallas.triton import gpu_info

    import pallas_kernels.platform as platform
    from zaya_jax.config import preset
    from zaya_jax.inference.decoder import Decoder
    from zaya_jax.inference.generate import _decode_loop
    from zaya_jax.inference.sampling import GREEDY
    from zaya_jax.model.zaya import ZayaForCausalLM

    # the kernels' trace-time view of the platform: a CUDA card of the target's generation, not this CPU
    platform.vendor = lambda: "cuda"
    version = gpu_info.gpu_version_from_device_kind(TARGETS[target]["kind"])
    gpu_info.get_gpu_info = lambda: gpu_info.get_gpu_info_from_version(version)
    topology = topologies.get_topology_desc(platform="cuda", target_config=target_config(target), topology="1x1x1")
    on_target = jax.sharding.NamedSharding(topologies.make_mesh(topology, (1,), ("x",)), jax.sharding.PartitionSpec())

    cfg = preset(preset_name, num_hidden_layers=layers, vocab_size=vocab, dtype="bfloat16", param_dtype="bfloat16")
    decoder = Decoder(ZayaForCausalLM(cfg, rngs=nnx.Rngs(0)), kernels="gpu")
    args = (decoder.state, decoder.init_cache(batch, cache), jnp.zeros((batch, cfg.vocab_size), jnp.float32),
            jax.random.key(0), jnp.asarray([-1], jnp.int32), jnp.int32(0), jnp.int32(64))
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=on_target), args)
    loop = jax.jit(functools.partial(_decode_loop, decoder.step_graphdef), static_argnames=("sampling", "steps"),
                   donate_argnums=1)
    return loop.lower(*abstract, sampling=GREEDY, steps=64).compile().as_text()


def census(kernels_by_depth: dict[int, list[tuple[str, str]]], depth: int) -> dict:
    """Per-layer kernels (the difference between the two depths, per layer), the rest (embedding, head, sampling,
    loop bookkeeping) and the total at `depth` layers."""
    (l1, k1), (l2, k2) = sorted(kernels_by_depth.items())
    per_layer = (len(k2) - len(k1)) / (l2 - l1)
    fixed = len(k1) - per_layer * l1

    def table(index):
        c1, c2 = (collections.Counter(k[index] for k in ks) for ks in (k1, k2))
        rows = {key: (c2[key] - c1[key]) / (l2 - l1) for key in c2 | c1}
        return dict(sorted(((k, v) for k, v in rows.items() if v), key=lambda kv: -kv[1]))

    return dict(kernels_per_layer=per_layer, kernels_outside_layers=fixed, layers=depth,
                kernels_per_token=fixed + per_layer * depth, per_layer_by_kind=table(0), per_layer_by_op=table(1))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="zaya1_8b")
    ap.add_argument("--layers", default="2,4", help="the two depths compiled")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=512, help="cache slots: prompt + 64 new tokens")
    ap.add_argument("--vocab", type=int, default=4096, help="the head's rows (the count does not depend on it)")
    ap.add_argument("--target", default="h100", choices=sorted(TARGETS))
    ap.add_argument("--list", action="store_true", help="also print every kernel of the deeper loop, in order")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    # before jax starts a backend: compile for the target, never for a local card, and skip the plugin's library
    # version checks (they need a driver)
    os.environ["CUDA_VISIBLE_DEVICES"] = "-1"
    os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"
    from zaya_jax.config import preset

    depths = [int(n) for n in args.layers.split(",")]
    if len(depths) != 2 or depths[0] >= depths[1] or depths[0] < 1:
        ap.error(f"--layers takes two increasing depths, e.g. 2,4 (got {args.layers!r})")
    found = {}
    for depth in depths:
        hlo = decode_loop_hlo(args.preset, depth, args.batch, args.target, vocab=args.vocab,
                              cache=args.prompt + 64)
        found[depth] = loop_kernels(hlo)
    report = dict(program="decode loop (greedy)", preset=args.preset, target=TARGETS[args.target]["kind"],
                  batch=args.batch, cache_slots=args.prompt + 64, compiled_depths=depths,
                  jax=jax.__version__, **census(found, preset(args.preset).num_hidden_layers))
    if args.list:
        for kind, source in found[depths[1]]:
            print(f"  {kind:40s} {source}")
    print(json.dumps(report, indent=1))
    if args.out:
        json.dump(report, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
