"""Ring attention (a group of k = u·r ranks: Ulysses over u inside each of r sub-groups, K/V
blocks around the ring): outputs, input and weight gradients equal one process (fp64) on 2, 3
and 4 gloo ranks — pure rings (h = 1), rings of Ulysses sub-groups, GQA/MQA with k ∤ h_kv,
lengths not multiples of k, 1-token and (k−1)-token sequences (empty blocks), ring groups next
to Ulysses-only and one-rank groups on the same ranks, causal and not. Bad ring plans raise on
every rank."""

import pytest

from knapformer.testing import run_distributed
from tests import ring_workers as W

CONFIGS = {
    2: [(1, 1, (1, 2)), (2, 2, (1, 2))],
    3: [(1, 1, (1, 2, 3)), (2, 2, (1, 2, 3)), (4, 2, (1, 3))],  # 3 ∤ 2 kv heads: a pure ring
    4: [
        (1, 1, (1, 2, 3, 4)),  # h = 1: every multi-rank group is a pure ring
        (2, 2, (1, 3, 4)),  # h = 2: k = 3 a pure ring, k = 4 a ring of 2 × 2 or 4 × 1
        (8, 2, (1, 4)),  # GQA: 2 kv heads, rings of 2 × 2 next to Ulysses over 4 (kv replicated)
        (4, 1, (4,)),  # MQA
        (6, 3, (2, 4)),  # k = 2 and 4 ∤ 3 kv heads
    ],
}


@pytest.mark.parametrize("world", [2, 3])
def test_ring_plans_equal_one_process(world):
    seen = run_distributed(W.check_ring_plans, world, CONFIGS[world], 2, 11 * world, timeout=300)
    assert all(s["ring_rounds"] == [world] for s in seen), seen  # the long sequence: a ring of all ranks
    assert any(s["mixed"] for s in seen), "no rank ran a ring next to a Ulysses-only or one-rank group"
    if world == 3:
        assert any(s["empty_block"] for s in seen), "no ring block was empty (1-token sequences)"


def test_ring_plans_and_bad_rings_on_4_ranks():
    out = run_distributed(W.check_ring_plans_and_bad_ones, 4, CONFIGS[4], 2, 44, timeout=300)
    seen = [s for s, _, _ in out]
    assert {1, 2} <= set().union(*(set(s["u"]) for s in seen)), seen  # pure rings and rings of 2 × 2
    assert any(s["mixed"] for s in seen) and any(s["empty_block"] for s in seen)
    msgs = [m for _, m, _ in out]
    same = [m[3].split(" (this is rank")[0] for m in msgs]  # the later layer's error, minus who reads it
    assert all(len(m) == 4 for m in msgs) and all(m[:2] == msgs[0][:2] for m in msgs), msgs
    assert len(set(same)) == 1 and "ranks disagree before data moves" in same[0], same
    assert out[0][2]["zigzag_chunks_per_member"] == [2] * 4, out[0][2]  # the 61-token ring: two chunks each


def test_ring_plans_on_the_other_attention_path_raise_on_every_rank():
    """attn_path="attention" + pre_attn, and "pre_attn" + attention, on a ring plan: the same
    InvalidPlanError on every rank naming the setting, and the next step runs; gathered K/V
    beyond the memory cap raise at pre_attn (a plan for the pre_attn path refuses them)."""
    msgs = run_distributed(W.check_attn_paths, 3, timeout=120)
    assert all(m == msgs[0] for m in msgs), msgs
    assert len(msgs[0]) == 4
