"""Tiny HF ZAYA configs for live parity and the inputs every one of them runs.

Across the set, every HF field that changes the math takes a non-default value: GQA group sizes 4, 2 and 1;
cca_time0/cca_time1 = 3/1, 1/3 and 2/2; partial_rotary_factor 0.25, 1.0, 0.5; rope_theta per layer type;
rms_norm_eps 1e-6; attention_bias; lm_head_bias with untied and with tied weights; hidden_act gelu and
gelu_pytorch_tanh; 'hybrid_sliding' layers mixed with full ones and all-sliding; the skip class selected for some
tokens. Our side runs both expert implementations (ragged, dense) and two remat policies (full, save_dots).
"""

from __future__ import annotations

import dataclasses

import numpy as np

PAD = 0  # pad_token_id; real positions never hold token 0 (HF blocks row 0's lookup gradient, we do not)
_TOKENS = dict(pad_token_id=PAD, bos_token_id=2, eos_token_id=1)


def _rope(full_theta, sliding_theta, partial):
    return {"hybrid": {"rope_type": "default", "rope_theta": full_theta, "partial_rotary_factor": partial},
            "hybrid_sliding": {"rope_type": "default", "rope_theta": sliding_theta, "partial_rotary_factor": partial}}


@dataclasses.dataclass(frozen=True)
class ParityConfig:
    name: str
    hf: dict  # HF config.json fields
    ours: dict  # our ModelConfig overrides for this config (moe_impl, scan_layers, remat)
    skip_layers: tuple[int, ...] = ()  # layers whose skip bias is placed so the skip class wins for some tokens


PARITY_CONFIGS = [
    ParityConfig(
        "gqa4_conv31_rope025",
        dict(vocab_size=128, hidden_size=64, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
             head_dim=16, moe_intermediate_size=48, num_experts=4, router_hidden_size=16, cca_time0=3, cca_time1=1,
             rope_parameters=_rope(50_000.0, 10_000.0, 0.25), rms_norm_eps=1e-6, hidden_act="silu",
             tie_word_embeddings=True, **_TOKENS),
        ours=dict(moe_impl="ragged"), skip_layers=(1,)),
    ParityConfig(
        "gqa2_sliding_mix_untied_bias_gelu",
        dict(vocab_size=64, hidden_size=48, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             head_dim=8, moe_intermediate_size=40, num_experts=3, router_hidden_size=12, cca_time0=1, cca_time1=3,
             rope_parameters=_rope(1_000_000.0, 3_000.0, 1.0), rms_norm_eps=1e-6, hidden_act="gelu",
             attention_bias=True, tie_word_embeddings=False, lm_head_bias=True,
             layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding"], sliding_window=4, **_TOKENS),
        ours=dict(moe_impl="dense"), skip_layers=(2,)),
    ParityConfig(
        "mha_all_sliding_tied_head_bias_tanh_gelu",
        dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
             head_dim=16, moe_intermediate_size=32, num_experts=5, router_hidden_size=8, cca_time0=2, cca_time1=2,
             rope_parameters=_rope(10_000.0, 20_000.0, 0.5), rms_norm_eps=1e-5, hidden_act="gelu_pytorch_tanh",
             tie_word_embeddings=True, lm_head_bias=True, layer_types=["hybrid_sliding", "hybrid_sliding"],
             sliding_window=5,
             **_TOKENS),
        ours=dict(moe_impl="ragged", remat="save_dots"), skip_layers=(0,)),
]

SEQ_LEN = 11
LEFT_PADS = (4, 1)  # pads at the start of each row in the padded case


def make_cases(vocab_size: int, seed: int) -> list[dict]:
    """'unpadded' (no attention_mask) and 'left_padded' (mask, pads = token 0, labels -100 at pads and at the
    first real token of each row)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, vocab_size, size=(len(LEFT_PADS), SEQ_LEN))
    padded = ids.copy()
    mask = np.ones_like(ids)
    for row, n in enumerate(LEFT_PADS):
        padded[row, :n] = PAD
        mask[row, :n] = 0
    labels = np.where(mask > 0, padded, -100)
    for row, n in enumerate(LEFT_PADS):
        # The first real token would be predicted from the last pad position, whose attention row is fully
        # masked: a degenerate uniform average on both sides, but HF's additive mask lets gradient through the
        # masked scores while our select does not. Real training never predicts from padding; leave it out.
        labels[row, n] = -100
    return [
        {"name": "unpadded", "input_ids": ids.tolist(), "attention_mask": None, "labels": ids.tolist()},
        {"name": "left_padded", "input_ids": padded.tolist(), "attention_mask": mask.tolist(),
         "labels": labels.tolist()},
    ]
