"""Regression tests of defects that held-out checks found (each failed before its fix)."""

import pytest

from knapformer.testing import run_distributed
from tests import defect_workers as W


@pytest.mark.parametrize("world", [2, 4])
def test_plans_listing_a_group_twice_run_exactly(world):
    """A plan may list the same group more than once (one-rank or multi-rank): it used to pass
    validate() and then crash on one rank and hang the others; now it runs exactly."""
    res = run_distributed(W.duplicated_groups, world, timeout=120)
    for rank in res:
        for case, err in rank.items():
            assert err < 1e-12, (case, err)


@pytest.mark.parametrize("world", [2, 4])
def test_post_attn_with_wrong_rows_raises_on_every_rank(world):
    """One row too many or too few on one rank (also a rank without sequences), in a layout
    without multi-rank groups, a one-group layout and auto: the same error on every rank."""
    res = run_distributed(W.post_attn_wrong_rows, world, timeout=180)
    for case in res[0]:
        seen = [r[case] for r in res]
        culprit = int(case.split("rank ")[1].split()[0])
        assert {kind for kind, _ in seen} == {"BalancerInputError"}, (case, seen)
        for _, msg in seen:
            assert f"SequenceBalancer.post_attn: bad input on rank(s) [{culprit}]" in msg, (case, msg)
            assert "post_attn got" in msg, (case, msg)  # the culprit's reason, on every rank


def test_a_group_this_rank_is_not_a_member_of_is_named():
    res = run_distributed(W.group_not_a_member, 2, timeout=60)
    for kind, msg in res:
        assert kind == "BalancerConfigError", msg
        assert "rank 0 passed a group it is not a member of" in msg, msg
    assert "invalid settings on rank(s) [0]" in res[1][1]


def test_groups_whose_members_disagree_are_refused_at_construction():
    res = run_distributed(W.groups_differ, 2, timeout=60)
    for kind, msg in res:
        assert kind == "BalancerConfigError", msg
        assert "rank 0 passed the group [0, 1], but its member rank 1 passed [1]" in msg, msg


def test_a_family_that_needs_tokens_on_every_rank_gets_one_error_on_every_rank():
    """Issue 59, item 5: a stock block that reshapes per batch row (LTX-Video's) crashed on the
    rank that routed no token while its peers waited. ``Packing.route(min_tokens=1)`` makes
    that a ``BalancerInputError`` on every rank, before any exchange, naming the rank; a step
    where every rank holds tokens routes. One process: the same check on its own tokens."""
    import torch

    from knapformer.distributed import BalancerInputError
    from knapformer.integrations.packing import Packing

    res = run_distributed(W.min_tokens_route, 2, timeout=120)
    for r in res:
        kind, msg = r["strict"]
        assert kind == "BalancerInputError" and "rank(s) [1]" in msg and "min_tokens=1" in msg, r["strict"]
        assert r["default"] == ("ok", "") and r["all_hold"] == ("ok", ""), r
    with pytest.raises(BalancerInputError, match=r"rank\(s\) \[0\]"):
        Packing([], {"x": (0,)}, "cpu").route(None, torch.zeros(0, 4), min_tokens=1)


def test_a_balancer_leaves_the_global_random_stream_alone():
    """Building a balancer measured its links with ``torch.randn`` from the global stream, so a
    loop's noise and timesteps changed with knapformer (Automodel's stock-vs-knapformer steps
    after the first differed): every rank, construction and a step draw nothing from it."""
    for r in run_distributed(W.rng_untouched, 2, timeout=60):
        assert r == {"construct": True, "step": True}, r
