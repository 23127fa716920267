"""How fast every survivor learns that a rank died, and how long its process takes to exit:
4 gloo ranks, one SIGKILLed at each of five points of a step (plan's gathers, the route, a
layer's Ulysses exchange, a ring round, the reverse route), repeated; ranks forked from the
test forkserver (they exit at once, through ``os._exit``).

    python benchmarks/peer_loss_spread.py --repeats 6      # ~2 minutes on 2 vCPUs

Prints per phase the min / median / max over survivors and repeats of (a) seconds from the
start of the step to the survivor's ``PeerLostError`` and (b) seconds from that error to its
process's exit, and how often a survivor named another survivor as dead (must be 0); writes
JSON to ``runs/peer_loss_spread.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests import peer_workers as W  # noqa: E402
from tests.test_peer_loss import BOUND_S, _run  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--out", default=str(ROOT / "runs" / "peer_loss_spread.json"))
    args = p.parse_args(argv)
    rows, wrong = {}, 0
    victims = (3, 1, 2, 0, 3)
    for phase, victim in zip(W.PHASES, victims):
        detect, leave = [], []
        for _ in range(args.repeats):
            reports, exited = _run(4, victim, phase, "kill", BOUND_S)
            for r, rep in reports.items():
                detect.append(rep["secs"])
                if r in exited:
                    leave.append(exited[r]["at"] - rep["at"])
                if f"rank(s) [{victim}]" not in rep["msg"]:
                    wrong += 1
        rows[phase] = {"detect_s": detect, "exit_s": leave}
    print(f"{'phase':14s} {'raise after (min/median/max s)':>32s} {'exit after raise (min/median/max s)':>38s}")
    for phase, r in rows.items():
        d, e = r["detect_s"], r["exit_s"]
        print(
            f"{phase:14s} {min(d):10.3f} {statistics.median(d):9.3f} {max(d):9.3f}"
            f" {min(e):14.3f} {statistics.median(e):9.3f} {max(e):9.3f}"
        )
    print(f"survivor reports naming a rank other than the victim: {wrong}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"repeats": args.repeats, "rows": rows, "misnamed": wrong}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
