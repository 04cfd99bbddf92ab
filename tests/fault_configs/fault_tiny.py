"""A very small run for the fault-tolerance tests (seconds per step on 2 CPU cores)."""

from configs.default import get_config as _default


def get_config():
    c = _default()
    c.model.overrides.update(dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                  head_dim=16, moe_intermediate_size=64, num_experts=4, router_hidden_size=16))
    c.data.update(dict(seq_len=32, prefetch=0))
    c.train.update(dict(steps=10, global_batch_tokens=8 * 32, microbatch_tokens=8 * 32, log_every=1, eval_every=0,
                        checkpoint_every=2, keep_checkpoints=10))
    c.optim.update(dict(warmup_steps=2, total_steps=10))
    c.mesh.num_devices = 8
    return c
