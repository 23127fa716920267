"""The training simulator: report arithmetic, bad input, and a tiny real run on 2 gloo ranks."""

import json

import pytest

from knapformer.cli import main
from knapformer.tools.sim_config import SimConfig
from knapformer.tools.simulate import format_report, simulate, summarize


def _records(mode_times):
    """Synthetic per-rank records: {mode: [[busy rank0, busy rank1] per step]} (wall = max busy)."""
    per_rank = []
    for rank in range(2):
        recs = []
        for mode, steps in mode_times.items():
            for step, busy in enumerate(steps):
                r = {
                    "step": step,
                    "mode": mode,
                    "wall": max(busy),
                    "busy": busy[rank],
                    "loss": 1.0 + step,
                    "plan_s": 0.001,
                    "fwd_bwd_wall": busy[rank],
                    "tokens": 100,
                    "flops": 1e9,
                }
                if mode == "balanced":
                    r.update(pred_before=0.5, pred_after=0.01)
                recs.append(r)
        per_rank.append({"rank": rank, "records": recs, "peak": 1e10})
    return per_rank


def test_summary_arithmetic():
    cfg = SimConfig(steps=2, warmup=1)
    rep = summarize(cfg, _records({"unbalanced": [[9, 9], [1, 3], [1, 3]], "balanced": [[9, 9], [2, 2.5], [2, 2.5]]}))
    u, b = rep["modes"]["unbalanced"], rep["modes"]["balanced"]
    assert u["step_time"] == 3 and b["step_time"] == 2.5  # warm-up step excluded
    assert rep["speedup"] == pytest.approx(1.2)
    assert rep["ideal_speedup"] == pytest.approx(1.5)  # 3 / mean(1, 3)
    assert u["tokens_per_s"] == pytest.approx(400 / 6)
    assert u["hfu"] == pytest.approx(4e9 / (6 * 2e10))
    assert rep["loss_match"] and rep["loss_max_rel_diff"] == 0
    assert "speedup 1.200x" in format_report(rep)
    assert rep["speedup_over_ideal_per_step"] == pytest.approx([(3 / 2.5) / 1.5] * 2)
    assert "step by step: 80.0% .. 80.0% of ideal (median 80.0%)" in format_report(rep)


def test_per_step_ratio_to_ideal():
    # step 0: speedup 3/2 over ideal 3/2; step 1: speedup 2/1 over ideal 2/2
    records = _records({"unbalanced": [[1, 3], [2, 2]], "balanced": [[2, 2], [1, 1]]})
    rep = summarize(SimConfig(steps=2, warmup=0), records)
    assert rep["speedup_over_ideal_per_step"] == pytest.approx([1.0, 2.0])
    assert "step by step: 100.0% .. 200.0% of ideal (median 150.0%)" in format_report(rep)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"ranks": 0}, "ranks must be >= 1"),
        ({"steps": 0}, "steps must be >= 1"),
        ({"device": "tpu"}, "device must be 'cpu' or 'cuda'"),
        ({"mix": "g2b1i256"}, "malformed data code"),
        ({"mix": "paper-lowres", "ranks": 2}, "describes 32 ranks; 2 ranks is not a multiple"),
    ],
)
def test_bad_config(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SimConfig(**kwargs)


def test_cli_rejects_unknown_model(capsys):
    assert main(["simulate", "--model", "nope", "--no-progress"]) == 2
    assert "unknown model preset 'nope'" in capsys.readouterr().err


def test_tiny_run_on_two_ranks(tmp_path):
    cfg = SimConfig(
        ranks=2,
        model="mmdit-tiny",
        mix="g1b3i64f1s0,g1b1i512f1s0",  # ~150 tokens vs ~300: the ranks start unbalanced
        scale=2,
        steps=2,
        warmup=0,
        peak_tflops=0.01,
        progress=False,
        recalibrate=True,
        recalibrate_warmup=0,  # so step 2 already plans with the model refitted from step 1
    )
    rep = simulate(cfg)
    assert rep["loss_match"], rep["loss_max_rel_diff"]
    assert 0.0 <= rep["machine"]["other_cpu_share"] <= 1.0 and rep["machine"]["cpus"] >= 1
    b, u = rep["modes"]["balanced"], rep["modes"]["unbalanced"]
    assert b["predicted_imbalance_after"] < b["predicted_imbalance_before"]
    # the balanced run really ran balanced: one bag of both ranks splits every sequence, so the
    # ranks compute on token counts within one of each other, while unbalanced ranks keep theirs
    routed = b["routed_tokens_per_rank"]
    assert max(routed) - min(routed) <= 1 and sum(routed) == sum(u["routed_tokens_per_rank"])
    assert max(u["routed_tokens_per_rank"]) - min(u["routed_tokens_per_rank"]) > 10
    assert b["plans_per_rank_step"] == 1 and u["plans_per_rank_step"] == 0
    assert rep["speedup"] == pytest.approx(u["step_time"] / b["step_time"])
    from knapformer.tools.simulate import write_outputs

    write_outputs(rep, str(tmp_path / "r.json"), str(tmp_path), str(tmp_path / "m.jsonl"))
    assert json.loads((tmp_path / "r.json").read_text())["world"] == 2
    for png in ("busy_per_rank.png", "first_plan.png", "predicted_vs_measured.png"):
        assert (tmp_path / png).stat().st_size > 0
    # telemetry: one JSON record per balanced step, measured and predicted per rank
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert len(r["measured_s"]) == 2 and all(s > 0 for s in r["measured_s"]) and len(r["predicted"]) == 2
        for key in (
            "plan_ms",
            "imbalance_before",
            "imbalance_after",
            "measured_imbalance",
            "gap_to_bound",
            "tokens_moved",
            "bytes_moved",
            "coefficients",
        ):
            assert r[key] is not None, key
    assert records[1]["coefficients"]["units"] == "seconds per layer"  # refitted from step 1's timing


def test_a_users_own_model_factory_runs_through_simulate_and_calibrate(tmp_path):
    """``--model package.module:callable``: the tools take a user's ModelFamily without any
    registry line (the same seam as the integrations)."""
    from knapformer.cli import main

    out = tmp_path / "p.json"
    args = ["calibrate", "--model", "tests.custom_family:make", "--output", str(out), "--repeats", "1"]
    assert main([*args, "--lengths", "16", "32", "64", "--holdout", "48", "--no-progress"]) == 0
    assert out.exists()
    rep = simulate(
        SimConfig(
            ranks=2,
            model="tests.custom_family:make",
            mix="g1b4i128f1s0,g1b1i256f1s0",
            bags="auto",
            scale=4,
            steps=1,
            warmup=0,
            peak_tflops=0.01,
            progress=False,
        )
    )
    assert rep["loss_match"]


def test_a_bad_model_factory_is_a_clear_error():
    from knapformer.integrations.registry import resolve_model

    with pytest.raises(ValueError, match="cannot import 'no_such_module'"):
        resolve_model("no_such_module:make")
    with pytest.raises(ValueError, match="has no 'nope'"):
        resolve_model("tests.custom_family:nope")
    with pytest.raises(ValueError, match="must return a knapformer.integrations.family.ModelFamily"):
        resolve_model("tests.custom_family:TinyDiT")
    with pytest.raises(ValueError, match="unknown model preset 'diffusers-flux-huge'"):
        resolve_model("diffusers-flux-huge")


def test_auto_runs_a_long_sequence_as_a_ring_with_two_heads():
    """``simulate --ranks 4 --bags auto`` with a 2-head model and one sequence much longer than
    the rest: the planner puts it on all 4 ranks as a ring of 2 Ulysses pairs, the step is
    balanced, and the losses equal the unbalanced run's."""
    cfg = SimConfig(
        ranks=4,
        model="mmdit-2head",
        mix="g3b4i128f1s0,g1b1i512f4s0",  # 4 × 64 tokens per rank vs one 4,096-token video
        scale=1,
        bags="auto",
        steps=1,
        warmup=0,
        peak_tflops=0.01,
        progress=False,
    )
    rep = simulate(cfg)
    assert rep["loss_match"], rep["loss_max_rel_diff"]
    plan = rep["first_plan"]
    rings = [(len(plan["groups"][g]), plan["ring"][g]) for g in set(plan["seq_group"]) if plan["ring"]]
    assert (4, 2) in rings, rings
    b = rep["modes"]["balanced"]
    assert b["predicted_imbalance_after"] < 0.1 < b["predicted_imbalance_before"]
    assert "ring 2 × Ulysses 2" in format_report(rep)


def test_a_busy_machine_is_named_and_the_busy_time_balance_leads():
    """``make demo`` with other processes holding the cores reported "speedup 0.945x ... 51.2%
    of ideal" as if balancing were slower (issue 59, item 17). When others used at least 15%
    of the machine's CPU during the run, the report says so first and leads with the busy-time
    balance; on a quiet machine it reads as before."""
    from knapformer.tools.simulate import BUSY_MACHINE, machine_busy_seconds, other_cpu_share

    records = _records({"unbalanced": [[1, 3], [2, 2]], "balanced": [[2, 2], [1, 1]]})
    rep = summarize(SimConfig(steps=2, warmup=0), records)
    quiet = format_report(rep)
    rep["machine"] = {"cpus": 2, "other_cpu_share": 0.05}
    assert format_report(rep) == quiet and "NOTE" not in quiet
    rep["machine"]["other_cpu_share"] = 0.4
    lines = format_report(rep).splitlines()
    assert lines[0].startswith("NOTE: other processes used 40% of this machine's 2 CPUs"), lines[0]
    u, b = rep["modes"]["unbalanced"]["busy_max_over_mean"], rep["modes"]["balanced"]["busy_max_over_mean"]
    assert f"max/mean {u:.3f} unbalanced -> {b:.3f} balanced" in lines[1]
    assert lines[2:] == quiet.splitlines()
    # the share: what the machine was busy with beyond this run's own CPU seconds
    assert other_cpu_share(busy_s=3.0, own_s=1.0, wall_s=2.0, cpus=2) == pytest.approx(0.5)
    assert other_cpu_share(busy_s=1.0, own_s=1.5, wall_s=2.0, cpus=2) == 0.0  # clock granularity
    assert other_cpu_share(busy_s=9.0, own_s=0.0, wall_s=1.0, cpus=2) == 1.0
    assert 0 < BUSY_MACHINE < 1 and (machine_busy_seconds() or 0.0) >= 0.0
