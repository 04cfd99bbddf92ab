"""Phase 2: 4T tokens at 4k, more code, math, reasoning and SFT-formatted data; starts from phase 1's weights
(also on a different device count: checkpoints are restored onto whatever mesh this run builds).

python -m launch.train --config configs/phase2_pretrain.py --workdir runs/phase2 \\
    --config.train.init_from=runs/phase1 --config.data.sources.web=... (web, code, math, reasoning)
"""

from ml_collections import ConfigDict

from configs.zaya1_base import get_config as _base


def get_config() -> ConfigDict:
    c = _base()
    c.data.weights = ConfigDict(dict(web=0.40, code=0.30, math=0.20, reasoning=0.10))
    c.train.steps = 4_000_000_000_000 // c.train.global_batch_tokens  # 238,418 steps
    c.train.init_from = "runs/phase1"
    c.optim.update(dict(warmup_steps=500))
    return c
