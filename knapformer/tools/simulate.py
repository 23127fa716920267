"""Training simulator: real steps of a reference DiT with and without balancing, measured.

    knapformer simulate                                   # 2 CPU ranks, built-in demo mix
    knapformer simulate --ranks 4 --mix paper-mixres --scale 8 --bags g1n2+g2n1 --steps 6
    torchrun --nproc-per-node 8 -m knapformer.tools.simulate --device cuda \\
        --model flux --mix paper-joint --bags g8n1 --steps 10          # GPUs, NCCL

Both runs (unbalanced data parallel, and balanced) start from the same weights and see the
same batches; steps are interleaved (one unbalanced, one balanced) so machine noise hits both.
Per step and rank we record: wall time (barrier to barrier), busy time of forward + backward
(thread CPU time on CPU, CUDA events on GPU), loss, and the plan's predicted imbalance.
Reported: step time, tokens/s, HFU, busy max/mean, speedup, ideal speedup (unbalanced
busy max/mean), and whether the losses of the two runs match.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from knapformer.data.batches import make_batch
from knapformer.executor import LocalExecutor
from knapformer.integrations.registry import resolve_model
from knapformer.tools.cli_support import progress as cli_progress
from knapformer.tools.cli_support import run_tool
from knapformer.tools.sim_config import DEMO_MIX, SimConfig, add_args, config_from_args
from knapformer.workload import WorkloadModel

__all__ = ["DEMO_MIX", "SimConfig", "add_args", "main", "run", "simulate"]


def _probe_peak(device: torch.device, dtype: torch.dtype) -> float:
    """Sustained matmul FLOP/s of this rank (one thread on CPU)."""
    n = 1024 if device.type == "cpu" else 8192
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(2):
        a @ b
    reps = 5 if device.type == "cpu" else 50
    _sync(device)
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    _sync(device)
    return 2 * n**3 * reps / (time.perf_counter() - t)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _BusyTimer:
    """Busy time of the measured region: thread CPU time on CPU, CUDA events on GPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __enter__(self):
        if self.device.type == "cuda":
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.thread_time()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            self.end.record()
            self.end.synchronize()
            self.seconds = self.start.elapsed_time(self.end) / 1e3
        else:
            self.seconds = time.thread_time() - self.t0


def _sync_grads(model: torch.nn.Module, world: int) -> None:
    """Average gradients over ranks: plain data parallel with one flat all-reduce (what DDP's
    bucketing does), identical for both runs. Parameters without a gradient are skipped: a
    stock model can have some on every rank (Qwen-Image's last block's text MLP feeds nothing)."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat)
    flat.div_(world)
    for g, s in zip(grads, _unflatten_dense_tensors(flat, grads)):
        g.copy_(s)


def _worker(rank: int, world: int, cfg: SimConfig) -> dict:
    from knapformer.distributed import SequenceBalancer
    from knapformer.testing import keep_freed_memory, pin_to_core

    if cfg.device == "cpu":
        torch.set_num_threads(1)
        if cfg.keep_memory:
            keep_freed_memory()
        if cfg.pin_cpus:
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
            pin_to_core(int(os.environ.get("LOCAL_RANK", rank)), local_world)
    device = torch.device("cuda", torch.cuda.current_device()) if cfg.device == "cuda" else torch.device("cpu")
    dtype = getattr(torch, cfg.dtype)
    family = resolve_model(cfg.model)
    dims = family.dims()
    torch.manual_seed(cfg.seed)
    base = family.build().to(device=device)
    if dtype != torch.float32:
        base = base.to(dtype=dtype)
    if cfg.checkpointing:
        family.enable_checkpointing(base)
    models = {"unbalanced": base, "balanced": copy.deepcopy(base)}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}
    bal = SequenceBalancer(cfg.balancer_config(world))
    flops_model = WorkloadModel(d_model=dims.dim, num_layers=dims.num_layers)
    peak = cfg.peak_tflops * 1e12 if cfg.peak_tflops else _probe_peak(device, dtype)
    records = []
    total_steps = cfg.warmup + cfg.steps
    telemetry: list = []
    bal.on_step(telemetry.append)
    first_plan = None
    bar = cli_progress(range(total_steps), desc="steps", enabled=cfg.progress) if rank == 0 else None
    for step in range(total_steps):
        batch = make_batch(
            cfg.mix,
            rank=rank,
            num_ranks=world,
            step=step,
            seed=cfg.seed,
            scale=cfg.scale,
            in_dim=dims.in_dim,
            vec_dim=dims.vec_dim,
            out_dim=dims.out_dim,
            dtype=dtype,
        )
        batch = _to(batch, device)
        counts = torch.tensor([batch.num_tokens], dtype=torch.int64, device=device)
        dist.all_reduce(counts)
        global_tokens = int(counts)
        inputs = family.inputs(batch)  # built once per step, used by both runs
        for mode in ("unbalanced", "balanced"):
            model, opt = models[mode], opts[mode]
            dist.barrier()
            _sync(device)
            wall0 = time.perf_counter()
            plans_before = bal.num_plans
            plan_t = time.perf_counter()
            if mode == "balanced":
                plan = bal.plan(inputs.seq_lens)  # the one plan of the step
                executor = bal
                if first_plan is None and rank == 0:
                    first_plan = plan.to_dict()
            else:
                executor = LocalExecutor(inputs.seq_lens)
            plan_s = time.perf_counter() - plan_t
            fb0 = time.perf_counter()
            with _BusyTimer(device) as busy:
                out = family.forward(model, inputs, executor)
                loss = ((out.float() - inputs.target.float()) ** 2).sum() / global_tokens
                loss.backward()
            _sync(device)
            fb_wall = time.perf_counter() - fb0
            _sync_grads(model, world)
            opt.step()
            opt.zero_grad(set_to_none=True)
            _sync(device)
            dist.barrier()
            wall = time.perf_counter() - wall0
            loss_t = loss.detach().reshape(1).to(torch.float64)
            dist.all_reduce(loss_t)
            rec = {
                "step": step,
                "mode": mode,
                "wall": wall,
                "busy": busy.seconds,
                "loss": float(loss_t),
                "plan_s": plan_s,
                "fwd_bwd_wall": fb_wall,
                "tokens": batch.num_tokens,
                "plans": bal.num_plans - plans_before,
                "routed_tokens": sum(inputs.seq_lens) if mode == "unbalanced" else int(bal.spec.num_routed),
                "flops": float(sum(flops_model.flops(n, recompute=cfg.checkpointing) for n in batch.seq_lens)),
            }
            if mode == "balanced":
                rec["pred_before"] = plan.imbalance_before
                rec["pred_after"] = plan.imbalance_after
            records.append(rec)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    bal.flush()  # the last step's telemetry
    out = {"rank": rank, "records": records, "peak": peak, "process_cpu_s": time.process_time()}
    if rank == 0:
        out["telemetry"] = [t.to_dict() for t in telemetry]
        out["first_plan"] = first_plan
    return out


def _to(batch, device):
    if device.type == "cpu":
        return batch
    for name in ("txt_lens", "x", "t", "vec", "target"):
        setattr(batch, name, getattr(batch, name).to(device))
    return batch


def summarize(cfg: SimConfig, per_rank: list[dict]) -> dict:
    """Aggregate per-rank records into the report (pure; unit-testable)."""
    world = len(per_rank)
    measured = lambda r: r["step"] >= cfg.warmup  # noqa: E731
    report: dict = {"config": asdict(cfg), "world": world, "modes": {}}
    report["telemetry"] = per_rank[0].get("telemetry", [])  # the balancer's record of every balanced step
    report["first_plan"] = per_rank[0].get("first_plan")
    steps = sorted({r["step"] for r in per_rank[0]["records"] if measured(r)})
    peak = sum(p["peak"] for p in per_rank)
    busy_by_mode: dict[str, list[list[float]]] = {}
    for mode in ("unbalanced", "balanced"):
        rows = {(p["rank"], r["step"]): r for p in per_rank for r in p["records"] if r["mode"] == mode and measured(r)}
        wall = [max(rows[(k, s)]["wall"] for k in range(world)) for s in steps]
        busy = busy_by_mode[mode] = [[rows[(k, s)]["busy"] for k in range(world)] for s in steps]
        tokens = [sum(rows[(k, s)]["tokens"] for k in range(world)) for s in steps]
        flops = [sum(rows[(k, s)]["flops"] for k in range(world)) for s in steps]
        m = {
            "step_time": statistics.mean(wall),
            "step_times": wall,
            "tokens_per_s": sum(tokens) / sum(wall),
            "hfu": sum(flops) / (sum(wall) * peak),
            "busy_per_rank": [statistics.mean(b[k] for b in busy) for k in range(world)],
            "busy_max_over_mean": sum(max(b) for b in busy) / sum(statistics.mean(b) for b in busy),
            # the busiest rank's compute per step: what the step takes when ranks have dedicated cores
            "critical_path_s": statistics.mean(max(b) for b in busy),
            "loss": [rows[(0, s)]["loss"] for s in steps],
            "plan_ms": 1e3 * statistics.mean(rows[(0, s)]["plan_s"] for s in steps),
            "fwd_bwd_wall_per_rank": [
                statistics.mean(rows[(k, s)]["fwd_bwd_wall"] for s in steps) for k in range(world)
            ],
            # what the step did: plans made per rank per step, tokens each rank computed on
            "plans_per_rank_step": max(rows[(k, s)].get("plans", 0) for k in range(world) for s in steps),
            "routed_tokens_per_rank": [
                statistics.mean(rows[(k, s)].get("routed_tokens", 0) for s in steps) for k in range(world)
            ],
        }
        if mode == "balanced":
            m["predicted_imbalance_before"] = statistics.mean(rows[(0, s)]["pred_before"] for s in steps)
            m["predicted_imbalance_after"] = statistics.mean(rows[(0, s)]["pred_after"] for s in steps)
        report["modes"][mode] = m
    u, b = report["modes"]["unbalanced"], report["modes"]["balanced"]
    report["speedup"] = u["step_time"] / b["step_time"]
    report["ideal_speedup"] = u["busy_max_over_mean"]
    report["speedup_over_ideal"] = report["speedup"] / report["ideal_speedup"]
    # the same ratio step by step: on a noisy machine its spread says how much one run can tell
    report["speedup_over_ideal_per_step"] = [
        (uw / bw) / (max(ub) / statistics.mean(ub))
        for uw, bw, ub in zip(u["step_times"], b["step_times"], busy_by_mode["unbalanced"])
    ]
    diffs = [abs(x - y) / max(abs(x), 1e-12) for x, y in zip(u["loss"], b["loss"])]
    report["loss_max_rel_diff"] = max(diffs)
    report["loss_match"] = report["loss_max_rel_diff"] < 1e-4
    report["peak_flops_per_rank"] = peak / world
    return report


def format_report(rep: dict) -> str:
    u, b = rep["modes"]["unbalanced"], rep["modes"]["balanced"]
    c = rep["config"]
    bags = c["bags"] or f"g{rep['world']}n1"
    lines = []
    other = rep.get("machine", {}).get("other_cpu_share", 0.0)
    if other >= BUSY_MACHINE:  # lead with what the machine's load leaves meaningful
        lines += [
            f"NOTE: other processes used {other:.0%} of this machine's {rep['machine']['cpus']} CPUs during the "
            "run, so its wall-clock times (step time, speedup) are the machine's, not the balancer's.",
            f"What stays meaningful is the balance of each rank's own busy time: max/mean "
            f"{u['busy_max_over_mean']:.3f} unbalanced -> {b['busy_max_over_mean']:.3f} balanced "
            "(1.000 is perfect). Rerun on a quiet machine for the speedup.",
        ]
    lines += [
        f"model {c['model']}  ranks {rep['world']}  mix {c['mix']} (scale {c['scale']})  "
        f"bags {bags}  steps {c['steps']} (+{c['warmup']} warm-up)",
        f"{'':28s}{'unbalanced':>14s}{'balanced':>14s}",
        f"{'step time (s)':28s}{u['step_time']:14.3f}{b['step_time']:14.3f}",
        f"{'tokens/s':28s}{u['tokens_per_s']:14.0f}{b['tokens_per_s']:14.0f}",
        f"{'HFU':28s}{u['hfu']:14.2%}{b['hfu']:14.2%}",
        f"{'busy time max/mean':28s}{u['busy_max_over_mean']:14.3f}{b['busy_max_over_mean']:14.3f}",
        f"{'busy time per rank (s)':28s}{_fmt(u['busy_per_rank']):>14s}{_fmt(b['busy_per_rank']):>14s}",
        f"{'fwd+bwd wall - busy (s)':28s}{_waits(u):>14s}{_waits(b):>14s}",
        f"{'predicted imbalance':28s}{b['predicted_imbalance_before']:14.3f}{b['predicted_imbalance_after']:14.3f}",
        f"{'planning (ms)':28s}{'':14s}{b['plan_ms']:14.2f}",
        f"speedup {rep['speedup']:.3f}x   ideal {rep['ideal_speedup']:.3f}x   "
        f"({rep['speedup_over_ideal']:.1%} of ideal)   loss match: {rep['loss_match']} "
        f"(max rel diff {rep['loss_max_rel_diff']:.1e})",
    ]
    plan = rep.get("first_plan")
    if plan and plan.get("groups"):
        lines.append(f"first plan's groups: {_groups(plan)}")
    per_step = rep["speedup_over_ideal_per_step"]
    if len(per_step) > 1:
        lines.append(
            f"step by step: {min(per_step):.1%} .. {max(per_step):.1%} of ideal "
            f"(median {statistics.median(per_step):.1%})"
        )
    return "\n".join(lines)


def _groups(plan: dict) -> str:
    """The group sizes the plan runs sequences on, with rings: ``4 ranks (ring 2 × Ulysses 2) ×1``."""
    used = sorted(set(plan["seq_group"]))
    rings = plan.get("ring") or [1] * len(plan["groups"])
    kinds: dict[tuple[int, int], int] = {}
    for g in used:
        key = (len(plan["groups"][g]), int(rings[g]))
        kinds[key] = kinds.get(key, 0) + 1
    parts = []
    for (k, r), n in sorted(kinds.items()):
        how = f" (ring {r} × Ulysses {k // r})" if r > 1 else ""
        parts.append(f"{k} rank{'s' if k > 1 else ''}{how} ×{n}")
    return ", ".join(parts)


def _waits(mode: dict) -> str:
    """Per rank: forward+backward wall time not spent computing (collectives, waiting)."""
    return _fmt([w - c for w, c in zip(mode["fwd_bwd_wall_per_rank"], mode["busy_per_rank"])])


def _fmt(values: list[float]) -> str:
    return "/".join(f"{v:.2f}" for v in values) if len(values) <= 4 else f"{min(values):.2f}..{max(values):.2f}"


def write_outputs(rep: dict, report_path: str | None, plot_dir: str | None, metrics_path: str | None = None) -> None:
    if metrics_path:
        Path(metrics_path).parent.mkdir(parents=True, exist_ok=True)
        with open(metrics_path, "w") as f:
            for record in rep.get("telemetry", []):
                f.write(json.dumps(record) + "\n")
        print(f"wrote {metrics_path}")
    if report_path:
        Path(report_path).parent.mkdir(parents=True, exist_ok=True)
        Path(report_path).write_text(json.dumps(rep, indent=1) + "\n")
        print(f"wrote {report_path}")
    if plot_dir:
        from knapformer.tools.plots import plot_rank_work, plot_step_times

        Path(plot_dir).mkdir(parents=True, exist_ok=True)
        u, b = rep["modes"]["unbalanced"], rep["modes"]["balanced"]
        plot_rank_work(
            Path(plot_dir) / "busy_per_rank.png",
            "measured busy time per rank (fwd+bwd, mean per step)",
            {"unbalanced": u["busy_per_rank"], "balanced": b["busy_per_rank"]},
            ylabel="seconds",
        )
        plot_step_times(Path(plot_dir) / "step_time.png", {"unbalanced": u["step_times"], "balanced": b["step_times"]})
        written = ["busy_per_rank.png", "step_time.png"]
        if rep.get("first_plan"):
            from knapformer.plan import Plan

            Plan.from_dict(rep["first_plan"]).plot(Path(plot_dir) / "first_plan.png")
            written.append("first_plan.png")
        if rep.get("telemetry"):
            from knapformer.tools.plots import plot_prediction

            plot_prediction(Path(plot_dir) / "predicted_vs_measured.png", rep["telemetry"])
            written.append("predicted_vs_measured.png")
        print(f"wrote {', '.join(f'{plot_dir}/{w}' for w in written)}")


def check_config(cfg: SimConfig, world: int | None = None) -> None:
    """Problems knowable before any process starts: unknown preset, mismatched profile, a
    layout that does not tile the world, any bad balancer setting."""
    cfg.balancer_config(cfg.ranks if world is None else world)


def simulate(cfg: SimConfig) -> dict:
    """Run the simulation on spawned ranks (or in this process under torchrun) -> report."""
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    check_config(cfg, int(os.environ["WORLD_SIZE"]) if under_torchrun else None)
    if under_torchrun:
        backend = "nccl" if cfg.device == "cuda" else "gloo"
        if cfg.device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
        world = dist.get_world_size()
        if world != cfg.ranks:
            from dataclasses import replace

            cfg = replace(cfg, ranks=world)
        mine = _worker(dist.get_rank(), world, cfg)
        gathered: list = [None] * world
        dist.all_gather_object(gathered, mine)
        dist.destroy_process_group()
        return summarize(cfg, gathered)
    from knapformer.testing import run_distributed

    before, own0, t0 = machine_busy_seconds(), time.process_time(), time.perf_counter()
    per_rank = run_distributed(_worker, cfg.ranks, cfg, timeout=3600, backend="gloo" if cfg.device == "cpu" else "nccl")
    after, wall = machine_busy_seconds(), time.perf_counter() - t0
    rep = summarize(cfg, per_rank)
    if before is not None and after is not None:
        own = time.process_time() - own0 + sum(p.get("process_cpu_s", 0.0) for p in per_rank)
        rep["machine"] = {
            "cpus": os.cpu_count() or 1,
            "other_cpu_share": other_cpu_share(after - before, own, wall, os.cpu_count() or 1),
        }
    return rep


BUSY_MACHINE = 0.15
"""Share of the machine's CPU time that other processes used during the run above which the
report says that its wall-clock times are the machine's, not the balancer's."""


def machine_busy_seconds() -> float | None:
    """CPU seconds this machine has spent busy since boot, every CPU and every process (user,
    nice, system, interrupts, and steal: time the hypervisor gave to other guests), from
    ``/proc/stat``; None where there is none."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    user, nice, system, _idle, _iowait, irq, softirq, *rest = (int(x) for x in fields[1:])
    steal = rest[0] if rest else 0
    return (user + nice + system + irq + softirq + steal) / (os.sysconf("SC_CLK_TCK") or 100)


def other_cpu_share(busy_s: float, own_s: float, wall_s: float, cpus: int) -> float:
    """The share of the machine's CPU time (``cpus`` × ``wall_s``) that went to anything but this
    run (``own_s``: its processes' CPU seconds) while it ran: 0 on a quiet machine."""
    if wall_s <= 0 or cpus <= 0:
        return 0.0
    return min(1.0, max(0.0, (busy_s - own_s) / (cpus * wall_s)))


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    rep = simulate(cfg)
    if int(os.environ.get("RANK", "0")) == 0:
        print(format_report(rep))
        write_outputs(rep, args.report, args.plot_dir, args.metrics)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_tool("simulate", add_args, run, argv, description=__doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
