"""The Appendix B storage I/O model (spec section 17): how many read operations per second the data loader needs,
and below which iteration time storage becomes the bottleneck.

    pages per iteration   N = bytes read per iteration / page size      (64 MiB / 4 KiB = 16,384 for ZAYA1)
    IOPS needed           sigma * N / t_iter                            (6,553.6 sigma at 2.5 s)
    break-even t_iter     sigma * N / IOPS budget                       (0.234 sigma s at 70,000 IOPS)
sigma is the scatter factor: how many page reads a page of useful tokens costs (1-2 for sequential, well packed
shards; 2-8 for fragmented or random access). Bytes per iteration = tokens per global batch x bytes per token id
(4: uint32 ids, needed above 65,535 vocabulary entries).
"""

from __future__ import annotations

import dataclasses

from benchmarks.systems import plots
from benchmarks.systems.report import table, write_json

PAGE_BYTES = 4096


def bytes_per_iteration(global_batch_tokens: int, token_bytes: int = 4) -> int:
    return global_batch_tokens * token_bytes


def pages_per_iteration(iteration_bytes: float, page_bytes: int = PAGE_BYTES) -> float:
    return iteration_bytes / page_bytes


def iops_required(pages: float, iteration_s: float, sigma: float) -> float:
    return sigma * pages / iteration_s


def break_even_iteration_s(pages: float, iops_budget: float, sigma: float) -> float:
    """Iterations faster than this starve on storage."""
    return sigma * pages / iops_budget


@dataclasses.dataclass(frozen=True)
class StorageCase:
    iteration_bytes: float = 64 * 2**20
    iteration_s: float = 2.5
    iops_budget: float = 70_000
    sigmas: tuple = (1, 2, 4, 8)
    page_bytes: int = PAGE_BYTES


def evaluate(case: StorageCase) -> dict:
    pages = pages_per_iteration(case.iteration_bytes, case.page_bytes)
    rows = [dict(sigma=s, iops_required=iops_required(pages, case.iteration_s, s),
                 break_even_s=break_even_iteration_s(pages, case.iops_budget, s),
                 storage_bound=break_even_iteration_s(pages, case.iops_budget, s) > case.iteration_s)
            for s in case.sigmas]
    return dict(case=dataclasses.asdict(case), pages_per_iteration=pages,
                iops_per_sigma=iops_required(pages, case.iteration_s, 1),
                break_even_s_per_sigma=break_even_iteration_s(pages, case.iops_budget, 1), rows=rows)


def summary_table(result: dict) -> str:
    return table(result["rows"], [("sigma", "sigma", ""), ("iops_required", "IOPS needed", ",.0f"),
                                  ("break_even_s", "break-even s", ".3f"), ("storage_bound", "storage-bound", "")])


def plot(result: dict, path: str) -> str:
    case = result["case"]
    times = [0.05 * 1.25 ** i for i in range(25)]  # 0.05 s .. 10 s
    series = [dict(label=f"sigma {r['sigma']}", x=times,
                   y=[iops_required(result["pages_per_iteration"], t, r["sigma"]) for t in times])
              for r in result["rows"]]
    panel = dict(title=f"{result['pages_per_iteration']:,.0f} pages per iteration", series=series,
                 hlines=[dict(y=case["iops_budget"], label="IOPS budget")],
                 marks=[dict(x=case["iteration_s"], label="iteration time")])
    return plots.line_panels(path, [panel], xlabel="iteration time (s)", ylabel="IOPS needed", logy=True, xbase=10,
                             title="data-loading I/O model (Appendix B)")


def run(case: StorageCase, out_dir: str, log=print) -> dict:
    result = evaluate(case)
    write_json(f"{out_dir}/storage.json", result)
    plots.try_plot(plot, result, f"{out_dir}/storage.png", log)
    log(f"{result['pages_per_iteration']:,.0f} pages per iteration; {result['iops_per_sigma']:,.1f} x sigma IOPS at "
        f"{case.iteration_s} s; break-even {result['break_even_s_per_sigma']:.3f} x sigma s at "
        f"{case.iops_budget:,.0f} IOPS")
    log(summary_table(result))
    return result
