"""Per-step work of every family's packed forward that must not grow with the group (issue 57):
AdaLN modulation runs for the samples present on a rank, not for every sample of the group."""

import pytest

from knapformer.testing import run_distributed
from tests import control_workers as W


@pytest.fixture(scope="module")
def flops():
    return run_distributed(W.modulation_flops, 2, timeout=400)


@pytest.mark.parametrize("family", sorted(W.PRESETS))
def test_rank_0s_forward_flops_do_not_depend_on_what_the_other_rank_holds(flops, family):
    """Layout g1n2, rank 0 alone with one long sample (the plan moves nothing), rank 1 with 1 or
    12 short samples: rank 0's forward FLOPs are equal (within 1%). Before, Flux, SD3,
    torchtitan's Flux and the reference MMDiT modulated every sample of the group on every rank
    (+7–10% here with 12 samples on the other rank, growing with the group)."""
    row = flops[0][family]
    assert row["few moved"] == row["many moved"] == 0, row  # rank 0 holds exactly its own sample
    assert abs(row["many"] - row["few"]) <= 0.01 * row["few"], row
