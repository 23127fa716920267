"""The paired A/B benchmark of the attention exchanges runs against a staged copy of a checkout
(here this one: an A/A run) and compares only identical plans."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "pre_post_ab.py"


def test_staged_baseline_imports_only_itself(tmp_path):
    spec = importlib.util.spec_from_file_location("pre_post_ab", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    staged = mod.stage_baseline(str(ROOT), tmp_path) / mod.BASE
    sources = [f.read_text() for f in staged.rglob("*.py")]
    assert sources and any(f"from {mod.BASE}." in s for s in sources)
    assert not any("from knapformer." in s or "import knapformer\n" in s for s in sources)


def test_pre_post_ab_runs_paired(tmp_path):
    out = tmp_path / "ab.json"
    cmd = [sys.executable, str(SCRIPT), "--baseline", str(ROOT), "--ranks", "2", "--iters", "3", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    expected = sorted((k, op) for k in (0, 1) for op in ("pre", "post", "trip"))
    assert sorted((r["rank"], r["op"]) for r in rows) == expected
    assert all(r["same"] and r["new/old"] > 0 and r["old_ms"] > 0 for r in rows)
    assert "2 ranks trip: new/old" in proc.stdout
