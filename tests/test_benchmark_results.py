"""Where benchmark results live (issue 35): the results of record in benchmarks/results/, a small folder; every
other record is a row of docs/experiments.md with its file in git history. Reads files only (no imports, no git).

  (a) benchmarks/results/ holds fewer than 20 files, and no result file (JSON, PNG, text, log) sits elsewhere in
      benchmarks/, next to the code;
  (b) every result path that README.md or docs/*.md cites as a live file exists: `benchmarks/results/NAME` anywhere,
      and the bare `NAME.json` / `NAME.png` file names of the README's tables (they name files of benchmarks/results/);
      a removed file is cited as "git history: PATH @ COMMIT" and is not checked here;
  (c) the library (zaya_jax/, pallas_kernels/) cites no benchmark result file.
"""

from __future__ import annotations

import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
RESULT_EXT = (".json", ".png", ".txt", ".log")


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def test_results_folder_is_small_and_the_only_one():
    names = os.listdir(RESULTS)
    assert len(names) < 20, f"benchmarks/results/ has {len(names)} files: keep the results the README cites"
    stray = []
    for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, "benchmarks")):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        if os.path.abspath(dirpath) == RESULTS:
            continue
        stray += [os.path.relpath(os.path.join(dirpath, f), ROOT) for f in filenames if f.endswith(RESULT_EXT)]
    assert not stray, f"result files outside benchmarks/results/ (a row of docs/experiments.md instead): {stray}"


def test_cited_results_exist():
    docs = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
    missing = []
    for path in docs:
        text = _read(path)
        for name in re.findall(r"benchmarks/results/([\w.-]+\.(?:json|png))", text):
            if not os.path.exists(os.path.join(RESULTS, name)):
                missing.append(f"{os.path.relpath(path, ROOT)}: benchmarks/results/{name}")
    readme = _read(os.path.join(ROOT, "README.md"))
    for name in re.findall(r"`([\w-]+\.(?:json|png))`", readme):
        if name in ("config.json", "tokenizer.json", "generation_config.json"):
            continue
        if not os.path.exists(os.path.join(RESULTS, name)):
            missing.append(f"README.md: {name}")
    assert not missing, f"cited as live results but not in benchmarks/results/: {missing}"


def test_library_cites_no_benchmark_file():
    hits = []
    for top in ("zaya_jax", "pallas_kernels"):
        for path in glob.glob(os.path.join(ROOT, top, "**", "*.py"), recursive=True):
            for line_no, line in enumerate(_read(path).splitlines(), 1):
                if re.search(r"benchmarks/[\w/.-]+\.(?:json|png)|_h200[\w]*\.json", line):
                    hits.append(f"{os.path.relpath(path, ROOT)}:{line_no}")
    assert not hits, f"the library cites benchmark results (docs/experiments.md holds them): {hits}"
