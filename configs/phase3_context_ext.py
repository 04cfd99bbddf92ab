"""Phase 3 (mid-training): context 4k -> 32k, ~30M-token global batch (912 sequences of 32k), context parallel 2
with microbatch 1 per data rank, RoPE theta 1e4 -> 1e6, more STEM/reasoning and long documents; starts from
phase 2's weights.

python -m launch.train --config configs/phase3_context_ext.py --workdir runs/phase3 \\
    --config.train.init_from=runs/phase2 --config.data.sources.long=... (long, reasoning, math, code, web)
"""

from ml_collections import ConfigDict

from configs.zaya1_base import get_config as _base


def get_config() -> ConfigDict:
    c = _base()
    c.model.overrides.rope = ConfigDict(dict(hybrid=ConfigDict(dict(theta=1_000_000.0, partial_rotary_factor=0.5))))
    c.model.overrides.max_position_embeddings = 32768
    c.data.seq_len = 32768
    c.data.weights = ConfigDict(dict(long=0.35, reasoning=0.25, math=0.15, code=0.15, web=0.10))
    c.train.update(dict(global_batch_tokens=912 * 32768, microbatch_tokens=912 * 32768, init_from="runs/phase2",
                        steps=1_000_000_000_000 // (912 * 32768)))  # ~1T tokens, 33,460 steps
    c.optim.update(dict(warmup_steps=200))
    c.mesh.context = 2
    return c
