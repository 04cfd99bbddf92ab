"""Training agrees with the reference: 30 AdamW steps of our jitted train step (make_train_step + optax.adamw)
track transformers' ZayaForCausalLM trained in PyTorch (fp32, eager attention) from the same weights on the same
batches: loss within 1e-3 relative at every step.

Setup
  weights  a tiny config with non-default values in every field that changes the math (GQA 2, CCA kernels 3/1,
           partial RoPE with per-type theta, a sliding layer, attention and head biases, tied head, tanh-GELU
           experts, rms_norm_eps 1e-6), every leaf random (random_model; qk_norm.temp U(0.5, 1.5), so attention
           is live), exported with zaya_jax.to_hf. HF loads that directory with from_pretrained and we load it
           back with from_hf: both sides start from the same file.
  biases   fixed on both sides (HF has no controller): BalancerConfig(learning_rate=0). With lr 0 the controller
           still re-centres the expert biases (b - mean(b)) and writes its skip_bias into the last class every
           step, so non-zero-mean or per-layer skip biases would move at step 1. We give every layer expert
           biases k/1024 summing to exactly 0 (every partial sum is exact, so mean == 0.0 and b - 0.0 == b) and
           the common skip bias SKIP_BIAS = BalancerConfig.skip_bias, placed so the skip class is live (~39% of
           the tokens in layer 1, ~1% in layer 2, none in layer 0; HF resets the skip bias to -1 on load, so
           the reference job sets the biases after loading).
           Both sides' biases are checked bitwise after 30 steps.
  data     a cycling set of 3 fixed random batches [2, 17], ids in [1, V) (token 0 is HF's padding_idx, whose
           lookup gradient HF blocks), so the model fits them and the loss falls 5.46 -> 1.51. HF gets ids with
           labels=ids (its own shifted loss); we get inputs=ids[:, :-1], targets=ids[:, 1:], every target counted.
  optim    torch.optim.AdamW vs optax.adamw: lr 3e-3 constant, betas (0.9, 0.95), eps 1e-8, weight decay 0.1 on
           ALL parameters on both sides (torch's decoupled p *= 1 - lr*wd equals optax's add_decayed_weights
           before the -lr scale; balancing biases are a buffer / model state, outside both optimizers), no
           clipping.
Checks: per-step loss relative error <= 1e-3; the same tokens per router class (expert shares and skip share) in
every layer at every step, so the losses are compared on the same routing; every parameter tensor after 30 steps
within 1e-3 norm-relative of HF's.
Measured (CPU): loss rel diff 9e-8 at step 0 growing to <= 5e-6 by step 29; final parameters <= 4e-5.
Routing margins are comfortable: the smallest top-1 vs top-2 biased-score gap over the run is 6.8e-5 (step
18), while a one-off probe of both sides' router probabilities at every step found them at most 2.9e-5 apart
(2e-7 at step 0, growing as the weights drift apart by rounding), at least 24x below the margin at every step.
The test can fail: decaying only the >= 2-D parameters on our side moves the losses by 8e-2 and the final
parameters by 2.5e-2.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zaya_jax
from hf_reference.client import requires_reference, results, run_reference
from hf_reference.jax_side import norm_rel, random_model
from zaya_jax.checkpoint.hf import hf_named_arrays
from zaya_jax.config import RopeConfig, tiny
from zaya_jax.model.base import BalancingBias
from zaya_jax.optim.balancing import BalancerConfig, init_balancer
from zaya_jax.train.step import get_biases, make_train_step

pytestmark = [pytest.mark.hf, requires_reference]

CFG = tiny(vocab_size=128, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
           head_dim=16, moe_intermediate_size=48, num_experts=4, router_hidden_size=16, cca_time0=3, cca_time1=1,
           rope={"hybrid": RopeConfig(50_000.0, 0.5), "hybrid_sliding": RopeConfig(3_000.0, 0.5)},
           layer_types=("hybrid", "hybrid_sliding", "hybrid"), sliding_window=6, rms_norm_eps=1e-6,
           attention_bias=True, lm_head_bias=True, hidden_act="gelu_pytorch_tanh", dtype="float32")
STEPS, BATCHES, ROWS, SEQ = 30, 3, 2, 16
ADAMW = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
SKIP_BIAS = -0.05
LOSS_TOL = 1e-3
SEED = 0


def fixed_biases(rng) -> np.ndarray:
    """[L, E+1]: expert biases k/1024 in +-40/1024 summing to exactly zero (pairs +-k), then SKIP_BIAS."""
    L, E = CFG.num_hidden_layers, CFG.num_experts
    assert E % 2 == 0
    out = np.full((L, E + 1), SKIP_BIAS, np.float32)
    for l in range(L):
        k = rng.integers(1, 41, E // 2)
        out[l, :E] = rng.permutation(np.concatenate([k, -k])) / 1024.0
    return out


def optax_adamw():
    return optax.adamw(ADAMW["lr"], b1=ADAMW["betas"][0], b2=ADAMW["betas"][1], eps=ADAMW["eps"],
                       weight_decay=ADAMW["weight_decay"])  # mask=None: decay on every parameter, like torch


def our_training(model_dir, batches):
    """Our real train step (make_train_step, optax.adamw) from the exported weights: per-step losses, expert
    shares [STEPS, L, E] (from the forward's routing statistics at the step's parameters) and largest skip share, the
    final state."""
    model = zaya_jax.from_hf(model_dir, dtype=jnp.float32, moe_impl="ragged")
    graphdef, params, model_state = nnx.split(model, nnx.Param, BalancingBias)
    tx = optax_adamw()
    params = nnx.to_pure_dict(params)
    state = {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": tx.init(params),
             "model_state": nnx.to_pure_dict(model_state),
             "balancer": init_balancer(CFG.num_hidden_layers, CFG.num_experts)}
    step_fn = jax.jit(make_train_step(graphdef, tx, BalancerConfig(learning_rate=0.0, skip_bias=SKIP_BIAS)))
    counts_of = jax.jit(lambda p, m, ids: nnx.merge(graphdef, p, m).forward(ids)[1].expert_counts)
    losses, fractions, skip = [], [], []
    for step in range(STEPS):
        ids = batches[step % len(batches)]
        batch = {"inputs": ids[:, :-1], "targets": ids[:, 1:], "loss_mask": np.ones((ROWS, SEQ), np.float32),
                 "source_ids": np.zeros((ROWS,), np.int32)}
        counts = np.asarray(counts_of(state["params"], state["model_state"], jnp.asarray(batch["inputs"])))
        state, metrics = step_fn(state, jax.tree.map(jnp.asarray, batch))
        losses.append(float(metrics["loss"]))
        skip.append(float(np.max(metrics["routing/skip_fraction"])))  # largest share any layer sent to the skip class
        experts = counts[:, :-1]  # expert share of this step's tokens (skip class excluded)
        fractions.append(experts / np.maximum(experts.sum(-1, keepdims=True), 1))
    return {"losses": np.asarray(losses), "fractions": np.stack(fractions), "skip": np.asarray(skip),
            "state": state, "graphdef": graphdef}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_train")
    rng = np.random.default_rng(SEED)
    model = random_model(CFG, SEED)
    biases = fixed_biases(rng)
    model.model.layers.mlp.gate.balancing_biases.set_value(jnp.asarray(biases))
    model_dir = zaya_jax.to_hf(model, root / "model")
    batches = [rng.integers(1, CFG.vocab_size, (ROWS, SEQ + 1)) for _ in range(BATCHES)]
    job = {"mode": "train", "model_dir": str(model_dir), "out_dir": str(root / "ref"), "steps": STEPS,
           "batches": [b.tolist() for b in batches], "adamw": ADAMW, "balancing_biases": biases.tolist()}
    # The reference process spends most of its time importing torch and transformers: train our side meanwhile.
    with ThreadPoolExecutor(1) as pool:
        reference = pool.submit(run_reference, [job], root)
        ours = our_training(model_dir, batches)
        reference.result()
    ref, report = results(root / "ref")
    return biases, ref, report, ours


def test_losses_track_hf_training(run):
    biases, ref, report, ours = run
    losses, ref_losses, counts, margins = ours["losses"], ref["losses"], ref["counts"], ref["margins"]
    rel = np.abs(losses - ref_losses) / np.abs(ref_losses)
    print("\nstep  ours        HF          rel-diff   min routing margin")
    for s in range(STEPS):
        print(f"{s:4d}  {losses[s]:.7f}  {ref_losses[s]:.7f}  {rel[s]:.2e}   {margins[s].min():.2e}")
    skip_share = counts[..., -1] / counts.sum(-1)  # [STEPS, L]
    print(f"max rel loss diff {rel.max():.2e} (step {rel.argmax()}); loss {ref_losses[0]:.3f} -> "
          f"{ref_losses[-1]:.3f}; smallest routing margin {margins.min():.2e} (step {margins.min(1).argmin()}); "
          f"skip share per layer {np.round(skip_share.mean(0), 2).tolist()}")

    # the biases really stayed fixed on both sides
    np.testing.assert_array_equal(np.asarray(report["biases_after"], np.float32), biases)
    np.testing.assert_array_equal(np.asarray(get_biases(ours["state"]["model_state"])), biases)
    # the same routing at every step: expert shares (skip excluded) and the largest skip share equal HF's counts
    experts = counts[..., :-1].astype(np.float64)
    ref_fractions = experts / np.maximum(experts.sum(-1, keepdims=True), 1)
    np.testing.assert_allclose(ours["fractions"], ref_fractions, atol=1e-6, err_msg="expert routing differs")
    np.testing.assert_allclose(ours["skip"], skip_share.max(1), atol=1e-6, err_msg="skip routing differs")
    assert skip_share.max() > 0, "the skip class was never selected: pick a higher SKIP_BIAS"
    assert ref_losses[-1] < 0.5 * ref_losses[0], "the reference barely trained: the comparison would be weak"
    assert rel.max() <= LOSS_TOL, f"losses diverge: max rel {rel.max():.3e} at step {rel.argmax()}"


def test_final_parameters_match_hf(run):
    _, ref, _, ours = run
    state = ours["state"]
    _, params, _ = nnx.split(nnx.merge(ours["graphdef"], state["params"], state["model_state"]), nnx.Param, ...)
    ours = hf_named_arrays(params)
    theirs = {k.split("::", 1)[1]: v for k, v in ref.items() if k.startswith("final::")}
    assert set(ours) == set(theirs)
    errs = {k: norm_rel(ours[k], theirs[k]) for k in theirs}
    worst = max(errs, key=errs.get)
    print(f"\nfinal parameters: worst norm-rel {errs[worst]:.2e} ({worst}) over {len(errs)} tensors")
    assert errs[worst] <= 1e-3, f"final parameters differ: {worst} {errs[worst]:.3e}"
