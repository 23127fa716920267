"""Synthetic data: data codes, the paper's mixes and per-rank batches (numpy only).

Main API: :data:`MIXES`, :func:`sample_seq_lens`, :func:`sample_batches`, :func:`parse_codes`.
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
