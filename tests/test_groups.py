"""Per-sequence groups: one rank in several groups of different sizes in the same step
(overlapping, non-contiguous, changing every step), GQA/MQA, on 2, 3 and 4 gloo ranks; every
result equals one-process per-sequence math."""

import pytest

from knapformer.testing import run_distributed
from tests import group_workers as W


@pytest.mark.parametrize(
    "world, heads, kv_heads, sizes",
    [
        (2, 4, 4, (1, 2)),
        (3, 12, 12, (1, 2, 3)),  # groups of 3 with 12 heads, of 2 and 1 beside them
        (3, 6, 6, (1, 3)),  # a group of 3 with 6 heads
        (4, 12, 12, (1, 2, 3, 4)),
        (4, 8, 2, (1, 2, 4)),  # GQA 8 q / 2 kv heads: groups of 4 replicate each kv head twice
        (4, 8, 1, (1, 2, 4)),  # MQA
    ],
)
def test_overlapping_groups_equal_one_process(world, heads, kv_heads, sizes):
    seen = run_distributed(W.check_overlapping_groups, world, heads, kv_heads, sizes, 3, 100 + world, timeout=300)
    assert any(s["mixed_rank"] for s in seen), "no rank ran sequences alone and in multi-rank groups"


@pytest.mark.parametrize("world", [2, 4])
def test_bad_group_plans_raise_on_every_rank(world):
    msgs = run_distributed(W.check_bad_group_plans, world, timeout=120)
    assert all(len(m) == len(msgs[0]) >= 3 for m in msgs)


@pytest.mark.parametrize("world", [2, 4])
def test_auto_layout_plans_and_runs_exactly(world):
    """SequenceBalancer("auto", ...) plans per-sequence groups each step; every step's attention
    and gradients equal one process, and some steps mix degrees on one rank."""
    seen = run_distributed(W.check_auto_balancer, world, 8, 4, 7, timeout=300)
    assert all(s["partition"] == seen[0]["partition"] for s in seen)  # the same plans on every rank


def test_auto_layout_uses_sizes_that_do_not_divide_a_small_group():
    """3 ranks, 8 heads (3 does not divide 8): without a link model and rings ``auto:noring``
    runs the long sequence on 2 of the 3 ranks, exactly (custom kernels included)."""
    seen = run_distributed(W.check_auto_balancer, 3, 8, 3, 11, False, "auto:noring", timeout=300)
    assert all(s["partition"] == seen[0]["partition"] for s in seen)
    assert 2 in seen[0]["sizes"] and 3 not in seen[0]["sizes"], seen[0]["sizes"]
    assert not seen[0]["rings"]


AUTO_CUSTOM = {  # (h, h_kv): the GQA cases whose groups only rings can serve
    2: [(6, 3)],
    3: [(8, 2), (4, 1), (12, 4)],
    4: [(6, 3)],
}


@pytest.mark.parametrize("world", [2, 3, 4])
def test_auto_runs_your_own_kernel_on_ring_plans(world):
    """``auto`` with a model that only calls pre_attn/post_attn (its own varlen kernel, here the
    contract's reference): plans with rings (heads the group sizes cannot split) run exactly,
    causal and not, forward and gradients; the first plan prices ring rounds (no call seen yet),
    every later one the all-gather (``attn_path="auto"``), the same on every rank."""
    configs = [(h, kv, causal, causal) for h, kv in AUTO_CUSTOM[world] for causal in (False, True)]
    seen = run_distributed(W.check_auto_custom_kernel, world, configs, 3, 300 + world, timeout=300)
    assert all(s == seen[0] for s in seen), seen
    for s in seen[0]:
        assert s["kv_gather"] == [False, True, True], s
    assert all(s["rings"] for s in seen[0]), seen[0]  # every config had a ring plan
    assert any(1 in s["sizes"] and len(s["sizes"]) > 1 for s in seen[0]), seen[0]  # whole sequences beside
