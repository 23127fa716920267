"""The side-by-side benchmark (data parallel / diffusers CP / knapformer) runs: a seconds-long
smoke run of its tiny inputs, where diffusers CP cannot run a case its row says so, and the
three methods' gradients agree."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_side_by_side_smoke(tmp_path):
    pytest.importorskip("diffusers", reason="diffusers is not installed (pip install 'knapformer[diffusers]')")
    out = tmp_path / "sbs.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "side_by_side.py"), "--smoke", "--repeats", "1"]
    cmd += ["--cases", "wan,qwenimage-odd", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    rows = {(r["case"], r["method"]): r for r in doc["rows"]}
    assert all(rows[("wan", m)]["status"] == "ok" for m in ("data parallel", "diffusers CP", "knapformer auto"))
    assert max(rows[("wan", m)]["grad_err"] for m in ("diffusers CP", "knapformer auto")) < 1e-5
    odd = rows[("qwenimage-odd", "diffusers CP")]
    assert odd["status"].startswith("cannot run") and "not divisible by 2" in odd["status"]
    assert rows[("qwenimage-odd", "knapformer auto")]["grad_err"] < 1e-5
    assert "qwenimage-odd" in doc["ulysses_anything"]
