"""The training iterator: step-indexed batches, exact resume (also at another DP size), prefetch, eval batches."""

import json

import numpy as np
import pytest

from zaya_jax.data import (Blend, DataError, PackedSource, TrainIterator, eval_batches, train_iterator,
                           write_indexed_dataset)

SEQ, BATCH = 16, 8


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("loader")
    rng = np.random.default_rng(0)
    out = {}
    for name, num_docs in (("web", 40), ("code", 120)):
        docs = [np.append(rng.integers(3, 500, size=rng.integers(1, 60)), 1) for _ in range(num_docs)]
        out[name] = write_indexed_dataset(str(root / name), docs, np.uint16)
    return out


WEIGHTS = {"web": 0.4, "code": 0.6}


def _iterator(sources, **kw):
    kw.setdefault("prefetch", 0)
    return train_iterator(sources, WEIGHTS, seq_len=SEQ, global_batch=BATCH, seed=3, block_size=32, **kw)


def _take(it, n):
    return [next(it) for _ in range(n)]


def _same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_batch_layout(sources):
    batch = next(_iterator(sources, vocab_size=512))
    assert {k: (v.shape, v.dtype.name) for k, v in batch.items()} == {
        "inputs": ((BATCH, SEQ), "int32"), "targets": ((BATCH, SEQ), "int32"), "loss_mask": ((BATCH, SEQ), "float32"),
        "segment_ids": ((BATCH, SEQ), "int32"), "positions": ((BATCH, SEQ), "int32"), "source_ids": ((BATCH,), "int32")}


def test_batch_k_is_a_pure_function_of_seed_step_and_batch(sources):
    it = _iterator(sources)
    batches = _take(it, 6)
    again = _iterator(sources)
    _same(again.batch(4), batches[4])
    blend_rows = again.blend.rows(4 * BATCH, BATCH)
    _same(blend_rows, batches[4])
    assert not np.array_equal(batches[0]["inputs"], batches[1]["inputs"])


def test_exact_resume_from_saved_state(sources):
    full = _take(_iterator(sources), 10)
    first = _iterator(sources)
    _take(first, 4)
    state = json.loads(json.dumps(first.state()))  # what a checkpoint stores
    assert state["step"] == 4 and state["sequence"] == 4 * BATCH
    resumed = _iterator(sources, state=state)
    assert resumed.step == 4
    for want, got in zip(full[4:], _take(resumed, 6)):
        _same(want, got)


@pytest.mark.parametrize("num_ranks", [2, 4, 8])
def test_resume_at_another_data_parallel_size_reads_the_same_global_batches(sources, num_ranks):
    full = _take(_iterator(sources), 7)
    first = _iterator(sources, num_ranks=2, rank=1)
    _take(first, 3)
    state = first.state()
    ranks = [_iterator(sources, rank=r, num_ranks=num_ranks, state=state) for r in range(num_ranks)]
    for step in range(3, 7):
        parts = [next(it) for it in ranks]
        assert all(p["inputs"].shape == (BATCH // num_ranks, SEQ) for p in parts)
        glued = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
        _same(glued, full[step])


def test_prefetch_does_not_change_order(sources):
    plain = _take(_iterator(sources), 12)
    threaded = _iterator(sources, prefetch=3, num_threads=2)
    for want, got in zip(plain, _take(threaded, 12)):
        _same(want, got)
    state = threaded.state()
    threaded.close()
    resumed = _iterator(sources, prefetch=2, state=state)
    _same(next(resumed), _iterator(sources).batch(12))


def test_resume_with_another_global_batch_continues_the_stream(sources):
    it = _iterator(sources)
    _take(it, 3)
    wider = train_iterator(sources, WEIGHTS, seq_len=SEQ, global_batch=2 * BATCH, seed=3, block_size=32,
                           state=it.state(), prefetch=0)
    reference = _iterator(sources)
    _take(reference, 3)
    want = _take(reference, 2)
    got = next(wider)
    _same({k: np.concatenate([w[k] for w in want]) for k in got}, got)
    assert wider.state()["sequence"] == 5 * BATCH


def test_state_from_another_configuration_is_refused(sources):
    state = _iterator(sources).state()
    other = train_iterator(sources, {"web": 0.5, "code": 0.5}, seq_len=SEQ, global_batch=BATCH, seed=3,
                           block_size=32, prefetch=0)
    with pytest.raises(DataError, match="another data configuration"):
        TrainIterator(other.blend, global_batch=BATCH, state=state, prefetch=0)
    with pytest.raises(DataError, match="not a data-iterator state"):
        _iterator(sources, state={"step": 1})


def test_vocab_check_names_the_source(sources):
    with pytest.raises(DataError, match="outside the model's vocab of 100"):
        next(_iterator(sources, vocab_size=100))


def test_uneven_rank_split_is_refused(sources):
    with pytest.raises(DataError, match="equal rank slices"):
        _iterator(sources, num_ranks=3)


def test_eval_batches_cover_every_window_once_with_padding(sources):
    source = PackedSource("web", sources["web"], SEQ)
    batches = list(eval_batches(source, 8, source_id=1))
    assert len(batches) == -(-source.num_windows // 8)
    real = np.concatenate([b["source_ids"] for b in batches])
    assert (real == 1).sum() == source.num_windows and set(real[source.num_windows:].tolist()) <= {-1}
    inputs = np.concatenate([b["inputs"] for b in batches])[:source.num_windows]
    np.testing.assert_array_equal(inputs, source.rows(range(source.num_windows))["inputs"])
    last = batches[-1]
    assert last["loss_mask"][last["source_ids"] == -1].sum() == 0
    halves = [list(eval_batches(source, 8, rank=r, num_ranks=2, max_batches=2, source_id=1)) for r in range(2)]
    for b in range(2):
        _same({k: np.concatenate([halves[0][b][k], halves[1][b][k]]) for k in batches[b]}, batches[b])


def test_blend_is_exposed_for_custom_sources(sources):
    packed = [PackedSource(name, prefix, SEQ) for name, prefix in sources.items()]
    it = TrainIterator(Blend(packed, WEIGHTS, seed=3, block_size=32), global_batch=BATCH, prefetch=0)
    _same(next(it), next(_iterator(sources)))
