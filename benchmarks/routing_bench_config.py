"""The bench-preset training run of docs/routing.md: configs/zaya1_base.py at the bench preset (ZAYA1-8B widths,
8 layers, 16 experts) on the built-in corpus, 16 microbatches of 2 x 4096 tokens per step, a 10-step warmup.

python -m launch.train --config benchmarks/routing_bench_config.py --workdir DIR"""

from configs.zaya1_base import get_config as _base


def get_config():
    c = _base()
    c.model.preset = "bench"
    c.data.update(dict(builtin=True, tokenizer="byte"))
    c.data.weights.update(dict(web=0.5, code=0.5))
    c.train.update(dict(steps=30, global_batch_tokens=16 * 2 * 4096, microbatch_tokens=2 * 4096, log_every=1,
                        eval_every=0, checkpoint_every=1000))
    c.optim.warmup_steps = 10
    return c
