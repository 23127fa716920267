"""Hypothesis strategies shared by the property tests."""

from __future__ import annotations

from hypothesis import strategies as st

from knapformer.layout import BagLayout


@st.composite
def layouts(draw, max_ranks: int = 12) -> BagLayout:
    """Random layouts: 1-3 distinct bag sizes from {1,2,3,4,8}, total ranks <= max_ranks."""
    sizes = draw(st.lists(st.sampled_from([1, 2, 3, 4, 8]), min_size=1, max_size=3, unique=True))
    terms, total = [], 0
    for g in sorted(sizes):
        room = (max_ranks - total) // g
        if room < 1:
            continue
        n = draw(st.integers(1, min(room, 4)))
        terms.append((g, n))
        total += g * n
    if not terms:
        terms = [(1, 1)]
    return BagLayout(tuple(terms))


@st.composite
def seq_lens_for(
    draw, num_ranks: int, max_len: int = 600, max_per_rank: int = 5, huge: bool = False
) -> list[list[int]]:
    """Per-rank lengths: empty ranks, 1-token sequences and long ones all appear; ``huge`` adds
    lengths up to the largest a sequence may have (2^31 - 1)."""
    options = [st.integers(1, 3), st.integers(1, max_len), st.sampled_from([1, 2, 7, 64, 4096])]
    if huge:
        options.append(st.integers(2**20, 2**31 - 1))
    length = st.one_of(*options)
    return [draw(st.lists(length, min_size=0, max_size=max_per_rank)) for _ in range(num_ranks)]


@st.composite
def problems(draw, max_ranks: int = 12, huge: bool = False):
    layout = draw(layouts(max_ranks))
    lens = draw(seq_lens_for(layout.group_size, huge=huge))
    return layout, lens


@st.composite
def realistic_steps(draw, gpus=(16, 32, 64)):
    """One sampled step of a synthetic image + video manifest (``knapformer.data.synthetic``,
    any of its mixes and seeds), tokenized for Flux or Wan and dealt by the token-budget
    sampler at 65,536 tokens per GPU: ``(per-GPU lengths, tokenizer name, cross-attention
    context tokens)``."""
    from knapformer.data.manifest import dealt_steps, manifest_seq_lens
    from knapformer.data.synthetic import MANIFEST_MIXES, synthetic_manifest
    from knapformer.data.tokenizers import tokenizer

    S = draw(st.sampled_from(gpus))
    mix = draw(st.sampled_from(sorted(MANIFEST_MIXES)))
    tok = tokenizer(draw(st.sampled_from(["flux", "wan"])))
    seed = draw(st.integers(0, 10_000))
    m = synthetic_manifest(mix, 48 * S, seed=seed)
    lens, buckets = manifest_seq_lens(m, tok)
    (step,) = dealt_steps(lens, buckets, S, max_tokens=65_536, steps=1, seed=seed)
    return step, tok.name, tok.context_len(m.text_tokens)
