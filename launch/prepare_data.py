"""python -m launch.prepare_data INPUT [INPUT ...] --output-prefix OUT [--tokenizer byte|tokenizer.json]

Tokenizes text, JSONL or parquet files into a Megatron indexed dataset OUT.bin / OUT.idx (one document per
text file, JSONL line or parquet row; --split-lines makes every non-empty text line a document), ending each
document with eos. --holdout-every N sends every N-th document to OUT_valid.bin/.idx instead.
    python -m launch.prepare_data --builtin   builds the built-in corpus (Python's docs + stdlib) in the cache
"""

import argparse
import os
import sys

from zaya_jax.data import DataError, builtin_corpus, iter_documents, load_tokenizer, tokenize_to_indexed
from zaya_jax.data.indexed import bin_path, idx_path
from zaya_jax.data.prepare import FORMATS, check_input, check_not_inputs

from launch._cli import ArgumentParser, user_errors


@user_errors("launch.prepare_data")
def main(argv=None):
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("inputs", nargs="*", help="text / .jsonl / .parquet files (.gz allowed for text and JSONL)")
    ap.add_argument("--output-prefix", help="writes OUTPUT_PREFIX.bin and OUTPUT_PREFIX.idx")
    ap.add_argument("--tokenizer", default="byte", help="'byte', a tokenizer.json, or a folder holding one")
    ap.add_argument("--format", default="auto", choices=FORMATS, help="input format (auto: by file extension)")
    ap.add_argument("--text-key", default="text", help="JSONL field / parquet column holding the text")
    ap.add_argument("--split-lines", action="store_true", help="text inputs: one document per non-empty line")
    ap.add_argument("--dtype", default=None, choices=["uint16", "int32", "uint32", "int64"],
                    help="token dtype (default: uint16 below 65500 ids, else int32; uint32 is not Megatron-readable)")
    ap.add_argument("--no-eos", action="store_true", help="do not end documents with the eos token")
    ap.add_argument("--eos-token", default=None, help="name of the eos token in a tokenizer.json vocabulary")
    ap.add_argument("--holdout-every", type=int, default=0, help="every N-th document goes to OUTPUT_PREFIX_valid")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing OUTPUT_PREFIX dataset")
    ap.add_argument("--builtin", action="store_true", help="build the built-in corpus in the cache and exit")
    ap.add_argument("--cache-dir", default=None, help="--builtin: cache folder (default $ZAYA_DATA_CACHE or ~/.cache)")
    args = ap.parse_args(argv)

    special = {"eos_token": args.eos_token} if args.eos_token else {}
    try:
        tokenizer = load_tokenizer(args.tokenizer, **special)
        if args.builtin:
            corpus = builtin_corpus(tokenizer, args.cache_dir)
            print(f"built-in corpus in {corpus.directory}")
            return 0
        if not args.inputs or not args.output_prefix:
            ap.error("give INPUT files and --output-prefix (or --builtin)")
        valid = f"{args.output_prefix}_valid" if args.holdout_every > 0 else None
        outputs = [f(p) for p in filter(None, (args.output_prefix, valid)) for f in (bin_path, idx_path)]
        check_not_inputs(args.inputs, outputs)
        for path in args.inputs:
            check_input(path)
        existing = [p for p in outputs if os.path.exists(p)]
        if existing and not args.overwrite:  # a run training on them would resume on other data
            raise DataError(f"{', '.join(existing)} already exist{'s' if len(existing) == 1 else ''}: pass "
                            "--overwrite to replace them")
        replaced = {}
        documents = iter_documents(args.inputs, args.format, text_key=args.text_key, split_lines=args.split_lines,
                                   replaced=replaced)
        stats = tokenize_to_indexed(documents, tokenizer, args.output_prefix, dtype=args.dtype,
                                    append_eos=not args.no_eos, valid_prefix=valid, holdout_every=args.holdout_every)
    except DataError as e:
        print(f"prepare_data: {e}", file=sys.stderr)
        return 1
    for path, n in replaced.items():
        print(f"prepare_data: {path}: replaced {n} bytes of invalid UTF-8 with U+FFFD", file=sys.stderr)
    rate = stats.tokens / max(stats.seconds, 1e-9)
    print(f"{args.output_prefix}: {stats.documents} documents, {stats.tokens} tokens ({rate:,.0f} tokens/s)")
    if valid:
        print(f"{valid}: {stats.valid_documents} documents, {stats.valid_tokens} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
