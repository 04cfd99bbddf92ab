"""The Appendix B storage I/O model reproduces the paper's numbers (spec section 17)."""

import json

import pytest

from benchmarks.systems import storage


def test_paper_numbers():
    iteration_bytes = storage.bytes_per_iteration(2 ** 24, token_bytes=4)  # 16M uint32 token ids
    assert iteration_bytes == 64 * 2 ** 20
    pages = storage.pages_per_iteration(iteration_bytes)
    assert pages == 16_384
    assert storage.iops_required(pages, 2.5, sigma=1) == pytest.approx(6_553.6)  # "6,554 sigma IOPS"
    assert storage.break_even_iteration_s(pages, 70_000, sigma=1) == pytest.approx(0.234, abs=5e-4)
    assert storage.break_even_iteration_s(pages, 70_000, sigma=8) == pytest.approx(1.87, abs=5e-3)  # < 2.5 s


def test_evaluate_flags_storage_bound_cases(tmp_path):
    result = storage.run(storage.StorageCase(iteration_s=0.5, sigmas=(1, 2, 4)), str(tmp_path), log=lambda *_: None)
    bound = {r["sigma"]: r["storage_bound"] for r in result["rows"]}
    assert bound == {1: False, 2: False, 4: True}  # 0.936 s > 0.5 s at sigma 4
    assert (tmp_path / "storage.json").exists() and (tmp_path / "storage.png").stat().st_size > 1000


def test_characterize_storage_cli(tmp_path):
    from benchmarks import characterize
    assert characterize.main(["storage", "--out", str(tmp_path), "--iteration-s", "2.5"]) == 0
    saved = json.loads((tmp_path / "storage.json").read_text())
    assert saved["pages_per_iteration"] == 16_384 and saved["iops_per_sigma"] == pytest.approx(6_553.6)
    (tmp_path / "storage.png").unlink()
    assert characterize.main(["plot", "--out", str(tmp_path)]) == 0  # figures come back from the JSON alone
    assert (tmp_path / "storage.png").stat().st_size > 1000
