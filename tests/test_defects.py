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
