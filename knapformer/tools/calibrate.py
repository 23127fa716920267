"""Calibrate the workload model: time the model's real blocks, fit ``a·L + b·L² + c``.

    knapformer calibrate --model mmdit-tiny --output profile.json           # CPU, fwd+bwd
    knapformer calibrate --model flux --device cuda --output flux_h100.json --plot fit.png
    knapformer plan --input lens.json --bags g1n4+g2n2 --profile profile.json

Each block type of the preset (Transformer block; MMDiT double and single blocks separately)
is timed on packed batches — single sequences over a spread of lengths plus mixed
compositions — with warm-up and repeats (median; CUDA events on GPU). The per-layer profile is
the layer-count-weighted mix of the block fits. Held-out lengths and compositions, never used
in the fit, are predicted and compared (R², median and max |relative error|), next to the
paper-style fit (single sequences, forward only in the paper, no intercept); the held-out
compositions also measure *additivity* (packed batch time vs the sum of its sequences'
predicted costs), which the planner assumes.
"""

from __future__ import annotations

import argparse
import datetime
import math
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from knapformer.integrations.registry import resolve_model
from knapformer.tools.calibrate_args import add_args
from knapformer.tools.cli_support import progress as cli_progress
from knapformer.tools.cli_support import run_tool
from knapformer.workload import WorkloadModel
from knapformer.workload_fit import Fit, Timing, check_lengths, fit_cost, fit_paper_style

__all__ = ["DEFAULT_FIT", "DEFAULT_HOLDOUT", "add_args", "calibrate", "main", "run"]

DEFAULT_FIT = [16, 32, 64, 128, 256, 512, 768, 1024, 1536, 2048]
DEFAULT_HOLDOUT = [48, 96, 192, 384, 640, 1280]
FIT_MIXES = [[64] * 8, [128] * 4, [32] * 16, [256, 256, 512], [1024, 64, 64]]
HOLDOUT_MIXES = [[96] * 6, [512, 128, 32], [48] * 12, [768, 256]]
_BYTES_PER_TOKEN_DIM = 4 * 48  # fp32 activations kept for backward, generously


def _available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def check_memory(batches: Sequence[Sequence[int]], dim: int, device: torch.device) -> None:
    """Refuse, before allocating, batches whose activations would not fit in memory."""
    worst = max(batches, key=sum)
    need = sum(worst) * dim * _BYTES_PER_TOKEN_DIM
    avail = _available_bytes(device)
    if need > avail // 2:
        raise ValueError(
            f"lengths too large for memory: a batch of {sum(worst)} tokens needs ~{need / 2**30:.1f} GiB "
            f"on {device}, {avail / 2**30:.1f} GiB available"
        )


class _Timer:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def loops_for(self, fn, *, warmup: int = 1, min_seconds: float = 0.05) -> int:
        """Calls per measurement so that one lasts at least ``min_seconds`` (timer and
        scheduler noise dominate below); runs ``fn`` ``warmup`` times first."""
        first = 1.0
        for _ in range(max(warmup, 1)):
            first = self.once(fn, 1)
        return max(1, min(64, math.ceil(min_seconds / max(first, 1e-6))))

    def once(self, fn, inner: int) -> float:
        """Seconds per call of ``fn`` over ``inner`` calls."""
        if self.device.type == "cuda":
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(inner):
                fn()
            e.record()
            e.synchronize()
            return s.elapsed_time(e) / 1e3 / inner
        t = time.thread_time()
        for _ in range(inner):
            fn()
        return (time.thread_time() - t) / inner


def calibrate(
    model_name: str,
    *,
    device: str = "cpu",
    mode: str = "fwd+bwd",
    causal: bool = False,
    lengths: Sequence[int] | None = None,
    holdout: Sequence[int] | None = None,
    fit_mixes: Sequence[Sequence[int]] | None = None,
    holdout_mixes: Sequence[Sequence[int]] | None = None,
    repeats: int = 7,
    warmup: int = 1,
    progress: bool = True,
) -> tuple[WorkloadModel, dict]:
    """Measure, fit and evaluate; returns the profile and a report dict."""
    family = resolve_model(model_name)
    cfg, dims = family.config, family.dims()
    if mode not in ("fwd", "fwd+bwd"):
        raise ValueError(f"mode must be 'fwd' or 'fwd+bwd', got {mode!r}")
    if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 0:
        raise ValueError(f"warmup must be an int >= 0, got {warmup!r}")
    lengths = check_lengths(list(lengths) if lengths is not None else DEFAULT_FIT, "lengths")
    holdout = check_lengths(list(holdout) if holdout is not None else DEFAULT_HOLDOUT, "holdout")
    fit_mixes = [check_lengths(list(m), "fit mix") for m in (fit_mixes if fit_mixes is not None else FIT_MIXES)]
    holdout_mixes = [
        check_lengths(list(m), "holdout mix") for m in (holdout_mixes if holdout_mixes is not None else HOLDOUT_MIXES)
    ]
    if len(set(lengths)) < 3:
        raise ValueError(f"need at least 3 distinct fit lengths, got {sorted(set(lengths))}")
    dev = torch.device(device if device != "cuda" else f"cuda:{torch.cuda.current_device()}")
    if dev.type == "cpu":
        # thread CPU time sees only this thread: time one-threaded, as each simulator rank runs
        torch.set_num_threads(1)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    runners = family.blocks(dev, dtype, causal)  # raises for families without block timing
    fit_batches = [[n] for n in lengths] + fit_mixes
    held_batches = [[n] for n in holdout] + holdout_mixes
    check_memory(fit_batches + held_batches, dims.dim, dev)
    timer = _Timer(dev)
    backward = mode == "fwd+bwd"
    per_block = {}
    for name, count, make in runners:
        if count == 0:
            continue
        # round-robin over batches, so slow drift of the machine hits every batch alike
        batches = fit_batches + held_batches
        inner = [timer.loops_for(make(b, backward), warmup=warmup) for b in batches]
        samples: list[list[float]] = [[] for _ in batches]
        for _ in cli_progress(range(repeats), desc=f"{name} blocks: rounds", enabled=progress):
            for i, b in enumerate(batches):
                samples[i].append(timer.once(make(b, backward), inner[i]))
        times = [Timing(tuple(b), statistics.median(v)) for b, v in zip(batches, samples)]
        fit_t, held_t = times[: len(fit_batches)], times[len(fit_batches) :]
        ours, paper = fit_cost(fit_t), fit_paper_style(fit_t)
        held_single = [t for t in held_t if len(t.seq_lens) == 1]
        held_mixed = [t for t in held_t if len(t.seq_lens) > 1]
        per_block[name] = {
            "layers": count,
            "fit": {"a": ours.a, "b": ours.b, "c": ours.c, "d": ours.d},
            "paper_fit": {"a": paper.a, "b": paper.b},
            "heldout": ours.errors(held_t),
            "heldout_paper": paper.errors(held_t),
            "additivity": ours.errors(held_mixed) if held_mixed else None,
            "timings": [[list(t.seq_lens), t.seconds] for t in fit_t + held_t],
            "num_fit": len(fit_t),
            "heldout_single": ours.errors(held_single) if held_single else None,
        }
    layers = sum(v["layers"] for v in per_block.values())
    if all(v["fit"]["a"] == 0 and v["fit"]["b"] == 0 for v in per_block.values()):
        raise ValueError("the timings show no growth with length (per-call overhead dominates): use longer lengths")
    mix = {k: sum(v["fit"][k] * v["layers"] for v in per_block.values()) / layers for k in ("a", "b", "c", "d")}
    # errors of the layer-weighted model on the model's per-layer held-out time
    combined = _combined_errors(per_block, layers, mix)
    meta = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else _cpu_name(),
        "torch": torch.__version__,
        "model": model_name,
        "model_config": {k: getattr(cfg, k) for k in getattr(cfg, "__dataclass_fields__", {})},
        "mode": mode,
        "dtype": str(dtype).replace("torch.", ""),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "units": "seconds per layer",
        "per_call_seconds": mix["d"],
        "blocks": {k: {kk: vv for kk, vv in v.items() if kk != "timings"} for k, v in per_block.items()},
        "fit_quality": combined,
        "lengths": {"fit": lengths, "holdout": holdout, "fit_mixes": fit_mixes, "holdout_mixes": holdout_mixes},
    }
    profile = WorkloadModel(
        d_model=dims.dim,
        num_layers=layers,
        causal=causal,
        linear=mix["a"],
        quadratic=mix["b"],
        per_seq=mix["c"],
        gamma=1.0,
        meta=meta,
    )
    gamma = profile.gamma_equivalent
    if math.isfinite(gamma):  # express the fit in the paper's terms too
        profile = WorkloadModel.from_dict({**profile.to_dict(), "gamma": round(gamma, 6)})
    return profile, {"blocks": per_block, "combined": combined, "profile": profile.to_dict()}


def _combined_errors(per_block: dict, layers: int, mix: dict) -> dict:
    """Held-out errors of the layer-weighted profile against layer-weighted measurements
    (what the planner predicts for a whole layer of the model)."""
    names = list(per_block)
    first = per_block[names[0]]
    held_keys = [tuple(s) for s, _ in first["timings"][first["num_fit"] :]]

    def weighted(i: int) -> float:
        return sum(per_block[n]["timings"][i][1] * per_block[n]["layers"] for n in names) / layers

    held_t = [Timing(k, weighted(first["num_fit"] + j)) for j, k in enumerate(held_keys)]
    combo = Fit(mix["a"], mix["b"], mix["c"], mix["d"])
    paper = Fit(
        sum(per_block[n]["paper_fit"]["a"] * per_block[n]["layers"] for n in names) / layers,
        sum(per_block[n]["paper_fit"]["b"] * per_block[n]["layers"] for n in names) / layers,
        0.0,
    )
    mixed = [t for t in held_t if len(t.seq_lens) > 1]
    return {
        "heldout": combo.errors(held_t),
        "heldout_paper_style": paper.errors(held_t),
        "additivity": combo.errors(mixed) if mixed else None,
    }


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "cpu"


def plot_fit(path: str | Path, report: dict) -> None:
    """Measured vs predicted per batch (ours and paper-style), per block type."""
    from knapformer.tools.plots import _plt, seconds_log_axis

    plt = _plt()
    blocks = report["blocks"]
    fig, axes = plt.subplots(1, len(blocks), figsize=(5 * len(blocks), 4), squeeze=False)
    for ax, (name, b) in zip(axes[0], blocks.items()):
        ours = Fit(**b["fit"])
        paper = Fit(b["paper_fit"]["a"], b["paper_fit"]["b"], 0.0)
        meas = [t for _, t in b["timings"]]
        for fit, label, marker in ((ours, "a·L + b·L² + c (ours)", "o"), (paper, "paper-style", "x")):
            pred = [fit.predict(s) for s, _ in b["timings"]]
            ax.scatter(meas, pred, marker=marker, label=label, s=18)
        lim = [min(meas) * 0.8, max(meas) * 1.2]
        ax.plot(lim, lim, color="gray", lw=0.8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        seconds_log_axis(ax.xaxis)
        seconds_log_axis(ax.yaxis)
        ax.tick_params(axis="x", labelrotation=30, labelsize=8)
        ax.tick_params(axis="y", labelsize=8)
        ax.set_xlabel("measured")
        ax.set_ylabel("predicted")
        h = b["heldout"]
        ax.set_title(f"{name} block: held-out median |err| {h['median_abs_rel']:.1%}", fontsize=9)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def format_report(report: dict) -> str:
    lines = [
        f"{'block':10s}{'a (s/token)':>14s}{'b (s/token²)':>15s}{'c (s/seq)':>12s}{'d (s/call)':>12s}"
        f"{'held-out R²':>13s}{'median|err|':>13s}{'max|err|':>10s}{'paper median':>14s}{'additivity':>12s}"
    ]
    for name, b in report["blocks"].items():
        f, h, hp, add = b["fit"], b["heldout"], b["heldout_paper"], b["additivity"]
        lines.append(
            f"{name:10s}{f['a']:14.3e}{f['b']:15.3e}{f['c']:12.3e}{f['d']:12.3e}{h['r2']:13.4f}{h['median_abs_rel']:13.2%}"
            f"{h['max_abs_rel']:10.2%}{hp['median_abs_rel']:14.2%}"
            f"{(add['median_abs_rel'] if add else float('nan')):12.2%}"
        )
    p = report["profile"]
    c = report["combined"]
    # no γ-equivalent when the fitted linear term is 0 (tiny or noisy timings): say so, not crash
    gamma = "n/a (no linear term fitted)" if p.get("gamma_equivalent") is None else f"{p['gamma_equivalent']:.3f}"
    lines.append(
        f"profile (per layer, {p['num_layers']} layers): γ-equivalent {gamma}; held-out median "
        f"|err| {c['heldout']['median_abs_rel']:.2%} (paper-style {c['heldout_paper_style']['median_abs_rel']:.2%}), "
        f"max {c['heldout']['max_abs_rel']:.2%}; additivity median |err| "
        f"{(c['additivity']['median_abs_rel'] if c['additivity'] else float('nan')):.2%}"
    )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    profile, report = calibrate(
        args.model,
        device=args.device,
        mode=args.mode,
        causal=args.causal,
        lengths=args.lengths,
        holdout=args.holdout,
        repeats=args.repeats,
        warmup=args.warmup,
        progress=not args.no_progress,
    )
    profile.save(args.output)
    print(format_report(report))
    print(f"wrote {args.output}")
    if args.report:
        import json

        Path(args.report).write_text(json.dumps(report, indent=1) + "\n")
    if args.plot:
        plot_fit(args.plot, report)
        print(f"wrote {args.plot}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_tool("calibrate", add_args, run, argv, description=__doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
