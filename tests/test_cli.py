"""The `knapformer plan` CLI: JSON in, JSON or a summary out, one-line errors."""

import contextlib
import json
import subprocess
import sys

import pytest

from knapformer.cli import main


def write(tmp_path, obj, name="in.json"):
    p = tmp_path / name
    p.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return str(p)


def test_plan_writes_json(tmp_path):
    inp = write(tmp_path, {"seq_lens": [[100, 20], [5], [900], []]})
    out = tmp_path / "plan.json"
    assert main(["plan", "--input", inp, "--bags", "g1n2+g2n1", "--d-model", "64", "--output", str(out)]) == 0
    plan = json.loads(out.read_text())
    for key in ("groups", "seq_group", "chunks", "time_before", "time_after", "lower_bound", "tokens_moved", "solver"):
        assert key in plan
    assert plan["groups"] == [[0], [1], [2, 3]]
    assert sum(row[3] for row in plan["chunks"]) == 1025
    assert all(len(row) == 5 for row in plan["chunks"])


def test_plan_json_written_before_the_time_rename_still_loads(tmp_path):
    """Plan files once named the per-rank times work_before/work_after; they still load."""
    from knapformer.plan import Plan

    inp = write(tmp_path, {"seq_lens": [[100, 20], [5]]})
    out = tmp_path / "plan.json"
    assert main(["plan", "--input", inp, "--bags", "g1n2", "--output", str(out)]) == 0
    d = json.loads(out.read_text())
    d["work_before"], d["work_after"] = d.pop("time_before"), d.pop("time_after")
    old = Plan.from_dict(d)
    old.validate()
    assert old.time_after.tolist() == d["work_after"]


def test_plan_json_written_before_the_groups_rename_still_loads(tmp_path):
    """Plan files once named the groups ``bags`` and ``seq_bag``; they still load, and the old
    attribute names still read the groups."""
    from knapformer.plan import Plan

    inp = write(tmp_path, {"seq_lens": [[100, 20], [5], [900], []]})
    out = tmp_path / "plan.json"
    assert main(["plan", "--input", inp, "--bags", "g1n2+g2n1", "--output", str(out)]) == 0
    d = json.loads(out.read_text())
    d["bags"], d["seq_bag"] = d.pop("groups"), d.pop("seq_group")
    old = Plan.from_dict(d)
    old.validate()
    assert old.groups == ((0,), (1,), (2, 3)) and old.bags == old.groups
    assert old.seq_group.tolist() == d["seq_bag"] and old.seq_bag is old.seq_group


def test_plan_prints_summary(tmp_path, capsys):
    inp = write(tmp_path, {"seq_lens": [[100, 20], [5]]})
    assert main(["plan", "--input", inp, "--bags", "g1n2", "--solver", "paper", "--causal"]) == 0
    text = capsys.readouterr().out
    assert "imbalance" in text and "solver paper" in text


@pytest.mark.parametrize(
    "content, bags, message",
    [
        (None, "g1n2", "cannot read input file"),
        ("{not json", "g1n2", "is not valid JSON"),
        ({"lens": []}, "g1n2", "must be a JSON object with key 'seq_lens'"),
        ({"seq_lens": 5}, "g1n2", "'seq_lens' must be a list"),
        ({"seq_lens": [[1, 2.5], [3]]}, "g1n2", r"seq_lens\[0\]\[1\] = 2.5 is not an integer"),
        ({"seq_lens": [[1, -2], [3]]}, "g1n2", r"seq_lens\[0\]\[1\] = -2 must be a positive length"),
        ({"seq_lens": [[1], [3]]}, "g1n2+x", "malformed bag term 'x'"),
        ({"seq_lens": [[1], [3]]}, "g1n3", "seq_lens has 2 ranks but the bag layout's group has 3"),
    ],
)
def test_bad_input_exits_with_one_line(tmp_path, capsys, content, bags, message):
    inp = str(tmp_path / "missing.json") if content is None else write(tmp_path, content)
    assert main(["plan", "--input", inp, "--bags", bags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert pytest.importorskip("re").search(message, err), err


def test_entry_point_runs_without_traceback(tmp_path):
    inp = write(tmp_path, {"seq_lens": [[0]]})
    res = subprocess.run(
        [sys.executable, "-m", "knapformer", "plan", "--input", inp, "--bags", "g1n1"], capture_output=True, text=True
    )
    assert res.returncode == 2
    assert "Traceback" not in res.stderr and "must be a positive length" in res.stderr


def test_plan_demo_writes_table_and_chart(tmp_path, capsys):
    assert main(["plan-demo", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "table.json").read_text())
    assert len(rows) == 3 * 4 * 2
    assert all(r["imbalance_after"] <= r["imbalance_before"] + 1e-12 for r in rows)
    assert (tmp_path / "rank_work.png").stat().st_size > 0
    assert "paper-joint" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["plan", "--bags", "g1n2", "--solver", "exact", "--max-tokens", "2"], "max_tokens_per_rank=2 is infeasible"),
        (["plan", "--bags", "g1n2", "--rank-speed", "fast,1"], "argument --rank-speed: entry 0 'fast'"),
        (["plan", "--bags", "g1n2", "--max-tokens", "-3"], "argument --max-tokens: '-3' must be >= 1"),
        (["plan", "--bags", "g1n2", "--gamma", "nan"], "argument --gamma: 'nan' is not a finite number"),
        (["simulate", "--ranks", "2", "--bags", "g3n1"], "is not divisible by the group size 3"),
        (["simulate", "--ranks", "2", "--rank-speed", "1,1,1"], "rank_speed has 3 entries for 2 ranks"),
        (["simulate", "--ranks", "2", "--solver", "nope"], "argument --solver: invalid choice: 'nope'"),
        (
            ["cluster", "--mix", "paper-joint", "--gpus", "32", "--model", "flux", "--fixed-s", "-5"],
            "argument --fixed-s: '-5' must be >= 0",
        ),
        (
            ["cluster", "--mix", "paper-joint", "--gpus", "32", "--model", "flux", "--fixed-s", "nan"],
            "argument --fixed-s: 'nan' is not a finite number",
        ),
        (
            ["cluster", "--mix", "paper-joint", "--gpus", "32", "--model", "flux", "--efficiency", "0"],
            "argument --efficiency: '0' must be > 0",
        ),
        (
            ["cluster", "--mix", "paper-joint", "--gpus", "32", "--model", "flux", "--rank-speed", "1,2"],
            "--rank-speed has 2 entries for --gpus 32",
        ),
    ],
)
def test_every_bad_value_is_one_line_naming_it(tmp_path, capsys, argv, message):
    if argv[0] == "plan":
        argv = [*argv, "--input", write(tmp_path, {"seq_lens": [[3, 3], [2, 2, 2]]})]
    with pytest.raises(SystemExit) if "argument" in message else contextlib.nullcontext():
        code = main(argv)
        assert code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert message in err, err


@pytest.mark.parametrize("flag", ["--input", "--profile"])
def test_non_utf8_files_are_named(tmp_path, capsys, flag):
    bad = tmp_path / "latin1.json"
    bad.write_bytes(b'{"seq_lens": [[1]], "x": "\xe9"}')
    good = write(tmp_path, {"seq_lens": [[1], [2]]})
    argv = ["plan", "--bags", "g1n2", "--input", str(bad) if flag == "--input" else good]
    if flag == "--profile":
        argv += ["--profile", str(bad)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert str(bad) in err and "not UTF-8" in err and len(err.splitlines()) == 1, err


def test_simulate_and_cluster_help_expose_the_balancer_settings(capsys):
    for command in ("simulate", "cluster"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = capsys.readouterr().out
        for flag in ("--solver", "--max-tokens", "--rank-speed", "--attn-backend", "--profile", "--bags"):
            assert flag in text, (command, flag)


def test_show_draws_bag_and_group_plans(tmp_path, capsys):
    """knapformer show writes a PNG for a bag-layout plan and for a per-sequence (auto) plan."""
    inp = write(tmp_path, {"seq_lens": [[4096, 256], [1024], [16384], [64, 64, 64], [9], [], [300, 3], [7]]})
    for layout in ("g1n4+g2n2", "auto"):
        plan_file = tmp_path / f"{layout}.json"
        argv = ["plan", "--input", inp, "--bags", layout, "--heads", "8", "--hardware", "h100"]
        assert main([*argv, "--output", str(plan_file)]) == 0
        png = tmp_path / f"{layout}.png"
        assert main(["show", str(plan_file), "-o", str(png)]) == 0
        assert png.stat().st_size > 5000
    from knapformer.plan import Plan

    auto = Plan.from_json((tmp_path / "auto.json").read_text())
    assert auto.cost_model is not None and auto.cost_model.num_heads == 8


def test_show_refuses_a_broken_plan(tmp_path, capsys):
    inp = write(tmp_path, {"seq_lens": [[40], [3]]})
    plan_file = tmp_path / "p.json"
    assert main(["plan", "--input", inp, "--bags", "g2n1", "--output", str(plan_file)]) == 0
    d = json.loads(plan_file.read_text())
    d["chunks"] = d["chunks"][1:]
    plan_file.write_text(json.dumps(d))
    assert main(["show", str(plan_file), "-o", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert "does not start at token 0" in err and len(err.strip().splitlines()) == 1, err
