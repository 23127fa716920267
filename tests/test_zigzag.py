"""Zigzag cuts of ring groups: every sub-group of a causal ring does the same work.

A ring group of k = u·r members cuts each sequence into 2r half-blocks and gives sub-group s
half-blocks s and 2r − 1 − s. Under causal masking a query at position p sees p + 1 keys, so a
sub-group's work is Σ (p + 1) over its positions: equal for every s up to the rounding of the
half-blocks (a contiguous cut gives the last sub-group (2r − 1)/r of the mean). The plans
validate, hold at most two chunks per member, and the planner prices the members evenly.
"""

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from knapformer import WorkloadModel
from knapformer.errors import InvalidPlanError
from knapformer.plan import plan_from_groups
from knapformer.plan.chunks import zigzag_slots
from knapformer.plan.plan import chunk_table
from knapformer.plan.seqindex import DST, LEN, START

MODEL = WorkloadModel(d_model=64, causal=True)


def sub_group_work(plan, members, r: int) -> np.ndarray:
    """(r,) Σ over each sub-group's positions of the keys a causal query there sees (p + 1)."""
    u = len(members) // r
    sub = {m: i // u for i, m in enumerate(members)}
    work = np.zeros(r)
    for row in plan.chunks:
        a, n = int(row[START]), int(row[LEN])
        work[sub[int(row[DST])]] += n * (2 * a + n + 1) / 2  # Σ_{p=a}^{a+n-1} (p + 1)
    return work


@st.composite
def rings(draw):
    r = draw(st.integers(2, 8))
    u = draw(st.integers(1, 4))
    k = r * u
    L = draw(st.integers(2 * k, 6000))
    return k, r, L


@given(rings())
def test_zigzag_ring_work_is_even_and_chunks_are_two_per_member(case):
    k, r, L = case
    members = tuple(range(k))
    lens = [[L]] + [[] for _ in range(k - 1)]
    plan = plan_from_groups(lens, [members], [0], MODEL, ring=[r])
    plan.validate()
    per_member = np.bincount(plan.chunks[:, DST], minlength=k)
    assert per_member.max() <= 2
    tokens = np.bincount(plan.chunks[:, DST], weights=plan.chunks[:, LEN], minlength=k)
    assert tokens.max() - tokens.min() <= 2
    work = sub_group_work(plan, members, r)
    # rounding: a sub-group holds at most 2 tokens more than another, each seeing ≤ L keys
    assert work.max() / work.mean() - 1 <= 4 * r / L + 1e-12, (work, L)
    contiguous = sub_group_work(replace(plan, chunks=chunk_table(plan.index, plan.groups, plan.seq_group)), members, r)
    if L >= 100 * k:  # the cut it replaces: the last sub-group does (2r − 1)/r of the mean
        assert contiguous.max() / contiguous.mean() == pytest.approx((2 * r - 1) / r, rel=0.05)


def test_zigzag_slots_give_sub_group_s_half_blocks_s_and_the_mirror():
    # 2 sub-groups of 2: half-blocks 0, 1 | 2, 3 -> sub-groups 0, 1, 1, 0
    assert zigzag_slots(4, 2).tolist() == [0, 1, 2, 3, 2, 3, 0, 1]
    assert zigzag_slots(3, 3).tolist() == [0, 1, 2, 2, 1, 0]


def test_causal_ring_members_are_priced_evenly():
    """The plan's predicted time of every member of a causal ring group is the same (the
    contiguous cut charged the last sub-group (2r − 1)/r of the attention)."""
    lens = [[4096]] + [[] for _ in range(7)]
    plan = plan_from_groups(lens, [tuple(range(8))], [0], MODEL, ring=[4])
    t = plan.time_after
    assert t.max() / t.min() - 1 < 1e-3, t


def test_a_ring_plan_with_scrambled_chunks_is_refused():
    lens = [[64]] + [[] for _ in range(3)]
    plan = plan_from_groups(lens, [(0, 1, 2, 3)], [0], MODEL, ring=[2])
    chunks = plan.chunks.copy()
    chunks[[0, 1], DST] = chunks[[1, 0], DST]  # two members swap their first chunks
    bad = replace(plan, chunks=chunks)
    with pytest.raises(InvalidPlanError, match="zigzag order"):
        bad.validate()


@pytest.mark.parametrize(("k", "r", "L"), [(2, 2, 1001), (4, 4, 4096), (8, 4, 777), (6, 3, 5000), (8, 8, 129)])
def test_the_ring_computes_even_causal_work_on_every_member(k, r, L):
    """What the ring executes (its block pairs, :func:`~knapformer.distributed.ring.pair_work`)
    per member of a causal ring: even under the zigzag cut, (2r − 1)/r of the mean for the
    last sub-group of a contiguous cut; and exactly the causal pairs of the sequence in total."""
    from knapformer.distributed.ring import pair_work
    from knapformer.distributed.spec import build_route_spec

    lens = [[L]] + [[] for _ in range(k - 1)]
    plan = plan_from_groups(lens, [tuple(range(k))], [0], MODEL, ring=[r])
    flat = replace(plan, chunks=chunk_table(plan.index, plan.groups, plan.seq_group))
    u = k // r
    for p, even in ((plan, True), (flat, False)):
        work = np.array([pair_work(build_route_spec(p, m).entries[0], causal=True) for m in range(k)], dtype=float)
        assert work.sum() == u * L * (L + 1) / 2  # every causal pair once per sub-group member (its heads)
        spread = work.max() / work.mean() - 1
        if even:
            assert spread <= 4 * r / L, work
        elif L >= 100 * k:
            assert spread == pytest.approx((2 * r - 1) / r - 1, rel=0.05), work
