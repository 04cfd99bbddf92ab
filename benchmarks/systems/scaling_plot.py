"""One figure of the scaling report (matplotlib, headless): collective bus bandwidth against the nccl-tests
reference, data-parallel tokens/s per device over 1..N devices, context-parallel tokens/s per device over CP."""

from __future__ import annotations

import os


def plot(result: dict, path: str) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = result.get("parts", {})
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.4))
    _collectives(axes[0], parts.get("collectives") or {}, result.get("nccl_reference", {}))
    _dp(axes[1], parts.get("dp") or {})
    _cp(axes[2], parts.get("cp") or {})
    fig.suptitle(f"scaling on {result.get('devices')} x {result.get('device_kind', 'device')}")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _collectives(ax, coll: dict, ref: dict):
    for key in sorted({(r["n"], r["collective"]) for r in coll.get("records", [])}):
        rows = sorted((r for r in coll["records"] if (r["n"], r["collective"]) == key), key=lambda r: r["size_bytes"])
        ax.plot([r["size_bytes"] for r in rows], [r["busbw"] / 1e9 for r in rows], marker="o", markersize=3,
                label=f"{key[1]} x{key[0]}")
    if ref.get("all_reduce_busbw_ring_8gpu"):
        ax.axhline(ref["all_reduce_busbw_ring_8gpu"] / 1e9, linestyle=":", color="black")
        ax.annotate("nccl-tests 8xH100/H200 ring", (0.01, ref["all_reduce_busbw_ring_8gpu"] / 1e9),
                    xycoords=("axes fraction", "data"), fontsize=7)
    ax.set_xscale("log", base=2)
    ax.set(title="collectives (bus bandwidth)", xlabel="message size (bytes)", ylabel="GB/s")
    _finish(ax)


def _dp(ax, dp: dict):
    runs = dp.get("runs", [])
    if runs:
        ax.plot([r["devices"] for r in runs], [r["tokens_per_s_per_device"] for r in runs], marker="o",
                label="measured")
        ax.plot([r["devices"] for r in runs], [runs[0]["tokens_per_s_per_device"]] * len(runs), linestyle=":",
                color="grey", label="perfect weak scaling")
        for r in runs:
            if "efficiency" in r:
                ax.annotate(f"{r['efficiency']:.2f}", (r["devices"], r["tokens_per_s_per_device"]), fontsize=7)
    model = dp.get("model", {})
    ax.set(title=f"DP + ZeRO-1 weak scaling ({model.get('layers', '?')} layers, {dp.get('rows_per_device', '?')} x "
                 f"{dp.get('seq_len', '?')} per device)", xlabel="devices", ylabel="tokens/s per device")
    ax.set_ylim(bottom=0)
    _finish(ax)


def _cp(ax, cp: dict):
    runs = cp.get("runs", [])
    for seq in sorted({r["seq_len"] for r in runs}):
        rows = [r for r in runs if r["seq_len"] == seq]
        ax.plot([r["cp"] for r in rows], [r["tokens_per_s_per_device"] for r in rows], marker="o",
                label=f"{seq // 1024}k tokens" if seq >= 1024 else f"{seq} tokens")
        for r in rows:
            if "equal" in r:
                ax.annotate("=" if r["equal"] else "DIFF", (r["cp"], r["tokens_per_s_per_device"]), fontsize=8)
    ax.set(title="context parallelism (CP=1: one device)", xlabel="CP", ylabel="tokens/s per device")
    ax.set_ylim(bottom=0)
    _finish(ax)


def _finish(ax):
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
