"""Atomic float add with relaxed memory ordering, for Pallas kernels on the Triton lowering.

`plgpu.atomic_add` always lowers to `tt.atomic_rmw ... acq_rel, gpu` (the default of jax's `_atomic_rmw` in
jax/_src/pallas/triton/lowering.py). Acquire-release orders every add against all of the thread's other memory
operations, so each add waits for the software-pipelined tile loads in flight: the fused attention backward ran
far slower than the split one with it. Partial sums added into a buffer that nothing reads before the kernel
ends need atomicity only, which relaxed ordering keeps (Triton's NVIDIA lowering: `atom.global.gpu.relaxed.add`
instead of `...acq_rel.add`). On the H200 this nearly halved the fused backward's time at long rows
(docs/experiments.md).

This is our own primitive with jax's abstract evaluation and interpret-mode discharge (the same as
`plgpu.atomic_add`) and a Triton lowering rule that differs only in the memory semantic. It touches jax
internals; `available()` says whether they were found (they are on jax 0.11.2 and 0.12, both tested).
"""

from __future__ import annotations

import warnings

from jax.experimental.pallas import triton as plgpu

try:
    from jax._src import core as _core
    from jax._src import state as _state
    from jax._src import tree_util as _tree_util
    from jax._src.lib.mlir.dialects import arith as _arith
    from jax._src.lib.triton import dialect as _tt
    from jax._src.pallas.triton import lowering as _lowering
    from jax._src.pallas.triton import primitives as _tp
    from jax._src.state import discharge as _discharge
    from jax._src.state import indexing as _indexing
    from jax._src.state import primitives as _state_primitives
    _ = (_tp._atomic_abstract_eval,  # every internal used below, so that a missing one is found here
         _tp._atomic_rmw_discharge_rule, _tp.AtomicOpType.ADD, _lowering._atomic_rmw, _lowering._bcast_to,
         _lowering._compute_pointers_from_indices, _lowering._ensure_ir_value, _tt.MemSemantic.RELAXED, _arith.andi)
    _MISSING = None
except (ImportError, AttributeError) as exc:  # another jax: fall back to plgpu.atomic_add (correct, slower)
    _MISSING = f"{type(exc).__name__}: {exc}"


def available() -> bool:
    return _MISSING is None


if _MISSING is None:
    relaxed_atomic_add_p = _core.Primitive("relaxed_atomic_add")
    relaxed_atomic_add_p.def_effectful_abstract_eval(_tp._atomic_abstract_eval)
    _discharge.register_discharge_rule(relaxed_atomic_add_p)(_tp._atomic_rmw_discharge_rule)

    @_lowering.register_lowering(relaxed_atomic_add_p)
    def _relaxed_add_lowering(ctx, *args_flat, args_tree, atomic_type):
        del atomic_type  # always ADD
        block_info, *_ = ctx.block_infos
        ptr, indexers, val, mask = args_tree.unflatten(args_flat)
        *_, value_aval, mask_aval = args_tree.unflatten(ctx.avals_in)
        indexers = list(indexers)
        if not indexers or not isinstance(indexers[-1], _indexing.NDIndexer):
            ref_aval = _state.transform_type(indexers, ctx.avals_in[0])
            indexers.append(_indexing.NDIndexer.make_trivial_indexer(ref_aval.shape))
        if len(indexers) != 1:
            raise NotImplementedError("relaxed_atomic_add: one indexer only")
        ptr = _lowering._compute_pointers_from_indices(ptr, block_info, indexers[0])
        val = _lowering._ensure_ir_value(val, value_aval)
        if mask is not None:
            mask = _lowering._ensure_ir_value(mask, mask_aval)
        if isinstance(ptr, tuple):
            # jax >= 0.12: (pointers, mask of the block's in-bounds elements or None), as in its atomic_rmw rule:
            # value and mask broadcast to the indexed shape, the bounds mask and-ed into the mask
            ptr, bounds = ptr
            shape = indexers[0].get_indexer_shape_static()
            val = _lowering._bcast_to(val, shape)
            if mask is not None:
                mask = _lowering._bcast_to(mask, shape)
            if bounds is not None:
                mask = bounds if mask is None else _arith.andi(mask, bounds)
        return _lowering._atomic_rmw(_tt.RMWOp.FADD, ptr, val, mask=mask, semantic=_tt.MemSemantic.RELAXED)


def relaxed_atomic_add(ref, idx, val, *, mask=None):
    """ref[idx] += val atomically, with no ordering against the program's other memory operations. Floating
    point only; the sum of concurrent adds is exact up to its (unfixed) order."""
    if _MISSING is not None:
        warnings.warn(f"relaxed_atomic_add: jax internals not found ({_MISSING}); using plgpu.atomic_add "
                      f"(acquire-release, slower)", RuntimeWarning, stacklevel=2)
        return plgpu.atomic_add(ref, idx, val, mask=mask)
    x_ref, transforms = _state_primitives.get_ref_and_transforms(ref, idx, "relaxed_atomic_add")
    args_flat, args_tree = _tree_util.tree_flatten((x_ref, transforms, val, mask))
    return relaxed_atomic_add_p.bind(*args_flat, args_tree=args_tree, atomic_type=_tp.AtomicOpType.ADD)


__all__ = ["available", "relaxed_atomic_add"]
