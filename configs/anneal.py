"""Replay + anneal: replay of phase-2 data, then the learning rate decays to zero (a 1-sqrt cooldown over the
whole phase); starts from phase 3's weights at 32k context.

python -m launch.train --config configs/anneal.py --workdir runs/anneal \\
    --config.train.init_from=runs/phase3 --config.data.sources.web=... (the phase-2 sources)
"""

from ml_collections import ConfigDict

from configs.phase3_context_ext import get_config as _phase3


def get_config() -> ConfigDict:
    c = _phase3()
    c.data.weights = ConfigDict(dict(web=0.40, code=0.30, math=0.20, reasoning=0.10))  # phase-2 mixture replayed
    c.train.update(dict(init_from="runs/phase3", steps=3000))  # token count not published: ~90B tokens here
    c.optim.update(dict(schedule="wsd", warmup_steps=0, decay_fraction=1.0, cooldown="1-sqrt",
                        learning_rate=5e-4))
    return c
