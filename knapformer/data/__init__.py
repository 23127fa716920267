"""Data: the paper's mixes and synthetic batches from data codes, a token-budget batch sampler
with a packed collate for real datasets, and dataset manifests turned into sequence lengths.

Main API: :data:`MIXES`, :func:`sample_seq_lens`, :func:`sample_batches`, :func:`parse_codes`,
:class:`TokenBudgetBatchSampler`, :func:`read_manifest`, :data:`TOKENIZERS`,
:func:`synthetic_manifest`, :class:`ShardedManifest` and :class:`ParquetShards` (datasets in
Parquet shards: :mod:`knapformer.data.shards`) (numpy only; Parquet needs pyarrow); :class:`PackedCollate` and
:func:`knapformer.data.batches.make_batch` build torch tensors (imported on use), and so does
:class:`PlannedSteps` (each step with its plan, made ahead in a DataLoader worker).
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
from knapformer.data.manifest import Manifest, dealt_steps, manifest_seq_lens, read_manifest, write_manifest
from knapformer.data.sampler import TokenBudgetBatchSampler, pack_batches
from knapformer.data.shards import ParquetShards, ShardedManifest, write_sharded_manifest, write_shards
from knapformer.data.synthetic import MANIFEST_MIXES, synthetic_manifest
from knapformer.data.tokenizers import TOKENIZERS, Tokenizer, tokenizer, tokenizer_for_model

if TYPE_CHECKING:  # for type checkers and the API reference; needs torch, imported on use
    from knapformer.data.ahead import PlannedStep, PlannedSteps, with_next
    from knapformer.data.collate import PackedCollate

__all__ = [
    "MANIFEST_MIXES",
    "MIXES",
    "TOKENIZERS",
    "DataCode",
    "Manifest",
    "PackedCollate",
    "PlannedStep",
    "PlannedSteps",
    "ParquetShards",
    "ShardedManifest",
    "TokenBudgetBatchSampler",
    "Tokenizer",
    "dealt_steps",
    "manifest_seq_lens",
    "mix_num_ranks",
    "pack_batches",
    "parse_codes",
    "read_manifest",
    "resolve_mix",
    "sample_batches",
    "sample_seq_lens",
    "synthetic_manifest",
    "tokenizer",
    "tokenizer_for_model",
    "write_manifest",
    "write_sharded_manifest",
    "with_next",
    "write_shards",
]


def __getattr__(name: str):
    if name == "PackedCollate":  # needs torch; the rest of this package does not
        from knapformer.data.collate import PackedCollate

        return PackedCollate
    if name in ("PlannedStep", "PlannedSteps", "with_next"):  # (torch's DataLoader types)
        from knapformer.data import ahead

        return getattr(ahead, name)
    raise AttributeError(f"module 'knapformer.data' has no attribute {name!r}")
