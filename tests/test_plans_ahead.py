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
    itself keeps one: ``route``'s agreement, where bad shapes raise on every rank (the model
    routes before its ``gather_sequences``, which its peers check)."""
    res = run_distributed(W.count_collectives, 2, timeout=300)
    for counts in res:
        for layout in ("g1n2", "auto"):
            for step in range(1, 4):
                assert counts[f"{layout} plan {step} collective"] == 1, counts
                assert counts.get(f"{layout} step {step} collective", 0) == 1, counts
            assert counts[f"{layout} use_plan 1 collective"] == 1, counts
        assert counts["long plan collective"] == 2 and counts["long same"] == 1, counts
        assert counts["long again collective"] == 1 and counts["long again same"] == 1, counts


def test_plan_ahead_settles_the_next_plan_in_this_steps_route():
    """2 gloo ranks, the fp64 reference MMDiT, ``auto``, 7 steps of mixed sizes, ``measure``
    on. ``plan_ahead(next lengths)`` before each forward; ``plan(next lengths)`` after it.
    Every plan equals ``planner()`` of every rank's lengths (solved in the balancer's worker
    process), outputs and gradients equal gather-then-plan's on a second balancer bit for bit,
    a steady step makes 1 whole-group collective (route's agreement) where gather-then-plan
    makes 2, and the closed loop measures every step once, in order. Then plans made
    elsewhere: ``plan_ahead(plan)`` + ``use_plan(plan)``, 1 collective a step, exact."""
    lengths = run_distributed(W.plan_ahead_lengths, 2, timeout=300)
    plans = run_distributed(W.plan_ahead_plans, 2, timeout=300)
    for r in lengths:
        assert r["same"] == r["exact"] == r["steps"] == 7, r
        assert r["worker process"], r
        for k in range(1, 7):
            assert r["counts"][f"step {k} collective"] == 1, r["counts"]
            assert r["counts"][f"reference {k} collective"] == 2, r["counts"]
        assert r["records"] == [(k, True) for k in range(1, 8)], r["records"]
        assert r["ref_records"] == list(range(1, 8)), r
    assert lengths[0]["moved"] > 0, lengths  # the plans move tokens
    for r in plans:
        assert r["same"] == r["exact"] == r["steps"] == 5, r
        for k in range(1, 5):
            assert r["counts"][f"step {k} collective"] == 1, r["counts"]


def test_plan_ahead_requests_that_differ_raise_on_every_rank():
    """2 gloo ranks: a bad next length on rank 1, a request rank 0 made alone, ``plan`` with
    other lengths than the request, plans that differ, a request no agreement carried, a step
    that fails at ``route`` after its request — every rank raises the same error type (or
    none), and a normal step runs after each. A killed worker process costs nothing but time:
    the plans stay gather-then-plan's; so does a request longer than the rows hold."""
    res = run_distributed(W.plan_ahead_errors, 2, timeout=300)
    expected = {
        "bad length": ("BalancerInputError", "bad request on rank(s) [1]: rank 1: next_step[0] = -1"),
        "one rank": ("DivergentCallError", "rank 0: plan_ahead(lengths), rank 1: no plan_ahead"),
        "other lengths": ("BalancerInputError", "SequenceBalancer.route: bad local_seq_lens on rank(s) [1]"),
        "plans differ": ("PlanMismatchError", "the plan differs on rank(s) [1]"),
        "route fails": ("BalancerInputError", "argument 0 has 136 tokens on rank 0, expected 137"),
    }
    for r in res:
        for case, (kind, text) in expected.items():
            assert r[case][0] == kind and text in r[case][1], (case, r[case])
            assert r[f"{case} then"] is True, case
        assert r["not carried"] is True, r
        assert r["worker killed"] == [True] * 6, r
        assert r["long request"] == [True, True], r


def test_stock_flux_steady_step_makes_one_collective_with_plans_ahead():
    """The issue's case: stock Flux (diffusers) through the documented API on 4 gloo ranks,
    layout ``g1n4`` (nothing to move). A steady step — plan, packed forward, backward — makes 2
    whole-group host collectives planned inline (``plan``'s agreement, which carries the
    lengths; ``route``'s), 1 with ``plan_ahead(lengths)`` or ``plan_ahead(plan)`` + ``use_plan``
    (``route``'s, which also carries the next step's request), and no point-to-point; the
    outputs of the three are identical."""
    res = run_distributed(W.flux_counts, 4, timeout=300)
    for r in res:
        assert r["same"], r
        for k in range(1, 4):
            assert r["counts"][f"inline step {k} collective"] == 2, r["counts"]
            assert r["counts"][f"ahead lengths step {k} collective"] == 1, r["counts"]
            assert r["counts"][f"ahead plan step {k} collective"] == 1, r["counts"]
        assert not any(k.endswith("p2p") for k in r["counts"]), r["counts"]


def test_agreement_rows_grow_to_the_longest_payload_up_to_a_cap():
    """The rows grow (by doubling, the same on every rank) to hold the longest payload seen, but
    not past ``MAX_CAPACITY``: one rank's thousands of tiny sequences do not make every later
    agreement row that long (those steps gather their lengths a second time instead)."""
    from knapformer.distributed.checks import MAX_CAPACITY, StepChecks

    checks = StepChecks(None, None, 0)
    start = checks.capacity
    checks.grow(start - 1)
    assert checks.capacity == start
    checks.grow(41)
    assert checks.capacity == 64
    checks.grow(100_000)
    assert checks.capacity == MAX_CAPACITY == 256
