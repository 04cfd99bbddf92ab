"""python -m launch.evaluate_lm --checkpoint PATH --tasks T1,T2 : lm-evaluation-harness tasks on a checkpoint.

PATH: a Hugging Face ZAYA directory or an Orbax training run (see launch.generate). Needs `pip install lm_eval`.
--include-path adds a folder of task YAML files (local tasks, e.g. tests/data/lm_eval_toy).

  python -m launch.evaluate_lm --checkpoint runs/default --tasks zaya_toy_mc --include-path tests/data/lm_eval_toy
  python -m launch.evaluate_lm --checkpoint ZAYA1_DIR --tasks hellaswag,arc_easy --max-length 4096 --output r.json
"""

import argparse
import json
import os
import sys
import time

from zaya_jax.config import COMPUTE_DTYPES

from launch._cli import ArgumentParser, UsageError, quiet_checkpoint_reads, user_errors


@user_errors("launch.evaluate_lm")
def main(argv=None):
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--tasks", required=True, help="comma-separated lm_eval task names")
    ap.add_argument("--include-path", default=None, help="folder with extra task YAML files")
    ap.add_argument("--tokenizer", default=None, help="'byte', tokenizer.json or a folder holding one (default: "
                    "an HF directory's own, else the run's recorded one)")
    ap.add_argument("--step", type=int, default=None)
    ap.add_argument("--dtype", default="float32", choices=COMPUTE_DTYPES,
                    help="compute dtype (the parameters are held in it; float16 computes from fp32 ones)")
    ap.add_argument("--kernels", choices=["auto", "xla"], default="auto", help="auto: the platform's fast kernels "
                    "(Pallas on GPU), xla: the XLA implementations (zaya_jax/inference/kernels.py)")
    ap.add_argument("--max-length", type=int, default=2048, help="longest scored/generated sequence")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-gen-toks", type=int, default=256)
    ap.add_argument("--num-fewshot", type=int, default=None)
    ap.add_argument("--limit", type=float, default=None, help="examples per task (testing only)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output", default=None, help="write lm_eval's results JSON here")
    ap.add_argument("--samples", default=None, help="write every scored example here, one JSON line each (task, "
                    "doc_id, the log-likelihoods or generations, the metrics), as lm_eval --log_samples records them")
    args = ap.parse_args(argv)
    quiet_checkpoint_reads()

    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
        from lm_eval.utils import make_table
    except ImportError:
        sys.exit("evaluate_lm: lm_eval is not installed (pip install lm_eval)")
    from zaya_jax.inference.lm_eval_adapter import ZayaLM
    from zaya_jax.inference.loading import matmul_precision

    tasks = args.tasks.split(",")
    for flag, path in (("--output", args.output), ("--samples", args.samples)):
        if path:  # checked before the evaluation runs, which on the full model takes minutes
            prepare_output_file(flag, path)
    if args.include_path and not os.path.isdir(args.include_path):
        raise UsageError(f"--include-path {args.include_path} is not a directory (a folder of task YAML files)")
    manager = task_manager(TaskManager, args)
    unknown = [t for t in tasks if not manager.match_tasks([t]) and not os.path.exists(t)]
    if unknown:
        raise UsageError(f"unknown task{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}: not in lm_eval's "
                         f"task index{' or --include-path' if args.include_path else ''}")
    with matmul_precision(args.dtype):
        start = time.perf_counter()
        lm = ZayaLM.from_checkpoint(args.checkpoint, tokenizer=args.tokenizer, dtype=args.dtype, step=args.step,
                                    kernels=args.kernels, max_length=args.max_length, batch_size=args.batch_size,
                                    max_gen_toks=args.max_gen_toks, seed=args.seed)
        loaded = time.perf_counter()
        out = lm_eval.simple_evaluate(model=lm, tasks=tasks, num_fewshot=args.num_fewshot,
                                      limit=args.limit, task_manager=manager,
                                      random_seed=args.seed, numpy_random_seed=args.seed, bootstrap_iters=0,
                                      log_samples=args.samples is not None)
    print(make_table(out))
    seconds = lm.scorer.seconds
    print(f"evaluate_lm: loaded in {loaded - start:.1f} s; log-likelihoods {seconds['scoring']:.1f} s after "
          f"{seconds['compile']:.1f} s compiling {len(lm.scorer.compiled_lengths)} sequence length(s); "
          f"{time.perf_counter() - start:.1f} s in all", file=sys.stderr)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(out["results"], f, indent=1, default=str)
    if args.samples:
        with open(args.samples, "w") as f:
            for task, samples in out["samples"].items():
                for sample in samples:
                    f.write(json.dumps({"task": task, **sample}, default=str) + "\n")
    return out["results"]


def prepare_output_file(flag: str, path: str) -> None:
    """A results file's folder is created now; a folder in its place, or one that cannot be created, is refused."""
    if os.path.isdir(path):
        raise UsageError(f"{flag} {path} is a directory: name a file")
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    except OSError as e:
        raise UsageError(f"{flag} {path}: its folder cannot be created ({e.strerror})") from e


def task_manager(TaskManager, args):
    """lm_eval's task index: of --include-path alone when it holds every requested task (indexing lm_eval's own
    thousands of task files takes seconds), else of both."""
    if args.include_path:
        local = TaskManager(include_path=args.include_path, include_defaults=False)
        if all(task in local.all_tasks for task in args.tasks.split(",")):
            return local
    return TaskManager(include_path=args.include_path)


if __name__ == "__main__":
    main()
