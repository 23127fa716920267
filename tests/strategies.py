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
def seq_lens_for(draw, num_ranks: int, max_len: int = 600, max_per_rank: int = 5) -> list[list[int]]:
    """Per-rank lengths: empty ranks, 1-token sequences and long ones all appear."""
    length = st.one_of(st.integers(1, 3), st.integers(1, max_len), st.sampled_from([1, 2, 7, 64, 4096]))
    return [draw(st.lists(length, min_size=0, max_size=max_per_rank)) for _ in range(num_ranks)]


@st.composite
def problems(draw, max_ranks: int = 12):
    layout = draw(layouts(max_ranks))
    lens = draw(seq_lens_for(layout.group_size))
    return layout, lens
