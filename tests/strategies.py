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
