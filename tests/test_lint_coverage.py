"""Every Python file of the project is seen by the linter.

ruff silently skips folders it treats as build output (``dist``, ``build``, ``.venv``, ...), so
a package folder with such a name would never be linted: the executor once lived in
``knapformer/dist/`` and 4 of 47 package files went unchecked for months. This test compares
what ruff says it checks with the files on disk, for the folders ``make test`` lints.
"""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINTED = ("knapformer", "tests", "benchmarks", "examples")  # what `make test` runs ruff on


def _on_disk() -> set[str]:
    files = set()
    for top in LINTED:
        for p in (ROOT / top).rglob("*.py"):
            if "__pycache__" not in p.parts:
                files.add(str(p.relative_to(ROOT)))
    return files


def _seen_by_ruff() -> set[str]:
    out = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--show-files", *LINTED],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return {str(Path(line).resolve().relative_to(ROOT)) for line in out.stdout.splitlines() if line.endswith(".py")}


def test_ruff_lints_every_python_file():
    on_disk, seen = _on_disk(), _seen_by_ruff()
    assert len(on_disk) > 40
    missing = sorted(on_disk - seen)
    assert missing == [], f"ruff does not lint {len(missing)} file(s) (excluded folder name?): {missing[:10]}"
