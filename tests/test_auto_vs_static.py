"""``auto`` against the static layouts a team configures by hand, on realistic image + video
steps (issue 42): never more than 0.5% slower than the best uniform layout, in the planner's
own cost model, with the bound counting what every plan pays."""

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from knapformer.cluster import hardware
from knapformer.data import dealt_steps, manifest_seq_lens, synthetic_manifest, tokenizer
from knapformer.integrations.registry import model_config
from knapformer.plan import PlanProblem, plan_sequences
from knapformer.plan.cost import jitter_factor
from tests.strategies import realistic_steps

HW = hardware("h100")
LINK = HW.link(None, units_per_second=HW.flop_units_per_second)
FLUX = model_config("diffusers-flux-dev").workload()
WAN = model_config("diffusers-wan-14b").workload()


def _model(name: str, context: int):
    return FLUX if name.endswith("flux") else dataclasses.replace(WAN, context_len=context)


def _best_uniform(lens, model) -> float:
    """The best plan of g1/g2/g4/g8 (every rank in k-rank Ulysses groups) by the default solver."""
    S = len(lens)
    return min(plan_sequences(lens, f"g{k}n{S // k}", model, link=LINK).makespan for k in (1, 2, 4, 8) if S % k == 0)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(step=realistic_steps())
def test_auto_is_never_worse_than_the_best_uniform_layout(step):
    """On a sampled step of any synthetic mix, Flux or Wan-14B sizes on ``h100`` links, 16–64
    GPUs: ``auto``'s predicted makespan is at most 1.005× the best uniform static layout's."""
    lens, tok, context = step
    model = _model(tok, context)
    auto = plan_sequences(lens, "auto", model, link=LINK)
    assert auto.makespan <= 1.005 * _best_uniform(lens, model)


# Steps where auto lost to static Ulysses before this fix (d8210a8 predicted 1.10, 1.15 and 1.09×
# the best uniform layout: split videos stacked on ranks no local search could relieve).
PINNED = [("realistic", "flux", 0, 0), ("video-heavy", "flux", 2, 0), ("realistic", "wan", 2, 0)]


@pytest.mark.parametrize("mix,tok,seed,index", PINNED)
def test_realistic_64_gpu_steps_where_auto_lost_to_static_ulysses(mix, tok, seed, index):
    """The 64-GPU steps the issue's kind of data gave: auto within 0.5% of the best uniform layout
    and within 5% of its bound."""
    m = synthetic_manifest(mix, 3000, seed=seed)
    t = tokenizer(tok)
    lens, buckets = manifest_seq_lens(m, t)
    step = dealt_steps(lens, buckets, 64, max_tokens=65_536, steps=index + 1, seed=seed)[index]
    model = _model(tok, t.context_len(m.text_tokens))
    auto = plan_sequences(step, "auto", model, link=LINK)
    assert auto.makespan <= 1.005 * _best_uniform(step, model)
    assert auto.makespan <= 1.05 * auto.lower_bound


def test_auto_beats_static_ulysses_where_small_sequences_can_stay_whole():
    """A realistic 64-GPU Flux step (2048² images beside clips of 2–10 s): splitting inside a
    node every sequence above 1/32 of the bound and keeping the rest whole saves the exchanges
    and waits of the small ones that static Ulysses-8 pays — auto is 0.5% faster or more."""
    m = synthetic_manifest("realistic", 3000, seed=2)
    lens, buckets = manifest_seq_lens(m, tokenizer("flux"))
    step = dealt_steps(lens, buckets, 64, max_tokens=65_536, steps=2, seed=2)[1]
    auto = plan_sequences(step, "auto", FLUX, link=LINK)
    assert auto.makespan <= 0.995 * _best_uniform(step, FLUX)


def test_the_bound_counts_the_wait_of_every_member_of_a_split_sequence():
    """Four equal 60k-token sequences on 8 ranks: each must run on two ranks or more to use
    them all, and every member of a group waits for the slowest at its exchanges — the bound is
    above the fluid compute by at least the two-rank sync jitter, and still no plan beats it."""
    lens = [[60_000] if r % 2 == 0 else [] for r in range(8)]
    p = PlanProblem(seq_lens=lens, layout="auto", model=FLUX, link=LINK)
    fluid = float(p.work.sum()) / 8
    assert p.lower_bound >= fluid * (1 + LINK.sync_jitter * float(jitter_factor(2))) * (1 - 1e-12)
    assert p.lower_bound > p.steady_bound * (1 + 1e-4)  # the jitter-free figure (auto's targets) is lower
    plans = [plan_sequences(lens, lay, FLUX, link=LINK) for lay in ("auto", "g2n4", "g4n2", "g8n1")]
    assert p.lower_bound <= min(q.makespan for q in plans) * (1 + 1e-9)


def test_uniform_candidates_are_pruned_by_a_true_bound():
    """Each uniform layout's O(n) bound is at or below its plan's makespan (a plan the pruning
    skips could not have won by more than the slack)."""
    from knapformer.plan.solvers.uniform import uniform_bound

    rng = np.random.default_rng(7)
    for model in (FLUX, dataclasses.replace(WAN, context_len=160)):
        lens = [rng.choice([1_040, 4_240, 16_500, 66_000], size=int(rng.integers(1, 6))).tolist() for _ in range(32)]
        lens[3].append(150_000)
        p = PlanProblem(seq_lens=lens, layout="auto", model=model, link=LINK)
        for k in (1, 2, 4, 8, 16, 32):
            plan = plan_sequences(lens, f"g{k}n{32 // k}", model, link=LINK)
            assert uniform_bound(p, k) <= plan.makespan * (1 + 1e-9), k


def test_the_uniform_total_from_three_sums_is_at_most_the_per_sequence_one():
    """The O(1)-per-size total (ΣL, Σ⌈L/k⌉, Σwork) never exceeds the sum of the per-sequence
    totals it stands for (ring exposure left out), and is within 0.1% of it."""
    from knapformer.plan.bound import size_costs
    from knapformer.plan.solvers.uniform import _total_work, uniform_sizes

    rng = np.random.default_rng(3)
    for model in (FLUX, dataclasses.replace(WAN, context_len=160)):
        lens = np.clip(rng.lognormal(8, 1.5, size=(64, 6)), 1, 400_000).astype(int).tolist()
        p = PlanProblem(seq_lens=lens, layout="auto", model=model, link=LINK)
        for k in uniform_sizes(p):
            exact = size_costs(p, [k], p.lengths, 1.0, exposed=p.ring_of(k) == 1)[1].sum()
            fast = _total_work(p, k)
            assert fast <= exact * (1 + 1e-12) and fast >= exact * (1 - 1e-3), (k, fast / exact)


@pytest.mark.parametrize("length", [512, 4_000])
def test_the_uniform_bound_counts_every_busy_ranks_exchange_latency(length):
    """Two equal sequences per rank on 32 ranks pack exactly into any g{k}: the uniform bound
    is then the plan to within 0.1% — below it (a bound), and above 0.999 of it only because it
    counts the latency every member of a busy bag pays at each exchange (3.6% of a step of
    512-token sequences; without it the bound was 0.963 of the plan)."""
    from knapformer.plan.solvers.uniform import uniform_bound

    lens = [[length] * 2 for _ in range(32)]
    p = PlanProblem(seq_lens=lens, layout="auto", model=FLUX, link=LINK)
    for k in (2, 4, 8):
        plan = plan_sequences(lens, f"g{k}n{32 // k}", FLUX, link=LINK)
        ratio = uniform_bound(p, k) / plan.makespan
        assert 0.999 <= ratio <= 1 + 1e-9, (k, ratio)


def test_the_uniform_candidates_include_the_ring_layouts_over_whole_nodes():
    """Issue 42 asks for every uniform layout a team would configure among `auto`'s candidates:
    Ulysses groups inside a node and rings of them over whole nodes (up to 8). On 128 `h100`
    ranks (8 per node) with Flux's 24 heads: 1, 2, 4, 8 and 16 … 64 — a check that refused
    any bag wider than a node left the rings out."""
    from knapformer.plan.solvers.uniform import uniform_sizes

    p = PlanProblem(seq_lens=[[4_096]] * 128, layout="auto", model=FLUX, link=LINK)
    assert uniform_sizes(p) == [1, 2, 4, 8, 16, 32, 64]
