"""lm-evaluation-harness adapter: our checkpoints behind lm_eval's `LM` interface (needs `pip install lm_eval`).

    lm = ZayaLM.from_checkpoint("runs/default", tokenizer="byte")    # or a Hugging Face directory
    lm_eval.simple_evaluate(model=lm, tasks=[...])
    # importing this module also registers the name "zaya":
    lm_eval.simple_evaluate(model="zaya", model_args="checkpoint=runs/default,tokenizer=byte", tasks=[...])

Scoring runs through the bucketed Scorer, generation through the cached decoder. Context/continuation splits
follow lm_eval's convention: trailing whitespace of the context moves to the continuation, the pair is encoded
whole and the continuation is what follows the context's tokens; an empty context becomes the prefix token
(BOS if the tokenizer has one, else EOS).
"""

from __future__ import annotations

import jax
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from zaya_jax.data.tokenizer import Tokenizer, load_tokenizer
from zaya_jax.inference.decoder import Decoder
from zaya_jax.inference.loading import load_model
from zaya_jax.inference.sampling import Sampling
from zaya_jax.inference.scoring import Scorer
from zaya_jax.inference.text import complete
from zaya_jax.model.zaya import ZayaForCausalLM


@register_model("zaya")
class ZayaLM(LM):
    def __init__(self, model: ZayaForCausalLM, tokenizer: Tokenizer, *, max_length: int = 2048,
                 batch_size: int = 8, max_gen_toks: int = 256, seed: int = 0, kernels: str | None = None):
        """kernels: the scorer's and decoder's implementations (inference/kernels.py; None: the model's own)."""
        super().__init__()
        if tokenizer.vocab_size > model.cfg.vocab_size:
            raise ValueError(f"tokenizer has {tokenizer.vocab_size} ids, the model only {model.cfg.vocab_size}")
        self.tokenizer = tokenizer
        self.max_length, self.batch_size, self.max_gen_toks = max_length, batch_size, max_gen_toks
        self.pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else (model.cfg.pad_token_id or 0)
        prefix = tokenizer.bos_id if tokenizer.bos_id is not None else tokenizer.eos_id
        if prefix is None:
            raise ValueError("the tokenizer has neither a BOS nor an EOS token to start a context with")
        self.prefix_token = prefix
        self.scorer = Scorer(model, max_length=max_length, batch_size=batch_size, pad_id=self.pad_id,
                             kernels=kernels)
        self._model, self._kernels, self._decoder = model, kernels, None
        self._key = jax.random.key(seed)

    @property
    def decoder(self) -> Decoder:
        """Built on the first generation request, over the scorer's copy of the weights."""
        if self._decoder is None:
            self._decoder = Decoder(self._model, kernels=self._kernels, state=self.scorer.state)
        return self._decoder

    @classmethod
    def from_checkpoint(cls, checkpoint: str, *, tokenizer: str | None = None, dtype: str = "float32",
                        step: int | None = None, kernels: str = "auto", **kwargs) -> ZayaLM:
        """tokenizer: 'byte', a tokenizer.json or a folder holding one; default: the checkpoint folder when it is a
        Hugging Face directory, else the one the run recorded (DIR/run.json). kernels: 'auto' (the platform's fast
        kernels), 'xla' or 'gpu' (inference/kernels.py)."""
        if tokenizer is None:
            from zaya_jax.train.run_record import default_tokenizer
            tokenizer = default_tokenizer(checkpoint)
        return cls(load_model(checkpoint, dtype=dtype, step=step), load_tokenizer(tokenizer), kernels=kernels,
                   **kwargs)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> ZayaLM:
        """lm_eval's model_args: checkpoint=PATH[,tokenizer=...][,dtype=...][,step=N][,max_length=N][,batch_size=N]
        [,max_gen_toks=N][,seed=N][,kernels=auto|xla|gpu]."""
        from lm_eval.utils import simple_parse_args_string

        args = simple_parse_args_string(arg_string)
        for key, value in (additional_config or {}).items():
            if key == "batch_size" and value is not None:
                args.setdefault(key, value)
        if "checkpoint" not in args:
            raise ValueError("model_args needs checkpoint=PATH")
        ints = ("step", "max_length", "batch_size", "max_gen_toks", "seed")
        kwargs = {k: (int(v) if k in ints else v) for k, v in args.items() if k != "checkpoint"}
        return cls.from_checkpoint(args["checkpoint"], **kwargs)

    # ---- tokens -------------------------------------------------------------------------------------------------
    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).tolist()

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        if not context:
            return [self.prefix_token], self._encode(continuation)
        stripped = context.rstrip()
        continuation = context[len(stripped):] + continuation
        whole = self._encode(stripped + continuation)
        context_ids = self._encode(stripped)
        return context_ids, whole[len(context_ids):]

    # ---- the LM interface ---------------------------------------------------------------------------------------
    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        return self.scorer.loglikelihood([self._encode_pair(*r.args) for r in requests])

    def loglikelihood_rolling(self, requests) -> list[float]:
        return self.scorer.loglikelihood_rolling([self._encode(r.args[0]) for r in requests], self.prefix_token)

    def generate_until(self, requests) -> list[str]:
        groups: dict[tuple, list[int]] = {}
        settings = [self._generation_settings(r.args[1]) for r in requests]
        for i, (sampling, max_new, _) in enumerate(settings):
            groups.setdefault((sampling, max_new), []).append(i)
        out = [""] * len(requests)
        for (sampling, max_new), members in groups.items():
            budget = max(1, self.max_length - max_new)
            for start in range(0, len(members), self.batch_size):
                batch = members[start:start + self.batch_size]
                self._key, key = jax.random.split(self._key)
                texts = complete(self.decoder, self.tokenizer, [requests[i].args[0] for i in batch],
                                 max_new_tokens=max_new, sampling=sampling, key=key, max_prompt_tokens=budget,
                                 batch_rows=self.batch_size)
                for i, text in zip(batch, texts):
                    out[i] = cut_at_stop(text, settings[i][2])
        return out

    def _generation_settings(self, gen_kwargs: dict) -> tuple[Sampling, int, list[str]]:
        kw = dict(gen_kwargs or {})
        until = kw.pop("until", None) or []
        until = [until] if isinstance(until, str) else list(until)
        max_new = int(kw.pop("max_gen_toks", self.max_gen_toks))
        do_sample = bool(kw.pop("do_sample", False))
        temperature = float(kw.pop("temperature", 1.0 if do_sample else 0.0))
        if not do_sample:
            temperature = 0.0
        sampling = Sampling(temperature=temperature, top_k=int(kw.pop("top_k", 0) or 0),
                            top_p=float(kw.pop("top_p", 1.0) or 1.0))
        return sampling, max_new, until


def cut_at_stop(text: str, stops: list[str]) -> str:
    """text up to the earliest occurrence of any stop string."""
    end = len(text)
    for s in stops:
        if s:
            at = text.find(s)
            if at != -1:
                end = min(end, at)
    return text[:end]
