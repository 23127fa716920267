"""Communication is priced by default: ``link=None`` measures the group's links when the
balancer is built (the same model on every rank), so ``auto`` keeps small images whole where
splitting them would cost more in exchanges than it balances; ``link="free"`` is the explicit
old behaviour; bytes per value follow the tensors' dtype."""

import pytest

from knapformer import BalancerConfig, WorkloadModel
from knapformer.cluster.hardware import hardware
from knapformer.distributed.link_probe import PROBE_BYTES
from knapformer.layout import parse_layout
from knapformer.plan import PlanProblem, get_solver
from knapformer.testing import run_distributed
from tests import link_workers as W


def test_the_default_link_is_measured_identically_and_keeps_small_images_whole():
    """The real probe (this machine's clocks): one model, positive and finite, on every rank.
    Then the probe's timings injected (rank r reads them (1 + r/10)× slower, no clock read): the
    model is every number as the slowest rank measured it, and the plans made with it — priced,
    no 256-token image is cut; free, the same step cuts them — hold on any machine load."""
    res = run_distributed(W.default_link, 4, timeout=120)
    real = res[0]["real"]
    assert real is not None and all(r["real"] == real for r in res)  # every rank plans with the same model
    assert real["intra_bw"] > 0 and real["intra_latency"] > 0 and 0 < real["units_per_second"] < float("inf")
    link = res[0]["link"]
    assert all(r["link"] == link for r in res)
    slowest = 1.3  # rank 3's readings
    lat, big = W.PROBED["latency"] * slowest, W.PROBED["big"] * slowest
    assert link["intra_latency"] == pytest.approx(lat, rel=1e-6)
    assert link["intra_bw"] == pytest.approx(3 * (PROBE_BYTES - 4) / (big - lat), rel=1e-6)  # 3 peers on this node
    assert link["units_per_second"] == pytest.approx(W.PROBED["flops"] / slowest / 3, rel=1e-6)
    for r in res:
        assert r["free_link"] == "free"
        assert r["again_free"] == ("free", r["free_sizes"]), r  # planning_config round-trips ...
        assert r["again_priced"] == (True, r["priced_groups"]), r  # ... free or measured
        assert r["priced_sizes"] == [1], r  # priced: no 256-token image is cut
        assert max(r["free_sizes"]) > 1, r  # free: the same step cuts them
        assert r["bytes"] == (4, 2), r  # fp32 by default, then the bf16 the step exchanged


def test_flux_sizes_on_an_h100_node_keep_256_token_images_whole_unless_communication_is_free():
    """What the probe measures on a GPU node is of this order (NVLink bandwidth, Flux FLOPs at
    the device's rate): priced, small images move whole; free, every one is cut over 8 ranks."""
    hw = hardware("h100")
    model = WorkloadModel(d_model=3072, num_heads=24, num_layers=57)
    lens = [[256] * 8] + [[256]] * 7
    solve = get_solver("moldable")
    link = hw.link(units_per_second=hw.flop_units_per_second, bytes_per_value=2)
    priced = solve(PlanProblem(seq_lens=lens, layout=parse_layout("auto"), model=model, link=link))
    free = solve(PlanProblem(seq_lens=lens, layout=parse_layout("auto"), model=model, link=None))
    assert priced.group_sizes().max() == 1 and priced.tokens_moved > 0
    assert free.group_sizes().max() == 8


def test_link_names_are_checked():
    cost = WorkloadModel(d_model=8)
    assert BalancerConfig(layout="auto", cost=cost, link="free").link == "free"
    with pytest.raises(ValueError, match="'measure', 'free'"):
        BalancerConfig(layout="auto", cost=cost, link="fast")
    with pytest.raises(TypeError, match="LinkModel"):
        BalancerConfig(layout="auto", cost=cost, link=3)
