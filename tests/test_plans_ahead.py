"""Plans made ahead (issue 57): ``PlannedSteps`` plans the sampler's steps in DataLoader worker
processes with the balancer's ``planner()``; the plans equal gather-then-plan's and the
training math on them is exact."""

import pytest

from knapformer.testing import run_distributed
from tests import ahead_workers as W


@pytest.mark.parametrize("workers", [0, 2])
def test_plans_from_dataloader_workers_equal_gather_then_plan_and_train_exactly(workers):
    """2 gloo ranks, 2 epochs of mixed image + clip steps (fp64 reference MMDiT, ``auto``):
    every step's plan from the loader has the digest of ``bal.plan`` on the same lengths, runs
    to bit-identical outputs and gradients, the steps come in the sampler's order, and a rank
    handing another step's plan makes every rank raise."""
    res = run_distributed(W.plans_ahead, 2, workers, timeout=300)
    for r in res:
        assert r["steps"] >= 4 and r["in_order"], r
        assert r["same"] == r["exact"] == r["steps"], r
        assert "plan" in r["mismatch"].lower(), r
    assert res[0]["moved"] > 0, res  # the plans move tokens: the exactness is not that of staying home


def test_planned_steps_refuses_what_it_cannot_plan():
    from knapformer import WorkloadModel
    from knapformer.data import PlannedSteps, TokenBudgetBatchSampler
    from knapformer.plan import Planner

    sampler = TokenBudgetBatchSampler([10, 20, 30], 40, num_replicas=2, rank=1)
    planner = Planner("auto", WorkloadModel(d_model=8))
    with pytest.raises(TypeError, match="TokenBudgetBatchSampler"):
        PlannedSteps([[0]], planner)
    with pytest.raises(TypeError, match="Planner"):
        PlannedSteps(sampler, None)
    with pytest.raises(ValueError, match="collate_fn needs a dataset"):
        PlannedSteps(sampler, planner, collate_fn=list)
    with pytest.raises(ValueError, match="including this one"):
        PlannedSteps(sampler, planner, group=[0])
    with pytest.raises(TypeError, match="WorkloadModel"):
        Planner("auto", "flux")
    with pytest.raises(ValueError, match="unknown solver"):
        Planner("auto", WorkloadModel(d_model=8), solver="fast")


def test_plan_costs_one_whole_group_collective_per_step():
    """Steady-state steps of the reference MMDiT on 2 gloo ranks (g1n2 and auto): ``bal.plan``
    makes one whole-group host collective (the agreement, whose rows carry every rank's
    measured seconds and lengths; before: the agreement and a gather), ``use_plan`` one (the
    digest agreement); a rank with 40 sequences (more than the rows hold) makes every rank
    gather once more and gets the plan its planner makes, and the rows then hold 40. The step
    itself keeps two (its first exchange call's and ``route``'s agreements, where bad shapes
    raise on every rank)."""
    res = run_distributed(W.count_collectives, 2, timeout=300)
    for counts in res:
        for layout in ("g1n2", "auto"):
            for step in range(1, 4):
                assert counts[f"{layout} plan {step} collective"] == 1, counts
                assert counts.get(f"{layout} step {step} collective", 0) <= 2, counts
            assert counts[f"{layout} use_plan 1 collective"] == 1, counts
        assert counts["long plan collective"] == 2 and counts["long same"] == 1, counts
        assert counts["long again collective"] == 1 and counts["long again same"] == 1, counts
