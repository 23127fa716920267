"""Data: the paper's mixes and synthetic batches from data codes, and a token-budget batch
sampler with a packed collate for real datasets.

Main API: :data:`MIXES`, :func:`sample_seq_lens`, :func:`sample_batches`, :func:`parse_codes`,
:class:`TokenBudgetBatchSampler` (numpy only); :class:`PackedCollate` and
:func:`knapformer.data.batches.make_batch` build torch tensors (imported on use).
"""

from typing import TYPE_CHECKING

from knapformer.data.codes import (
    MIXES,
    DataCode,
    mix_num_ranks,
    parse_codes,
    resolve_mix,
    sample_batches,
    sample_seq_lens,
)
from knapformer.data.sampler import TokenBudgetBatchSampler, pack_batches

if TYPE_CHECKING:  # for type checkers and the API reference; needs torch, imported on use
    from knapformer.data.collate import PackedCollate

__all__ = [
    "MIXES",
    "DataCode",
    "PackedCollate",
    "TokenBudgetBatchSampler",
    "mix_num_ranks",
    "pack_batches",
    "parse_codes",
    "resolve_mix",
    "sample_batches",
    "sample_seq_lens",
]


def __getattr__(name: str):
    if name == "PackedCollate":  # needs torch; the rest of this package does not
        from knapformer.data.collate import PackedCollate

        return PackedCollate
    raise AttributeError(f"module 'knapformer.data' has no attribute {name!r}")
