"""Default run: the tiny model on the built-in corpus (Python's own docs as 'web', its stdlib as 'code'), CPU,
a few minutes on 2 cores. python -m launch.train --config configs/default.py --workdir runs/default"""

from ml_collections import ConfigDict


def get_config() -> ConfigDict:
    # the groups below are typed and checked once by zaya_jax/train/options.py: a key it does not know is refused,
    # one left out takes the default given there
    c = ConfigDict()
    c.seed = 0
    # fp32 and no rematerialisation: the CPU has no fast bf16 and memory to spare at this size
    c.model = ConfigDict(dict(preset="tiny", overrides=ConfigDict(dict(dtype="float32", remat="none"))))
    c.data = ConfigDict(dict(
        tokenizer="byte",  # 'byte' or a tokenizer.json path
        builtin=True,  # use the built-in corpus (no download); else `sources` maps names to indexed prefixes
        sources=ConfigDict(),
        valid_sources=ConfigDict(),
        weights=ConfigDict(dict(web=0.5, code=0.5)),
        seq_len=128,
        reset_at_documents=False,  # Megatron default: attention and positions run across document boundaries
        prefetch=4,
    ))
    c.train = ConfigDict(dict(
        steps=200,
        # tokens per optimizer step = global_batch_tokens; split into microbatches of microbatch_tokens
        global_batch_tokens=16 * 128,
        microbatch_tokens=16 * 128,
        batch_ramp=ConfigDict(dict(start_tokens=0, ramp_tokens=0)),  # tokens seen over which the batch ramps up
        log_every=10,
        eval_every=50,
        eval_batches=4,
        checkpoint_every=50,
        keep_checkpoints=2,
        init_from="",  # a previous phase's run directory: start from its weights (any device count)
        peak_tflops=0.0,  # per-device peak for MFU; 0 = look up the device kind
        ce_chunk_tokens=0,  # > 0: head + cross-entropy in token chunks (no [B, T, V] fp32 logits); 8192 at 262k vocab
        # with several microbatches per step, cast the weights read only in the compute dtype once per step (holds a
        # compute-dtype copy of them, mostly the experts, through the step; zaya_jax/model/compute_view.py); with
        # unrolled layers that copy is also sliced per layer once, and micro-gradients are summed per layer
        cast_weights_once=True,
        # microbatches whose gradients are added to the fp32 sum in one pass (zaya_jax/train/step.py): fewer passes
        # over the sum, for holding this many minus one gradients in the compute dtype
        grads_per_pass=1,
        # on one device with unrolled layers and the Pallas experts: form each pass's expert weight gradients after it,
        # added to the fp32 sum by one kernel per weight (zaya_jax/model/deferred_wgrad.py); ignored elsewhere
        defer_expert_wgrad=True,
        fault="",  # fault injection for drills/tests, e.g. "nan@12,hang@30" (zaya_jax/fault/inject.py)
    ))
    # total_steps 0: the schedule follows train.steps (raising it on a finished run keeps training at a real rate)
    c.optim = ConfigDict(dict(learning_rate=3e-3, schedule="wsd", warmup_steps=20, total_steps=0,
                              decay_fraction=0.3, weight_decay=0.0, clip_norm=1.0))
    c.balancing = ConfigDict(dict(learning_rate=1.0))  # zaya_jax/optim/balancing.py, docs/routing.md
    c.mesh = ConfigDict(dict(data=-1, context=1, num_devices=0))  # num_devices 0 = all
    # zaya_jax/parallel/config.py: ZeRO-1, Newton-Schulz placement, context-parallel attention, gradient bucket
    c.parallel = ConfigDict(dict(zero1=True, muon_placement="whole_matrix", context_attention="allgather",
                                 bucket_bytes=0))
    return c
