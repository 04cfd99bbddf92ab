"""The option combinations that need the model and the mesh, decided in one place right after the mesh is made
(before any parameter or optimizer state exists): what cannot run is refused in one line (TrainConfigError), and
the train step's options that apply only in some settings are resolved here, with a note saying why one asked
for is not used."""

from __future__ import annotations

import dataclasses

from zaya_jax.config import ModelConfig
from zaya_jax.parallel.context import ContextParallel, ContextParallelError
from zaya_jax.parallel.zigzag import Zigzag
from zaya_jax.train.errors import TrainConfigError
from zaya_jax.train.options import RunOptions


def pallas_settings(opts: RunOptions, model: ModelConfig) -> list[str]:
    """The settings that select a Pallas kernel, as command-line assignments."""
    pallas = [f"model.overrides.{f.name}='pallas'" for f in dataclasses.fields(model)
              if f.name.endswith("_impl") and getattr(model, f.name) == "pallas"]
    return pallas + (["optim.muon_gram_impl='pallas'"] if opts.optim.muon_gram_impl == "pallas" else [])


def check_on_mesh(opts: RunOptions, model: ModelConfig, mesh, micro_rows: int) -> None:
    """Refuses what cannot run on `mesh`: Pallas kernels on several CPU devices, cuDNN attention on several devices,
    a one-layer model, a microbatch that does not split over the data axis, a model context parallelism cannot run
    exactly."""
    pallas = pallas_settings(opts, model)
    if pallas and mesh.devices.size > 1 and mesh.devices.flat[0].platform == "cpu":
        # the CPU runs Pallas kernels in interpret mode, which the multi-device step's programs (shard_map over a
        # hierarchical view of the mesh) cannot hold; on one device they run
        raise TrainConfigError(f"{', '.join(pallas)}: on the CPU the Pallas kernels run in interpret mode, which "
                               f"cannot run on {mesh.devices.size} devices; set them to 'xla' "
                               "(moe_impl: 'ragged') there, or train on one device")
    if model.attention_impl == "cudnn" and mesh.devices.size > 1:
        # cuDNN's custom call needs one mesh for the whole program, but the per-device gradients run on the
        # hierarchical (node, data_local) view of it: JAX refuses the mix at lowering
        raise TrainConfigError("model attention_impl='cudnn' runs on one device only; on several devices use "
                               "attention_impl='pallas' (the portable flash kernel) or 'xla'")
    if model.num_hidden_layers < 2:
        # its inter-layer router scales are an empty [0, R] parameter: Orbax refuses to save an empty array (the
        # run would fail at its first checkpoint) and XLA does not compile collectives over one
        raise TrainConfigError(f"model num_hidden_layers={model.num_hidden_layers}: training needs at least 2 "
                               "layers (a one-layer model can be loaded and run for inference, not trained)")
    if micro_rows % mesh.shape["data"]:
        raise TrainConfigError(f"microbatch of {micro_rows} sequences does not split over data={mesh.shape['data']} "
                               f"(train.microbatch_tokens={opts.train.microbatch_tokens}, "
                               f"data.seq_len={opts.data.seq_len})")
    if mesh.shape["context"] > 1:
        try:
            context_parallel(opts, model, mesh).check(model)
        except ContextParallelError as e:
            raise TrainConfigError(f"mesh.context={mesh.shape['context']}: {e}") from None


def context_parallel(opts: RunOptions, model: ModelConfig, mesh) -> ContextParallel | None:
    """Zigzag sequence shards with ring / all-gather attention when the mesh has a context axis > 1."""
    if mesh.shape["context"] <= 1:
        return None
    return ContextParallel(Zigzag(mesh.shape["context"], opts.data.seq_len),
                           attention=opts.parallel.context_attention, impl=model.attention_impl)


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """make_accumulating_train_step's options as this run uses them."""

    reset_at_documents: bool
    ce_chunk_tokens: int | None  # None: the full head
    compute_dtype: str | None  # the compute-dtype view of the weights once per step (None: off)
    per_layer_view: bool
    grads_per_pass: int
    defer_expert_wgrad: bool
    note: str = ""  # why an option asked for is not used ('' when all are)


def step_options(opts: RunOptions, model: ModelConfig, *, several_devices: bool, accumulation: int) -> StepOptions:
    """train.per_layer_view needs unrolled layers and the compute-dtype view (train.cast_weights_once);
    train.defer_expert_wgrad needs one device (the default gradient function), the per-layer view and
    moe_impl 'pallas'. Both are on by default and used where they apply."""
    t = opts.train
    view_dtype = model.dtype if t.cast_weights_once else None
    per_layer_view = view_dtype is not None and not model.scan_layers and t.per_layer_view
    defer = t.defer_expert_wgrad and not several_devices and per_layer_view and model.moe_impl == "pallas"
    note = ""
    if t.defer_expert_wgrad and not defer and accumulation > 1:
        why = ("several devices" if several_devices else "layers under lax.scan or no compute-dtype view"
               if not per_layer_view else f"moe_impl {model.moe_impl!r}")
        note = (f"train.defer_expert_wgrad: not used ({why}; it needs one device, unrolled layers, the per-layer view "
                "and moe_impl 'pallas')")
    return StepOptions(reset_at_documents=opts.data.reset_at_documents, ce_chunk_tokens=t.ce_chunk_tokens or None,
                       compute_dtype=view_dtype, per_layer_view=per_layer_view, grads_per_pass=t.grads_per_pass,
                       defer_expert_wgrad=defer, note=note)
