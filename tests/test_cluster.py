"""Cluster model: comm arithmetic on hand-computed cases, presets, layout search, bad input."""

import json

import numpy as np
import pytest

from knapformer.cli import main
from knapformer.cluster import (
    HARDWARE,
    Hardware,
    ModelShape,
    a2a_seconds,
    candidate_layouts,
    evaluate,
    hardware,
    predict_step,
    predict_unbalanced,
    search_layouts,
)
from knapformer.data import sample_seq_lens
from knapformer.plan import PlanProblem, build_plan
from knapformer.workload import WorkloadModel

HW = Hardware(
    name="toy",
    peak_flops=1e12,
    efficiency=0.5,
    gpus_per_node=2,
    intra_bw=100.0,
    inter_bw=10.0,
    intra_latency=1.0,
    inter_latency=2.0,
    copy_bw=1e30,
)
SHAPE = ModelShape(dim=2, heads=4, layers=1, bytes_per_value=1)  # 2 bytes per token on the wire


def test_a2a_time_is_latency_plus_max_direction():
    t = a2a_seconds(np.array([0.0, 100.0, 50.0]), np.array([0.0, 20.0, 300.0]), 100.0, 1.0)
    np.testing.assert_allclose(t, [0.0, 2.0, 4.0])


def test_route_cost_by_hand():
    # 4 ranks, 2 per node. Sequence of 30 tokens on rank 0 goes whole to rank 3 (other node);
    # 10 tokens on rank 1 stay. Route: rank 0 sends 30*2=60 bytes inter-node -> 2 + 60/10 = 8 s,
    # rank 3 receives the same -> 8 s; x4 (route, reverse, and their backward).
    problem = PlanProblem(seq_lens=[[30], [10], [], []], layout="g1n4", model=WorkloadModel(d_model=2))
    plan = build_plan(problem, np.array([3, 1]), solver="hand")
    pred = predict_step(plan, SHAPE, HW)
    np.testing.assert_allclose(pred.route_s, [32.0, 0.0, 0.0, 32.0], atol=1e-20)
    np.testing.assert_allclose(pred.ulysses_s, 0.0)


def test_ulysses_cost_by_hand():
    # one 2-rank bag in one node holding a 20-token sequence: each rank holds 10 tokens = 20 bytes;
    # pre: sends 3*20/2 = 30 bytes, receives 30 -> 1 + 30/100; post: 1 + 10/100. Forward and
    # backward -> x2; one layer.
    problem = PlanProblem(seq_lens=[[20], []], layout="g2n1", model=WorkloadModel(d_model=2))
    plan = build_plan(problem, np.array([0]), solver="hand")
    pred = predict_step(plan, SHAPE, HW)
    np.testing.assert_allclose(pred.ulysses_s, 2 * ((1 + 0.3) + (1 + 0.1)))
    assert pred.route_s[0] > 0  # half the tokens moved to rank 1


def test_sync_jitter_charged_to_multi_rank_bags_only():
    # 4 ranks: a 2-rank bag holding a 20-token sequence and two 1-rank bags with 8 tokens each.
    # Each bag member waits j * E[max of k]/E[max of 2] * its compute; 1-rank bags never sync.
    hw = HW.with_overrides(sync_jitter=0.1)
    problem = PlanProblem(seq_lens=[[20], [], [8], [8]], layout="g1n2+g2n1", model=WorkloadModel(d_model=2))
    plan = build_plan(problem, np.array([2, 0, 1]), solver="hand")
    pred = predict_step(plan, SHAPE, hw)
    in_pair = list(plan.groups[2])
    assert len(in_pair) == 2 and pred.compute_s[in_pair].min() > 0
    np.testing.assert_allclose(pred.sync_s[in_pair], 0.1 * pred.compute_s[in_pair])
    np.testing.assert_allclose(np.delete(pred.sync_s, in_pair), 0.0)
    np.testing.assert_allclose(pred.rank_s, pred.compute_s + pred.route_s + pred.ulysses_s + pred.sync_s)
    # a 4-rank bag scales by E[max of 4] / E[max of 2] (1.0294 / 0.5642)
    problem4 = PlanProblem(seq_lens=[[20], [], [], []], layout="g4n1", model=WorkloadModel(d_model=2))
    pred4 = predict_step(build_plan(problem4, np.array([0]), solver="hand"), SHAPE, hw)
    np.testing.assert_allclose(pred4.sync_s, 0.1 * 1.0294 / 0.5642 * pred4.compute_s, rtol=1e-3)
    with pytest.raises(ValueError, match="sync_jitter"):
        HW.with_overrides(sync_jitter=1.5)


def test_compute_from_flops_and_from_profile():
    lens = [[100], [10, 10]]
    p = predict_unbalanced(lens, SHAPE, HW)
    fl = 3 * (24 * 100 * 4 + 4 * 100**2 * 2)
    assert p.compute_s[0] == pytest.approx(fl / 0.5e12)
    prof = WorkloadModel(d_model=2, linear=1.0, quadratic=0.01, per_seq=0.5)
    q = predict_unbalanced(lens, SHAPE, HW, profile=prof)
    np.testing.assert_allclose(q.compute_s, [100 + 100 + 0.5, 20 + 2 + 1.0])


def test_presets_and_overrides():
    assert set(HARDWARE) >= {"h100", "h200", "a100"}
    h = hardware("h100")
    assert h.peak_flops == 989e12 and h.intra_bw == 450e9 and h.gpus_per_node == 8 and h.inter_bw == 50e9
    assert h.with_overrides(efficiency=0.3, inter_bw=None).efficiency == 0.3
    with pytest.raises(ValueError, match="unknown hardware preset 'tpu'"):
        hardware("tpu")
    with pytest.raises(ValueError, match="efficiency must be <= 1"):
        h.with_overrides(efficiency=2.0)


def test_candidates_respect_heads_and_nodes():
    specs = candidate_layouts(16, 24, 8)
    assert "g8n2" in specs and "g1n16" in specs and not any("g5" in s or "g16" in s for s in specs)
    # bags never straddle nodes: g3 bags only where they tile within 8-GPU nodes
    from knapformer.layout import parse_layout

    for s in specs:
        assert all(len({r // 8 for r in bag}) == 1 for bag in parse_layout(s).bags), s
    # 7 heads on 16 GPUs: no multi-rank bag divides both, only data-parallel-style g1 remains
    assert candidate_layouts(16, 7, 8) == ["g1n16"]


def test_auto_never_worse_than_best_uniform():
    from knapformer.model_configs import preset

    shape = ModelShape.from_config(preset("flux"))
    hw = hardware("h100")
    for mix in ("paper-lowres", "paper-mixres", "paper-joint"):
        steps = [sample_seq_lens(mix, seed=0)]
        best, results, base = search_layouts(steps, shape, hw)
        # every uniform layout evaluated on its own, outside the search
        uniform = [evaluate(steps, f"g{k}n{32 // k}", shape, hw) for k in (1, 2, 4, 8)]
        assert best.step_s <= min(r.step_s for r in uniform) * (1 + 1e-12)
        assert best.step_s <= evaluate(steps, "none", shape, hw).step_s
        assert {r.bags for r in uniform} <= {r.bags for r in results}


def test_none_matches_layout_g1_without_moves():
    steps = [[[5, 5], [5, 5]]]
    a = evaluate(steps, "none", SHAPE, HW)
    b = evaluate(steps, "g1n2", SHAPE, HW)
    assert a.step_s == pytest.approx(b.step_s)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--mix", "paper-joint", "--gpus", "32", "--model", "flux", "--hardware", "tpu"], "unknown hardware preset"),
        (["--mix", "paper-joint", "--gpus", "36", "--model", "flux"], "not a whole number of 8-GPU nodes"),
        (["--mix", "paper-joint", "--gpus", "32", "--model", "nope"], "unknown model preset 'nope'"),
        (["--mix", "paper-joint", "--gpus", "32", "--model", "flux", "--bags", "g5n4+g3n4"], "does not divide"),
        (["--mix", "paper-joint", "--gpus", "64", "--model", "flux", "--gpus-per-node", "7"], "not a whole number"),
        (["--mix", "paper-joint", "--gpus", "16", "--model", "flux"], "describes 32 GPUs"),
    ],
)
def test_bad_input(capsys, args, message):
    assert main(["cluster", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_cli_json_and_heads_incompatible_with_every_layout(tmp_path, capsys):
    assert (
        main(
            [
                "cluster",
                "--mix",
                "paper-joint",
                "--gpus",
                "32",
                "--model",
                "flux",
                "--bags",
                "g8n4",
                "--json",
                "--steps",
                "1",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["best"]["bags"] == "g8n4" and out["rows"][0]["bags"] == "none"
    lens = tmp_path / "l.json"
    lens.write_text(json.dumps({"seq_lens": [[64]] * 16}))
    # transformer-tiny has 4 heads: with 16 GPUs and 8 per node bag sizes 1, 2, 4 remain
    assert (
        main(
            [
                "cluster",
                "--input",
                str(lens),
                "--gpus",
                "16",
                "--model",
                "transformer-tiny",
                "--bags",
                "search",
                "--steps",
                "1",
                "--json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    from knapformer.layout import parse_layout

    searched = [r["bags"] for r in out["rows"][1:]]
    sizes = {g for s in searched for g, _ in parse_layout(s).terms}
    assert sizes == {1, 2, 4} and "g4n4" in searched and out["rows"][0]["bags"] == "none"
    assert out["best"]["step_s"] == min(r["step_s"] for r in out["rows"][1:])


def test_cluster_reports_ring_groups(capsys):
    """A 2048² 40-frame video among images on 32 GPUs: auto runs it on more ranks than a node's
    Ulysses group and the report says how (ring r × Ulysses u), in the table and the JSON."""
    args = ["cluster", "--mix", "g31b4i512f1s0,g1b1i2048f40s0", "--gpus", "32", "--model", "flux"]
    args += ["--hardware", "h100", "--bags", "auto", "--steps", "1", "--quiet"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "auto: largest group 32 ranks; rings (r × Ulysses u): 4×8" in out, out
    assert main([*args, "--json"]) == 0
    row = json.loads(capsys.readouterr().out)["rows"][1]
    assert row["largest_group"] == 32 and row["rings"] == "4×8"
    assert main([*args[:-5], "--bags", "auto:noring", "--steps", "1", "--quiet", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)["rows"][1]
    assert row["largest_group"] <= 24 and row["rings"] == ""  # Ulysses over the 24 heads at most


def test_the_control_plane_is_on_the_predicted_step_when_planning_inline():
    """Issue 57: ``predict_step(control_s=...)`` adds the control plane's seconds to every rank
    (so to the step); ``evaluate(planning="inline")`` adds each step's measured plan time,
    ``"ahead"`` (the default) nothing; bad values raise."""
    steps = [[[5, 3], [9, 1, 1], [2], []]]
    problem = PlanProblem(seq_lens=steps[0], layout="g2n2", model=WorkloadModel(d_model=2))
    plan = build_plan(problem, np.array([0, 0, 1, 1, 1, 0]), solver="hand")
    off, on = predict_step(plan, SHAPE, HW), predict_step(plan, SHAPE, HW, control_s=0.25)
    assert on.control_s == 0.25 and np.allclose(on.rank_s, off.rank_s + 0.25)
    assert on.step_s == pytest.approx(off.step_s + 0.25)
    with pytest.raises(ValueError, match="control_s"):
        predict_step(plan, SHAPE, HW, control_s=-1.0)
    ahead = evaluate(steps, "g2n2", SHAPE, HW)
    inline = evaluate(steps, "g2n2", SHAPE, HW, planning="inline")
    assert inline.step_s == pytest.approx(ahead.step_s + inline.plan_ms / 1e3, rel=1e-9)
    assert inline.plan_ms > 0
    with pytest.raises(ValueError, match="planning"):
        evaluate(steps, "g2n2", SHAPE, HW, planning="later")
