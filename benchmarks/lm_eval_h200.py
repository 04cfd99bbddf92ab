"""A 500-question multiple-choice task through lm-evaluation-harness on the GPU: `python -m launch.evaluate_lm` on an
exported random-initialised model next to lm_eval's own `hf` backend (transformers' ZayaForCausalLM) on the same
directory, timed end to end as a user runs them, with the scores compared question by question.

python -m benchmarks.lm_eval_h200 WORK [--preset zaya1_8b] [--runs ours:bfloat16,hf:bfloat16,ours:float32,hf:float32]
                                       [--questions 500] [--batch-size 32] [--out FILE.json]
                                       [--hf-python PYTHON] [--device cuda]

WORK receives the task (WORK/task: YAML, loader and JSON lines, generated with a fixed seed), the export (WORK/hf:
bf16 safetensors written by to_hf from one jitted init, and a byte-level BPE tokenizer.json trained on the task's text
that both sides read) and each run's samples. A run is SIDE:DTYPE; the driver writes --out after every run. Scores
are compared per dtype: accuracies, the questions whose chosen answer differs, the largest per-choice log-likelihood
difference; each bf16 run is also compared with HF's fp32 run (a random model's choices are near ties, so bf16
rounding flips some: how many, ours next to HF's own bf16). Our runs also record evaluate_lm's own split of its time
(load, compile, log-likelihoods). On the GPU machine lm_eval and its dependencies travel as wheels
(benchmarks/device_wheels.sh). On the CPU: --preset tiny --questions 30 --hf-python .venv-ref/bin/python --device cpu.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import time

import numpy as np

TASK = "zaya_mc500"
TASK_YAML = """task: zaya_mc500
custom_dataset: !function mc500_data.load
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{question}}\\nAnswer:"
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""
LOADER = '''import json, os
import datasets


def load(**_):
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "zaya_mc500.jsonl")) as f:
        return datasets.DatasetDict({"test": datasets.Dataset.from_list([json.loads(line) for line in f])})
'''
WORDS = ("river", "mountain", "lantern", "garden", "engine", "violin", "harbor", "meadow", "compass", "glacier",
         "orchard", "canyon", "library", "window", "thunder", "pepper", "saddle", "marble", "ribbon", "falcon")


def questions(n: int, seed: int = 0) -> list[dict]:
    """Arithmetic, comparison and spelling questions with four choices, the answer's position drawn at random."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        kind = i % 3
        if kind == 0:
            a, b = rng.integers(10, 500, 2)
            right, wrong = str(a + b), [str(a + b + d) for d in rng.choice([-20, -10, -1, 1, 2, 10, 30], 3, False)]
            q = f"What is {a} plus {b}?"
        elif kind == 1:
            a, b, c, d = rng.choice(1000, 4, replace=False)
            right, wrong = str(max(a, b, c, d)), [str(x) for x in sorted((a, b, c, d)) if x != max(a, b, c, d)]
            q = f"Which is the largest of {a}, {b}, {c} and {d}?"
        else:
            word = WORDS[rng.integers(len(WORDS))]
            right = word[0]
            wrong = [str(x) for x in rng.choice([ch for ch in "abcdefghijklmnopqrstuvwxyz" if ch != right], 3, False)]
            q = f"What is the first letter of the word '{word}'?"
        choices = list(wrong)
        answer = int(rng.integers(4))
        choices.insert(answer, right)
        out.append(dict(question=q, choices=choices, answer=answer))
    return out


def write_task(directory: str, n: int) -> list[dict]:
    os.makedirs(directory, exist_ok=True)
    docs = questions(n)
    with open(os.path.join(directory, f"{TASK}.jsonl"), "w") as f:
        f.writelines(json.dumps(d) + "\n" for d in docs)
    with open(os.path.join(directory, f"{TASK}.yaml"), "w") as f:
        f.write(TASK_YAML)
    with open(os.path.join(directory, "mc500_data.py"), "w") as f:
        f.write(LOADER)
    return docs


def write_bpe_tokenizer(directory: str, texts: list[str], vocab_size: int) -> None:
    """A byte-level BPE trained on texts (tokenizer.json), with the tokenizer_config.json transformers' AutoTokenizer
    reads; our loader reads the same tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<bos>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    tok.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
                   "pad_token": "<pad>"}, f)


def task_texts(docs: list[dict]) -> list[str]:
    return [f"Question: {d['question']}\nAnswer: " + " ".join(d["choices"]) for d in docs]


def export(preset: str, work: str, questions: int) -> dict:
    """Runs the export as a child process: JAX's memory pool in this driver would stay reserved through the runs."""
    if os.path.isfile(os.path.join(work, "hf", "config.json")):
        return {"export": "reused"}
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "benchmarks.lm_eval_h200", work, "--preset", preset,
                    "--questions", str(questions), "--export-child"], check=True)
    return {"export_s": round(time.perf_counter() - start, 1)}


def export_child(preset: str, directory: str, docs: list[dict]) -> None:
    import jax.numpy as jnp

    from benchmarks.bench_inference import init_model
    from zaya_jax.checkpoint.hf import to_hf
    model = init_model(preset)
    to_hf(model, directory, dtype=jnp.bfloat16)
    write_bpe_tokenizer(directory, task_texts(docs), vocab_size=min(2048, model.cfg.vocab_size))


def run_side(side: str, dtype: str, work: str, batch_size: int, hf_python: str, device: str) -> dict:
    """One evaluation as a fresh process (its own GPU memory, load and compile included in the wall time)."""
    out_dir = os.path.join(work, f"{side}_{dtype}")
    os.makedirs(out_dir, exist_ok=True)
    task_dir, model_dir = os.path.join(work, "task"), os.path.join(work, "hf")
    if side == "ours":
        cmd = [sys.executable, "-m", "launch.evaluate_lm", "--checkpoint", model_dir, "--tasks", TASK,
               "--include-path", task_dir, "--dtype", dtype, "--batch-size", str(batch_size), "--max-length", "256",
               "--samples", os.path.join(out_dir, "samples.jsonl"), "--output", os.path.join(out_dir, "results.json")]
    else:
        cmd = [hf_python, "-m", "lm_eval", "--model", "hf", "--model_args", f"pretrained={model_dir},dtype={dtype}",
               "--tasks", TASK, "--include_path", task_dir, "--device", device, "--batch_size", str(batch_size),
               "--output_path", out_dir, "--log_samples"]
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        return dict(status="error", wall_s=round(wall, 1), stderr=proc.stderr[-3000:])
    timing = {}
    if side == "ours":
        results = json.load(open(os.path.join(out_dir, "results.json")))[TASK]
        samples = os.path.join(out_dir, "samples.jsonl")
        m = re.search(r"loaded in ([\d.]+) s; log-likelihoods ([\d.]+) s after ([\d.]+) s compiling "
                      r".*; ([\d.]+) s in all", proc.stderr)
        if m:  # the rest of wall_s is the process's start (imports, the GPU backend) and exit
            timing = dict(zip(("load_s", "loglikelihood_s", "compile_s", "in_process_s"), map(float, m.groups())))
    else:
        results = json.load(open(glob.glob(os.path.join(out_dir, "*", "results_*.json"))[0]))["results"][TASK]
        samples = glob.glob(os.path.join(out_dir, "*", f"samples_{TASK}_*.jsonl"))[0]
    return dict(status="ok", wall_s=round(wall, 1), acc=results["acc,none"], acc_norm=results["acc_norm,none"],
                samples=samples, **timing)


def compare(a: dict, b: dict) -> dict:
    def load(path):
        with open(path) as f:
            return {s["doc_id"]: np.array([float(r[0][0]) for r in s["resps"]]) for s in map(json.loads, f)}

    x, y = load(a["samples"]), load(b["samples"])
    docs = sorted(set(x) & set(y))
    diff = np.array([np.abs(x[d] - y[d]).max() for d in docs])  # per question, the largest over its choices
    return dict(questions=len(docs), acc_equal=a["acc"] == b["acc"], acc_norm_equal=a["acc_norm"] == b["acc_norm"],
                chosen_answer_differs=int(sum(np.argmax(x[d]) != np.argmax(y[d]) for d in docs)),
                loglikelihood_diff_p50=float(np.median(diff)), loglikelihood_diff_p99=float(np.percentile(diff, 99)),
                max_abs_loglikelihood_diff=float(diff.max()), questions_diff_above_1e_4=int((diff > 1e-4).sum()),
                mean_abs_loglikelihood=float(np.mean([np.abs(x[d]).mean() for d in docs])))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("work")
    ap.add_argument("--preset", default="zaya1_8b")
    ap.add_argument("--runs", default="ours:bfloat16,hf:bfloat16,ours:float32,hf:float32")
    ap.add_argument("--questions", type=int, default=500)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--out", default=None)
    ap.add_argument("--hf-python", default=sys.executable, help="a Python with torch, transformers and lm_eval")
    ap.add_argument("--device", default="cuda", help="the hf backend's torch device")
    ap.add_argument("--export-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    docs = write_task(os.path.join(args.work, "task"), args.questions)
    if args.export_child:
        return export_child(args.preset, os.path.join(args.work, "hf"), docs)
    result = dict(preset=args.preset, questions=args.questions, batch_size=args.batch_size, runs={}, agreement={},
                  against_hf_float32={})
    result.update(export(args.preset, args.work, args.questions))
    for run in args.runs.split(","):
        side, dtype = run.split(":")
        result["runs"][run] = run_side(side, dtype, args.work, args.batch_size, args.hf_python, args.device)
        print(run, {k: v for k, v in result["runs"][run].items() if k != "stderr"}, flush=True)
        ours, hf = result["runs"].get(f"ours:{dtype}", {}), result["runs"].get(f"hf:{dtype}", {})
        if ours.get("status") == hf.get("status") == "ok":
            result["agreement"][dtype] = compare(ours, hf)
            print(dtype, result["agreement"][dtype], flush=True)
        reference = result["runs"].get("hf:float32", {})
        if reference.get("status") == "ok":  # each bf16 run's distance from the fp32 answer, ours next to HF's
            for name, r in result["runs"].items():
                if name.endswith(":bfloat16") and r.get("status") == "ok":
                    result["against_hf_float32"][name] = compare(r, reference)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
