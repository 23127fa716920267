"""Host-device synchronisation budgets of a step, counted on CPU (what a GPU would pay for
them in full): plan at most one, layers after the first none, forward or backward — for
Ulysses, ring, the K/V gather of ``pre_attn``, cross-attention and an empty rank."""

import pytest

from knapformer.testing import run_distributed
from tests import sync_workers as W


@pytest.fixture(scope="module")
def counts():
    return run_distributed(W.count_syncs, 2, timeout=180)


@pytest.mark.parametrize(
    "kind", ["attention", "pre_attn", "ring", "ring pre_attn", "cross_attention", "empty rank", "idle pre_attn"]
)
def test_sync_sites_per_phase_stay_within_budget(counts, kind):
    for rank, res in enumerate(counts):
        found, report = res[kind]
        for step in range(3):
            assert found.get(f"plan {step}", 0) <= 1, (rank, report)
            assert found.get(f"layer 2 {step}", 0) == 0, (rank, report)
            assert found.get(f"backward {step}", 0) == 0, (rank, report)
            if step > 0:  # the first step may pay one-time costs (a ring block kernel's probe)
                for phase in ("route", "layer 1", "reverse"):
                    assert found.get(f"{phase} {step}", 0) == 0, (rank, phase, report)


def test_the_counter_sees_a_host_read():
    """The counter counts what knapformer's own code reads back (a mutation check of the tool)."""
    import torch

    from knapformer.attention.varlen import varlen_attention
    from knapformer.testing.syncs import SyncSites

    q = torch.randn(5, 2, 4)
    with SyncSites() as syncs:
        syncs.phase("call")
        varlen_attention(q, q, q, torch.tensor([0, 2, 5], dtype=torch.int32), 3)  # bounds built by hand
        q.tolist()  # the test's own read: not counted
    assert syncs.counts["call"] == 1, syncs.report()  # sdpa reads the unregistered bounds once
