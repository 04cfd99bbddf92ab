#!/usr/bin/env bash
# The life of a bench-preset run on one GPU, as a user runs it: prepare the user's own data, train from command-line
# sources, kill the trainer after a checkpoint, resume with no repeated flags, evaluate, generate, export to Hugging
# Face and load the export with transformers (logits against ours from the checkpoint, fp32 on the GPU).
#   bash benchmarks/h200_lifecycle.sh WORKDIR [OUT_DIR]     (OUT_DIR receives metrics.jsonl and the transformers check)
set -euo pipefail
W=${1:?usage: benchmarks/h200_lifecycle.sh WORKDIR [OUT_DIR]}; OUT=${2:-$W}
rm -rf "$W"; mkdir -p "$W" "$OUT"
python - "$W/docs.jsonl" <<'PY'
import glob, json, sys
with open(sys.argv[1], "w") as f:  # the repository's own sources and docs as the user's corpus
    for path in sorted(glob.glob("**/*.py", recursive=True) + glob.glob("**/*.md", recursive=True)):
        if not path.startswith((".", "runs/")):
            f.write(json.dumps({"text": open(path, errors="replace").read()}) + "\n")
PY
python -m launch.prepare_data "$W/docs.jsonl" --output-prefix "$W/data/web" --holdout-every 20
python -m launch.train --config configs/zaya1_base.py --workdir "$W/run" --config.model.preset=bench \
  --config.data.tokenizer=byte --config.data.sources.web="$W/data/web" \
  --config.data.valid_sources.web="$W/data/web_valid" \
  --config.train.steps=24 --config.train.global_batch_tokens=131072 --config.train.microbatch_tokens=8192 \
  --config.train.log_every=1 --config.train.eval_every=8 --config.train.eval_batches=4 \
  --config.train.checkpoint_every=8 --config.train.keep_checkpoints=2 --config.optim.warmup_steps=4 \
  > "$W/train1.log" 2>&1 &
trainer=$!
until [[ -d $W/run/checkpoints/16 ]] || ! kill -0 $trainer 2>/dev/null; do sleep 1; done
kill -9 $trainer || true; wait $trainer || true
cp "$W/train1.log" "$OUT/"
[[ -d $W/run/checkpoints/16 ]] || { echo "the trainer stopped before its step-16 checkpoint"; tail -5 "$W/train1.log"; exit 1; }
echo "killed the trainer after the step-16 checkpoint; steps saved: $(ls "$W/run/checkpoints" | tr '\n' ' ')"
python -m launch.train --workdir "$W/run" 2>&1 | tr '\r' '\n' | grep -v "step/s" | tail -4
python -m launch.evaluate --workdir "$W/run" --max_batches 4 2>&1 | tail -8
python -m launch.generate --checkpoint "$W/run" --prompt "def main(" --max-new-tokens 32 --dtype bfloat16 2>&1 | tail -3
python -m launch.convert_hf "$W/run" --export "$W/hf" 2>&1 | tail -2
cp "$W/run/metrics.jsonl" "$OUT/"
XLA_PYTHON_CLIENT_PREALLOCATE=false python - "$W/run" "$W/hf" "$OUT/transformers_check.json" <<'PY'
import json, sys, time
import numpy as np, torch, transformers
import jax, jax.numpy as jnp
from flax import nnx
jax.config.update("jax_default_matmul_precision", "highest")  # fp32 products, as torch computes them (no TF32)
from zaya_jax.inference.loading import load_model
run, hf, out = sys.argv[1:]
start = time.perf_counter()
tok = transformers.AutoTokenizer.from_pretrained(hf)
ref_model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).cuda().eval()
load_s = time.perf_counter() - start
ids = tok("def main(argv):\n    return 0", return_tensors="pt").input_ids
with torch.no_grad():
    ref = ref_model(ids.cuda()).logits.float().cpu().numpy()
hf_biases = np.stack([v.float().cpu().numpy() for k, v in ref_model.state_dict().items() if k.endswith("balancing_biases")])
del ref_model; torch.cuda.empty_cache()
model = load_model(run)
graphdef, state = nnx.split(model)
gate = model.model.layers.mlp.gate.balancing_biases
skip_reset = bool(np.any(hf_biases[:, -1] != np.asarray(gate[...])[:, -1]))
experts_equal = bool(np.array_equal(hf_biases[:, :-1], np.asarray(gate[...])[:, :-1]))
gate.set_value(jnp.asarray(hf_biases))  # transformers resets the skip bias on load (spec 5.1): only that excused
graphdef, state = nnx.split(model)
logits = np.asarray(jax.jit(lambda s, i: nnx.merge(graphdef, s)(i))(state, jnp.asarray(ids.numpy(), jnp.int32)))
report = dict(model_class=transformers.AutoConfig.from_pretrained(hf).architectures, transformers=transformers.__version__,
              hf_load_s=round(load_s, 1), expert_biases_equal=experts_equal, skip_bias_reset_by_hf=skip_reset, tokens=int(ids.shape[1]), max_abs_logit_diff=float(np.abs(logits - ref).max()),
              max_abs_logit=float(np.abs(ref).max()))
print(json.dumps(report)); json.dump(report, open(out, "w"), indent=1)
PY
