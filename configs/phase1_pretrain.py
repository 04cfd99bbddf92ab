"""Phase 1: 8T tokens at 4k context, ~16M-token global batch (4096 x 4096 = 2^24), web-heavy mixture.

python -m launch.train --config configs/phase1_pretrain.py --workdir runs/phase1 --config.data.tokenizer=TOK \\
    --config.data.sources.web=... --config.data.sources.code=... --config.data.sources.math=...
"""

from ml_collections import ConfigDict

from configs.zaya1_base import get_config as _base


def get_config() -> ConfigDict:
    c = _base()
    c.data.weights = ConfigDict(dict(web=0.75, code=0.15, math=0.10))
    c.train.steps = 8_000_000_000_000 // c.train.global_batch_tokens  # 476,837 steps
    return c
