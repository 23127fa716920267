"""Validate the cluster model against (1) the paper's 32-GPU result and (2) measured CPU runs.

    python benchmarks/cluster_validation.py [--skip-cpu] [--out runs/bench/cluster_validation.json]

(1) Flux preset, paper-joint mix, 32 H100 (preset hardware, efficiency 0.5, nothing outside
    the blocks), g8n4 vs none; the paper reports 8.05 s -> 3.44 s (2.34x), HFU 12.69% -> 29.74%.
    Also solves for the efficiency and per-step fixed time that would reproduce both paper
    step times, as a reading of where the difference comes from.
(2) The simulator's 2-rank CPU demo (mmdit-small, g2n1) is run for real and predicted from
    the CPU calibration profile and the measured gloo loopback link (hardware cpu-gloo).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_json  # noqa: E402

from knapformer.cluster import ModelShape, hardware, predict_step, predict_unbalanced  # noqa: E402
from knapformer.cluster.search import evaluate  # noqa: E402
from knapformer.data import sample_seq_lens  # noqa: E402
from knapformer.data.codes import resolve_mix, sample_batches  # noqa: E402
from knapformer.model_configs import preset  # noqa: E402
from knapformer.plan import plan_sequences  # noqa: E402
from knapformer.workload import WorkloadModel  # noqa: E402

PAPER = {"none_s": 8.05, "g8n4_s": 3.44, "none_hfu": 0.1269, "g8n4_hfu": 0.2974}


def paper_validation(steps: int) -> dict:
    shape = ModelShape.from_config(preset("flux"))
    hw = hardware("h100")
    lens = [sample_seq_lens("paper-joint", seed=0, step=s) for s in range(steps)]
    none = evaluate(lens, "none", shape, hw)
    g8 = evaluate(lens, "g8n4", shape, hw)
    # what efficiency e and fixed time F make  none = C_none/e + F  and  g8n4 = C_g8/e + comm + F ?
    c_none = none.step_s * hw.efficiency  # compute seconds at efficiency 1
    comm = g8.step_s * g8.comm_share
    c_g8 = (g8.step_s - comm) * hw.efficiency
    e = (c_none - c_g8) / (PAPER["none_s"] - PAPER["g8n4_s"] - comm)
    fixed = PAPER["none_s"] - c_none / e
    out = {
        "pred_none_s": none.step_s,
        "pred_g8n4_s": g8.step_s,
        "pred_speedup": none.step_s / g8.step_s,
        "pred_none_hfu": none.hfu,
        "pred_g8n4_hfu": g8.hfu,
        "pred_comm_share": g8.comm_share,
        "paper_speedup": PAPER["none_s"] / PAPER["g8n4_s"],
        **{f"paper_{k}": v for k, v in PAPER.items()},
        "implied_efficiency": e,
        "implied_fixed_s": fixed,
    }
    print("(1) Flux, paper-joint, 32 x H100, g8n4 vs none")
    print(
        f"    step time  none {none.step_s:6.2f} s (paper {PAPER['none_s']:.2f})   g8n4 {g8.step_s:6.2f} s "
        f"(paper {PAPER['g8n4_s']:.2f})"
    )
    print(f"    speedup    {out['pred_speedup']:.2f}x (paper {out['paper_speedup']:.2f}x)")
    print(
        f"    HFU        none {none.hfu:.1%} (paper {PAPER['none_hfu']:.2%})   g8n4 {g8.hfu:.1%} "
        f"(paper {PAPER['g8n4_hfu']:.2%});  comm share {g8.comm_share:.1%}"
    )
    print(
        f"    both paper step times follow from efficiency {e:.2f} and {fixed:.2f} s per step outside the "
        f"blocks (optimizer, FSDP traffic of a 12B model), which the preset leaves out"
    )
    return out


def cpu_validation(steps: int, warmup: int) -> dict:
    from knapformer.tools.sim_config import DEMO_MIX, SimConfig
    from knapformer.tools.simulate import simulate

    profile_path = Path(__file__).resolve().parent.parent / "profiles" / "cpu-mmdit-small.json"
    profile = WorkloadModel.from_profile(profile_path)
    cfg = SimConfig(
        ranks=2,
        mix=DEMO_MIX,
        scale=2,
        bags="g2n1",
        model="mmdit-small",
        steps=steps,
        warmup=warmup,
        peak_tflops=0.05,
        progress=False,
        profile=str(profile_path),
    )
    rep = simulate(cfg)
    shape = ModelShape.from_config(preset("mmdit-small"))
    shape = ModelShape(dim=shape.dim, heads=shape.heads, layers=shape.layers, bytes_per_value=4)  # fp32 on CPU
    hw = hardware("cpu-gloo")
    u_pred, b_pred, b_parts = [], [], []
    for step in range(warmup, warmup + steps):
        batches = sample_batches(resolve_mix(DEMO_MIX), seed=cfg.seed, step=step, scale=cfg.scale, num_ranks=2)
        lens = [[v + t for v, t in r] for r in batches]
        u_pred.append(predict_unbalanced(lens, shape, hw, profile=profile).step_s)
        plan = plan_sequences(lens, "g2n1", profile)
        bp = predict_step(plan, shape, hw, profile=profile)
        b_pred.append(bp.step_s)
        r = int(bp.rank_s.argmax())  # the rank that sets the step time
        b_parts.append([bp.compute_s[r], bp.route_s[r] + bp.ulysses_s[r], bp.sync_s[r]])
    pred = sum(u_pred) / sum(b_pred)
    meas = rep["speedup"]
    out = {
        "pred_unbalanced_s": sum(u_pred) / steps,
        "pred_balanced_s": sum(b_pred) / steps,
        "meas_unbalanced_s": rep["modes"]["unbalanced"]["step_time"],
        "meas_balanced_s": rep["modes"]["balanced"]["step_time"],
        "pred_speedup": pred,
        "meas_speedup": meas,
        "rel_error": pred / meas - 1,
        # where the balanced time goes: predicted compute / comm / sync-wait of the slowest rank,
        # measured busy (thread CPU time of fwd+bwd) and the rest of the step (waits, optimizer)
        "pred_balanced_parts_s": [sum(p[i] for p in b_parts) / steps for i in range(3)],
        "meas_balanced_busy_s": max(rep["modes"]["balanced"]["busy_per_rank"]),
        "meas_unbalanced_busy_mean_s": sum(rep["modes"]["unbalanced"]["busy_per_rank"]) / 2,
    }
    print("(2) simulator on 2 CPU ranks (mmdit-small, g2n1), profile profiles/cpu-mmdit-small.json, cpu-gloo link")
    print(
        f"    step time  unbalanced pred {out['pred_unbalanced_s']:.2f} s / meas {out['meas_unbalanced_s']:.2f} s; "
        f"balanced pred {out['pred_balanced_s']:.2f} s / meas {out['meas_balanced_s']:.2f} s"
    )
    c, m, j = out["pred_balanced_parts_s"]
    busy = out["meas_balanced_busy_s"]
    print(
        f"    balanced   pred compute {c:.2f} + comm {m:.2f} + sync wait {j:.2f} s; "
        f"meas busy {busy:.2f} + rest {out['meas_balanced_s'] - busy:.2f} s "
        f"(unbalanced busy mean {out['meas_unbalanced_busy_mean_s']:.2f} s)"
    )
    print(f"    speedup    predicted {pred:.3f}x, measured {meas:.3f}x  ->  error {out['rel_error']:+.1%}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3, help="sampled steps for (1)")
    ap.add_argument("--cpu-steps", type=int, default=20)
    ap.add_argument("--skip-cpu", action="store_true")
    ap.add_argument("--out", default="runs/bench/cluster_validation.json")
    args = ap.parse_args()
    rows = [{"check": "paper", **paper_validation(args.steps)}]
    if not args.skip_cpu:
        rows.append({"check": "cpu", **cpu_validation(args.cpu_steps, 2)})
    write_json(args.out, rows)


if __name__ == "__main__":
    main()
