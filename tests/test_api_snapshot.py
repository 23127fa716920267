"""The documented API is a contract: its names and signatures equal the snapshot of this
release (tests/api.json), and CHANGELOG.md has a section for the version. A change fails here
until the snapshot is rewritten (``python -m tests.api_snapshot --write``) and the changelog
says what changed."""

import json
import re
from pathlib import Path

import knapformer
from tests.api_snapshot import SNAPSHOT, snapshot

ROOT = Path(__file__).resolve().parent.parent


def test_the_public_api_equals_its_snapshot():
    want = json.loads(SNAPSHOT.read_text())
    got = snapshot()
    diffs = []
    for module in sorted(set(want) | set(got)):
        a, b = want.get(module), got.get(module)
        if isinstance(a, str) or isinstance(b, str):  # an optional dependency missing on one side
            continue
        if a is None or b is None:
            diffs.append(f"{module}: {'added' if a is None else 'removed'}")
            continue
        for name in sorted(set(a) | set(b)):
            if a.get(name) != b.get(name):
                diffs.append(f"{module}.{name}: {a.get(name)} -> {b.get(name)}")
    assert not diffs, (
        "the public API changed; if on purpose, run `python -m tests.api_snapshot --write` and record it in "
        "CHANGELOG.md:\n" + "\n".join(diffs[:40])
    )


def test_the_changelog_has_this_version():
    text = (ROOT / "CHANGELOG.md").read_text()
    assert re.search(rf"^## \[{re.escape(knapformer.__version__)}\]", text, re.M), knapformer.__version__
    assert "VarlenArgs" in text  # the change that broke users: pre_attn's 5-tuple
