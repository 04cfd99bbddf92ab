"""Weighted mixtures: exact per-block counts, weights honoured, each source read without gaps or repeats."""

import numpy as np
import pytest

from zaya_jax.data import Blend, DataError, PackedSource, block_counts, write_indexed_dataset

SEQ = 8


def _source(tmp_path, name, num_windows, first_token):
    """A source whose window q starts with token first_token + q, so rows reveal which window they are."""
    tokens = np.arange(first_token, first_token + num_windows * SEQ + 1)
    prefix = write_indexed_dataset(str(tmp_path / name), [tokens], np.int32)
    return PackedSource(name, prefix, SEQ)


@pytest.fixture
def sources(tmp_path):
    return [_source(tmp_path, "web", 50, 0), _source(tmp_path, "code", 400, 10_000),
            _source(tmp_path, "math", 300, 20_000)]


def test_block_counts_round_by_largest_remainder():
    assert block_counts([1, 1], 1024).tolist() == [512, 512]
    assert block_counts([1, 2, 3], 1024).tolist() == [171, 341, 512]
    assert block_counts([0.7, 0.3], 10).tolist() == [7, 3]
    assert block_counts([1, 1, 1], 2).tolist() == [1, 1, 0]
    assert block_counts([0.0, 5.0], 16).tolist() == [0, 16]


def test_weights_honoured_within_tolerance(sources):
    weights = {"web": 0.2, "code": 0.5, "math": 0.3}
    blend = Blend(sources, weights, seed=1, block_size=64)
    source, _ = blend.locate(np.arange(3000))
    fractions = np.bincount(source, minlength=3) / 3000
    for name, got in zip(blend.names, fractions):
        assert abs(got - weights[name]) < 0.01, (name, got)
    # exact in every whole block
    for b in range(3000 // 64):
        counts = np.bincount(source[b * 64:(b + 1) * 64], minlength=3)
        assert counts.tolist() == blend.counts.tolist()
    # ... and mixed within the block, not in runs
    assert len(np.unique(source[:16])) > 1


def test_each_source_read_once_per_epoch_then_reshuffled(sources):
    blend = Blend(sources, {"web": 1, "code": 1, "math": 1}, seed=0, block_size=30)
    source, window = blend.locate(np.arange(600))
    web = window[source == blend.names.index("web")]  # 200 reads of a 50-window source: 4 epochs
    epochs = web.reshape(4, 50)
    for e in epochs:
        assert sorted(e.tolist()) == list(range(50))
    assert not np.array_equal(epochs[0], epochs[1])


def test_rows_are_the_located_windows(sources):
    blend = Blend(sources, {"web": 1, "code": 2, "math": 1}, seed=5, block_size=16)
    rows = blend.rows(37, 20)
    source, window = blend.locate(np.arange(37, 57))
    assert rows["source_ids"].tolist() == source.tolist()
    first = {"web": 0, "code": 10_000, "math": 20_000}
    want = [first[blend.names[s]] + SEQ * q for s, q in zip(source, window)]
    assert rows["inputs"][:, 0].tolist() == want


def test_order_depends_on_seed_and_fingerprint_on_config(sources, tmp_path):
    a = Blend(sources, {"web": 1, "code": 1, "math": 1}, seed=0)
    b = Blend(sources, {"web": 1, "code": 1, "math": 1}, seed=1)
    c = Blend(sources, {"web": 1, "code": 2, "math": 1}, seed=0)
    assert not np.array_equal(a.locate(np.arange(100))[1], b.locate(np.arange(100))[1])
    assert len({a.fingerprint, b.fingerprint, c.fingerprint}) == 3
    same = Blend(list(reversed(sources)), {"math": 1, "web": 1, "code": 1}, seed=0)
    assert same.fingerprint == a.fingerprint and same.names == a.names


def test_bad_mixtures_are_refused(sources, tmp_path):
    with pytest.raises(DataError, match="mixture weights name"):
        Blend(sources, {"web": 1, "code": 1}, seed=0)
    with pytest.raises(DataError, match="not all zero"):
        Blend(sources, {"web": 0, "code": 0, "math": 0}, seed=0)
    tiny = PackedSource("tiny", write_indexed_dataset(str(tmp_path / "t"), [[1, 2]], np.uint16), SEQ)
    with pytest.raises(DataError, match="fewer than one row"):
        Blend([tiny, *sources], {"tiny": 1, "web": 1, "code": 1, "math": 1}, seed=0)
