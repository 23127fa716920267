"""A profiled step names knapformer's phases: planning, every exchange (and its backward), the
local attention and each ring round, forward and backward (``knapformer.distributed.trace``)."""

from knapformer.testing import run_distributed
from tests import trace_workers as W


def test_a_profiled_step_lists_every_phase():
    names = run_distributed(W.profiled_step, 2, timeout=120)
    want = {
        "knapformer.plan",
        "knapformer.exchange.route",
        "knapformer.exchange.route.backward",
        "knapformer.exchange.pre_attn",
        "knapformer.exchange.pre_attn.backward",
        "knapformer.exchange.post_attn",
        "knapformer.exchange.post_attn.backward",
        "knapformer.exchange.reverse_route",
        "knapformer.exchange.reverse_route.backward",
        "knapformer.attention",
        "knapformer.ring.round.0",
        "knapformer.ring.round.1",
        "knapformer.ring.backward.round.0",
        "knapformer.ring.backward.round.1",
    }
    for rank, got in enumerate(names):
        assert want <= set(got), (rank, sorted(want - set(got)))
