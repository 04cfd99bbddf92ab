"""Training throughput on one GPU, ours vs Hugging Face ZayaForCausalLM (PyTorch), side by side:

    python -m launch.bench_train --preset bench [--batch 2 --seq 4096 --steps 8 --out benchmarks/train_h200.json]
    python -m launch.bench_train --preset tiny --batch 2 --seq 64 --steps 2 --no-hf --out /tmp/bench.json  # CPU smoke

Everything (variants, phases, what is timed, the JSON fields) is described in zaya_jax/train/bench.py.
"""

from zaya_jax.train.bench import main

if __name__ == "__main__":
    main()
