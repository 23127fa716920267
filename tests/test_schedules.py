"""Calls after ``route`` without a rendezvous (the step's schedule): counted collectives, and
bad or divergent calls on one rank raising on every rank at the next ``plan`` (2 and 4 gloo
ranks).

No clock is read: a rank that waited instead of raising would leave a timeout to end the case
(the process group's 45 s, or the spawn's), which raises another error type than the one
checked, or fails the spawn."""

import pytest

from knapformer.testing import run_distributed
from tests import schedule_workers as W


@pytest.fixture(scope="module", params=[2, 4])
def results(request):
    return request.param, run_distributed(W.steady_state, request.param, timeout=240)


def test_layers_make_no_rendezvous_after_the_first_step_of_a_kind(results):
    """First step of a kind: every per-layer call agrees; later steps: none does, forward or
    backward — and the outputs and gradients are bit-identical."""
    _, res = results
    for r in res:
        att, pre = r["attention counts"], r["pre_attn counts"]
        assert att[0] == [1, 1, 1, 1] and pre[0] == [2, 2, 2, 2], (att, pre)  # learning (pre + post each)
        for per_layer, backward in att[2:] + pre[2:]:
            assert per_layer == [0, 0, 0, 0] and backward == 0, (att, pre)
        assert att[1] == 0 and pre[1] == 0  # the learning step's backward: no rendezvous either
        assert r["attention same"] and r["pre_attn same"]
        ring_counts = r["ring"][0]
        assert ring_counts[1] == [0, 0, 0], ring_counts


def test_bad_or_divergent_calls_raise_on_every_rank_at_the_next_plan(results):
    """The step with the bad call finishes on every rank (no hang, no error mid-step, where
    raising would leave a peer waiting); the next ``plan`` raises the same error everywhere."""
    world, res = results
    for case, (kind, texts) in W.expected_errors().items():
        for rank, r in enumerate(res):
            step, (name, msg) = r[case]
            assert step == ("ok", ""), (case, rank, step)
            assert name == kind.__name__, (case, rank, name, msg)
            for text in texts:
                assert text.format(last=world - 1) in msg, (case, rank, msg)
    for r in res:
        assert r["attention after"] and r["pre_attn after"]  # the next step is exact again
        assert r["attention after eval"] and r["pre_attn after eval"]


def test_a_bad_recomputation_in_the_backward_raises_at_the_next_plan(results):
    _, res = results
    for r in res:
        first, steady, backward, raised = r["recompute"]
        assert first == 2 and steady == 0, (first, steady)  # the recomputed layers agree only while learning
        assert backward[0] == "ok", backward  # the backward completes on every rank (zeros on rank 1)
        assert raised[0] == "BalancerInputError" and "bad input on rank(s) [1]" in raised[1], raised


def test_a_ring_plan_raises_a_later_layers_bad_head_dim_everywhere(results):
    _, res = results
    for r in res:
        _, bad, raised, after = r["ring"]
        assert bad == ("ok", ""), bad  # the step finishes (rank 1 and its peers leave each other out)
        assert raised[0] == "BalancerInputError" and "attention on rank 1" in raised[1], raised
        assert after == [[1, 1, 1], [0, 0, 0]], after  # after an error: one step learns again, then none


def test_calls_that_differ_on_one_rank_finish_the_step_and_raise_at_the_next_plan():
    """A whole layer skipped, a layer through the other attention path, a skipped
    ``gather_sequences``: the step finishes on both ranks (the rank plays the calls it did not
    make, in their place), the next ``plan`` raises DivergentCallError everywhere; a module
    unfrozen after the schedule was learned and an empty rank routing two dtypes just work
    (a regression here ends in PeerLostError after the 60 s timeout, or a gloo abort)."""
    res = run_distributed(W.divergent_calls, 2, timeout=400)
    for r in res:
        for case in ("skip_all_layers", "mixed_skip_attention", "missing_gather", "pre_instead_of_attention"):
            first, second, odd, nxt = r[case]
            assert first == second == odd == ("ok", ""), (case, first, second, odd)
            assert nxt[0] == "DivergentCallError" and "ranks made different calls on rank(s) [1]" in nxt[1], (case, nxt)
        assert r["unfrozen"] == [("ok", "")] * 4, r["unfrozen"]
        assert r["two_dtypes"] == [("ok", "")] * 3, r["two_dtypes"]
