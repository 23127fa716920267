"""Ulysses attention inside groups: the exchange layout, the pre/post exchanges, and the flat
form for custom kernels.

Main API: :func:`pre_attn_batches` / :func:`post_attn_batches` (around a layer's attention),
:func:`ulysses_layout` (derived once per plan and head configuration), :func:`check_heads`,
:func:`flatten_pairs` / :func:`unflatten_pairs` / :func:`output_shape` (``pre_attn``'s one-call
form).
"""

from knapformer.distributed.ulysses.exchange import (
    AttnBatch,
    UlyssesCall,
    check_heads,
    post_attn_batches,
    pre_attn_batches,
)
from knapformer.distributed.ulysses.layout import UlyssesLayout, heads_error, member_heads, ulysses_layout
from knapformer.distributed.ulysses.pairs import flatten_pairs, output_shape, unflatten_pairs

__all__ = [
    "AttnBatch",
    "UlyssesCall",
    "UlyssesLayout",
    "check_heads",
    "flatten_pairs",
    "heads_error",
    "member_heads",
    "output_shape",
    "post_attn_batches",
    "pre_attn_batches",
    "ulysses_layout",
    "unflatten_pairs",
]
