"""The public API as data: every name the API reference documents (each module's ``__all__``)
with its signature — classes with their constructor and public methods. ``tests/api.json``
holds the snapshot of this release; ``tests/test_api_snapshot.py`` fails when the code
differs from it, until the snapshot is rewritten and CHANGELOG.md says what changed:

    python -m tests.api_snapshot --write     # after a deliberate API change (then edit CHANGELOG.md)
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import re
from pathlib import Path

SNAPSHOT = Path(__file__).resolve().parent / "api.json"
MODULES = (
    "knapformer",
    "knapformer.plan",
    "knapformer.data",
    "knapformer.training",
    "knapformer.executor",
    "knapformer.cluster",
    "knapformer.telemetry",
    "knapformer.errors",
    "knapformer.integrations",
    "knapformer.integrations.flux",
    "knapformer.integrations.flux2",
    "knapformer.integrations.wan",
    "knapformer.integrations.qwenimage",
    "knapformer.integrations.hunyuanvideo15",
    "knapformer.integrations.hunyuanvideo15_official",
    "knapformer.integrations.sd3",
    "knapformer.integrations.torchtitan_flux",
    "knapformer.integrations.automodel",
    "knapformer.integrations.automodel_data",
    "knapformer.integrations.family",
    "knapformer.integrations.seam",
    "knapformer.integrations.registry",
)
"""What docs/api.md documents."""


def _sig(obj) -> str:
    try:
        text = str(inspect.signature(obj))
    except (TypeError, ValueError):
        return "(?)"
    return re.sub(r" at 0x[0-9a-f]+", "", text)


def describe(obj) -> object:
    if inspect.isclass(obj):
        kinds = (classmethod, staticmethod)
        members = {
            name: _sig(member)
            for name, member in sorted(vars(obj).items())
            if not name.startswith("_") and (inspect.isfunction(member) or isinstance(member, kinds))
        }
        props = sorted(n for n, m in vars(obj).items() if not n.startswith("_") and isinstance(m, property))
        return {"class": _sig(obj), "methods": members, "properties": props}
    if callable(obj):
        return _sig(obj)
    return type(obj).__name__


def snapshot() -> dict:
    out = {}
    for name in MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError as exc:  # an optional dependency missing here
            out[name] = f"unavailable: {exc.name}"
            continue
        out[name] = {n: describe(getattr(module, n)) for n in sorted(getattr(module, "__all__", ()))}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--write", action="store_true", help=f"rewrite {SNAPSHOT.name}")
    args = p.parse_args()
    current = snapshot()
    if args.write:
        SNAPSHOT.write_text(json.dumps(current, indent=1, sort_keys=True) + "\n")
        print(f"wrote {SNAPSHOT}")
    else:
        print(json.dumps(current, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
