"""Training throughput on one GPU, ours vs Hugging Face ZayaForCausalLM (PyTorch), side by side (issue 10):

    python -m benchmarks.bench_train --preset bench --time-budget 420 --out benchmarks/results/train_h200.json
    python -m benchmarks.bench_train --preset tiny --batch 2 --seq 32 --steps 2 --no-hf --long-seq 64 \
        --accum 2 --batch-ladder 3 --out /tmp/bench.json  # CPU smoke

What is measured, the schedule and the JSON keys are described in benchmarks/training/bench.py.
"""

from benchmarks.training.bench import main

if __name__ == "__main__":
    main()
