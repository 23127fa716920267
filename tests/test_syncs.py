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


def test_the_counter_sees_operators_whose_output_size_depends_on_values():
    """``nonzero``, ``unique``, boolean-mask indexing, one-argument ``where``, ``masked_select``
    and ``repeat_interleave`` with tensor repeats wait for the device on a GPU: counted when
    knapformer's code calls them (a mutation check of the tool), not the sized forms."""
    import torch

    from knapformer.executor import present_sequences
    from knapformer.testing.syncs import SyncSites

    class Bare:  # an executor without a host-built present_sequences: torch.unique of its ids
        def routed_positions(self, like):
            return torch.tensor([0, 0, 2]), torch.tensor([0, 1, 0])

    with SyncSites() as syncs:
        syncs.phase("sized")
        present, slot = present_sequences(Bare(), torch.zeros(3))
        syncs.phase("test's own")
        x = torch.arange(5)
        x.nonzero(), torch.unique(x), x[x > 2], torch.where(x > 1), x.masked_select(x > 0)
    assert present.tolist() == [0, 2] and slot.tolist() == [0, 0, 1]
    assert syncs.counts["sized"] == 1 and "unique at knapformer.executor.protocol" in syncs.report(), syncs.report()
    assert syncs.counts["test's own"] == 0, syncs.report()
    before = (torch.nonzero, torch.unique, torch.Tensor.__getitem__, torch.Tensor.repeat_interleave)
    with SyncSites():
        assert torch.nonzero is not before[0]
    assert (torch.nonzero, torch.unique, torch.Tensor.__getitem__, torch.Tensor.repeat_interleave) == before
