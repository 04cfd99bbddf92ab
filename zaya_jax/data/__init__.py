"""The data pipeline: Megatron indexed datasets, tokenizers, the built-in corpus, mixtures and the training
iterator.

Typical use by the trainer:

    tok = load_tokenizer("byte")
    corpus = builtin_corpus(tok)                                   # or your own {name: prefix(es)}
    it = train_iterator(corpus.train, {"web": 0.5, "code": 0.5}, seq_len=256, global_batch=16, seed=0,
                        rank=dp_rank, num_ranks=dp_size, state=saved_state_or_None, vocab_size=512)
    for batch in it: ...                                           # dict of numpy arrays, this rank's rows
    checkpoint(data=it.state())                                    # small JSON-able dict
    for name, prefix in corpus.valid.items():
        for batch in eval_batches(PackedSource(name, prefix, 256), global_batch=16): ...
"""

from zaya_jax.data.blend import Blend, block_counts
from zaya_jax.data.corpus import BuiltinCorpus, builtin_corpus
from zaya_jax.data.errors import DataError
from zaya_jax.data.indexed import (IndexedDataset, IndexedDatasetWriter, token_dtype_for_vocab,
                                   write_indexed_dataset)
from zaya_jax.data.loader import TrainIterator, eval_batches, train_iterator
from zaya_jax.data.packing import PackedSource
from zaya_jax.data.prepare import iter_documents, tokenize_to_indexed
from zaya_jax.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

__all__ = ["Blend", "BuiltinCorpus", "ByteTokenizer", "DataError", "HFTokenizer", "IndexedDataset",
           "IndexedDatasetWriter", "PackedSource", "Tokenizer", "TrainIterator", "block_counts", "builtin_corpus",
           "eval_batches", "iter_documents", "load_tokenizer", "token_dtype_for_vocab", "tokenize_to_indexed",
           "train_iterator", "write_indexed_dataset"]
