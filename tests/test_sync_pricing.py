"""The planner prices what the executor's exchanges synchronise (``knapformer.plan.sync``):
ranks joined by overlapping multi-rank groups leave each segment of a layer with their slowest
member, so their step is the sum over segments of the set's maxima; a rank alone waits for
nobody."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from knapformer import WorkloadModel
from knapformer.cluster import ModelShape, hardware, predict_step
from knapformer.plan import plan_from_groups, plan_sequences
from knapformer.plan.sync import sync_sets, synced_times

MODEL = WorkloadModel(d_model=64, num_heads=8)


def test_sets_join_overlapping_groups_transitively_and_leave_the_others_alone():
    groups = [(0, 1), (1, 2), (4, 5), (6,), (7, 3), (8, 9)]
    seq_group = np.array([0, 1, 2, 3, 4])  # group (8, 9) holds no sequence: it joins nothing
    sets = sync_sets(groups, seq_group, 10)
    assert sets.tolist() == [0, 0, 0, 3, 4, 4, 6, 3, 8, 9]
    chain = [(5, 4), (3, 4), (2, 3), (1, 2), (0, 1)]  # a chain listed backwards: one set
    assert sync_sets(chain, np.arange(5), 7).tolist() == [0] * 6 + [6]


def test_a_set_takes_the_sum_of_its_segment_maxima():
    sets = np.array([0, 0, 2])
    linear, attention = np.array([3.0, 1.0, 5.0]), np.array([1.0, 3.0, 1.0])
    # ranks 0 and 1 are equal in total (4) but meet at every exchange: 3 + 3 each; rank 2 alone
    assert synced_times(sets, [linear, attention], own=np.array([0.5, 0.0, 0.0])).tolist() == [6.5, 6.0, 6.0]


@settings(max_examples=60, deadline=None)
@given(
    lens=st.lists(st.lists(st.integers(1, 3000), min_size=0, max_size=4), min_size=2, max_size=8),
    seed=st.integers(0, 10_000),
)
def test_the_step_is_never_below_the_busiest_rank_nor_above_the_whole_group_barrier(lens, seed):
    """For any plan: max busy ≤ makespan ≤ the whole group meeting at every exchange, and a
    rank in no multi-rank group finishes with its own busy time."""
    if not any(lens):
        lens[0] = [17]
    S = len(lens)
    rng = np.random.default_rng(seed)
    n = sum(map(len, lens))
    groups = [tuple(int(r) for r in rng.permutation(S)[: int(rng.integers(1, min(S, 4) + 1))]) for _ in range(n)]
    plan = plan_from_groups(lens, groups, list(range(n)), MODEL)
    assert plan.step_after is not None
    assert plan.makespan >= plan.time_after.max() - 1e-9 * plan.makespan
    f = plan.features()
    att = f.attn * MODEL.quad_coef
    lin = f.cost(MODEL) - att
    assert plan.makespan <= lin.max() + att.max() + 1e-9 * plan.makespan
    sets = sync_sets(plan.groups, plan.seq_group, S)
    alone = [r for r in range(S) if (sets == sets[r]).sum() == 1]
    assert np.allclose(plan.step_after[alone], plan.time_after[alone])


def test_a_bag_of_equal_members_loses_nothing_and_a_mixed_set_does():
    lens = [[800], [800], [800], [800]]
    bags = plan_sequences(lens, "g2n2", MODEL)  # every member holds half of each bag sequence
    assert np.isclose(bags.makespan, bags.time_after.max())
    # rank 0: half of a long sequence beside many short ones (linear-heavy); rank 1: the other half
    # and one mid-length sequence (attention-heavy): equal busy time, but they meet at every exchange
    mixed = plan_from_groups([[4000] + [60] * 40, [1100]], [(0, 1), (0,), (1,)], [0] + [1] * 40 + [2], MODEL)
    assert mixed.makespan > mixed.time_after.max() * 1.01


def test_the_cluster_model_adds_the_same_waits():
    hw = hardware("h100")
    shape = ModelShape(dim=3072, heads=24, layers=57)
    lens = [[65536 // 4] * 4, [4096] * 16, [2048] * 32, [30000, 30000]]
    seq_group = [0, 1, 1, 1] + [2] * 16 + [3] * 32 + [4, 4]
    plan = plan_from_groups(lens, [(0, 1, 2, 3), (0,), (1,), (2,), (3,)], seq_group, shape.workload())
    pred = predict_step(plan, shape, hw)
    assert np.all(pred.wait_s >= -1e-12)
    assert pred.step_s >= float((pred.rank_s - pred.wait_s).max())
    synced = pred.compute_s + pred.ulysses_s + pred.ring_s + pred.wait_s
    assert np.allclose(synced, synced[0])  # one set: every member leaves each segment with the slowest
