"""Synthetic data: data codes, the paper's mixes and per-rank batches.

Main API: :data:`MIXES`, :func:`sample_seq_lens`, :func:`sample_batches`, :func:`parse_codes`
(numpy only); :func:`knapformer.data.batches.make_batch` builds torch tensors (imported on use).
"""

from knapformer.data.codes import (
    MIXES,
    DataCode,
    mix_num_ranks,
    parse_codes,
    resolve_mix,
    sample_batches,
    sample_seq_lens,
)

__all__ = ["MIXES", "DataCode", "mix_num_ranks", "parse_codes", "resolve_mix", "sample_batches", "sample_seq_lens"]
