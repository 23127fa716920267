"""One training step of a stock diffusers model on 2 CPU ranks, three ways, side by side:

- **data parallel**: each rank runs its own samples through the stock forward (same-shaped
  samples batched, as a bucketed loader would), then gradients are all-reduced;
- **diffusers CP**: diffusers' own context parallelism (``ContextParallelConfig(ulysses_degree=2)``
  through ``model.enable_parallelism``), the batch replicated across the group: both ranks run
  every sample of the step, each holding half of its tokens, then gradients are all-reduced;
- **knapformer auto**: each rank hands its own samples to the packed integration, planned by
  ``SequenceBalancer("auto")`` with the ``cpu-gloo`` link model, then gradients are all-reduced.

    python benchmarks/side_by_side.py [--repeats 5] [--load] [--cases wan,qwenimage,qwenimage-odd]
                                      [--out runs/bench/side_by_side.json]

Each case is a few stock fp32 layers, one thread per rank. Reported per case and method: the
median warm step wall time (forward + backward + gradient all-reduce; barrier-started, the
slower rank's), each rank's median thread CPU time for the step, and the largest difference of
the summed gradients from data parallel's (relative to its largest gradient). Methods alternate
within each repeat. ``--load`` measures everything again with a CPU hog process running beside
the ranks (rows marked ``loaded``). Where diffusers CP cannot run a case, its row says why;
nothing is padded. (Not covered here because these models have neither: diffusers CP's limits
with GQA or causal attention.)

diffusers 0.42's ``enable_parallelism`` computes the rank's device as
``rank % torch.accelerator.device_count()``, a division by zero on CPU-only torch; to run it at
all, ``device_count`` returns 1 for the duration of that one call (the device it records is
cpu:0; the mesh is a CPU/gloo mesh), and nothing else is changed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import print_table, write_json  # noqa: E402

from knapformer.testing import run_distributed  # noqa: E402

METHODS = ("data parallel", "diffusers CP", "knapformer auto")


# -- cases ---------------------------------------------------------------------------------------------
def _wan_case(smoke: bool):
    """Rank 0: one ~2,400-token video (6 latent frames of 40×40: 6×20×20 tokens); rank 1: six
    64-token images; 24 text tokens each (cross-attention context)."""
    from diffusers import WanTransformer3DModel

    from knapformer.integrations.wan import WanSample, packed_wan_forward, wan_seq_lens, wan_workload

    dims = dict(num_attention_heads=4, attention_head_dim=32, ffn_dim=512, num_layers=1 if smoke else 2)
    kw = dict(patch_size=(1, 2, 2), in_channels=4, out_channels=4, text_dim=64, freq_dim=64, **dims)
    video = (2, 8, 8) if smoke else (6, 40, 40)

    def samples(rank):
        g = torch.Generator().manual_seed(rank)
        shapes = [video] if rank == 0 else [(1, 16, 16)] * 6
        return [
            WanSample(
                torch.randn(4, *s, generator=g), torch.randn(24, 64, generator=g), torch.rand((), generator=g) * 1000
            )
            for s in shapes
        ]

    def stock(model, ss):
        """Same-shaped samples in one stock batch."""
        outs, groups = [], {}
        for s in ss:
            groups.setdefault(tuple(s.latents.shape), []).append(s)
        for group in groups.values():
            x, t, e = (torch.stack(v) for v in zip(*[(s.latents, s.timestep, s.text) for s in group]))
            outs += list(model(hidden_states=x, timestep=t, encoder_hidden_states=e, return_dict=False)[0])
        return outs

    def cp_problem(ss):
        p = math.prod(kw["patch_size"])
        bad = [math.prod(s.latents.shape[1:]) // p for s in ss if (math.prod(s.latents.shape[1:]) // p) % 2]
        return f"video tokens {bad} not divisible by 2" if bad else ""

    return dict(
        build=lambda: WanTransformer3DModel(**kw),
        samples=samples,
        stock=stock,
        packed=packed_wan_forward,
        seq_lens=wan_seq_lens,
        workload=lambda m: wan_workload(m, context_len=24),
        cp_problem=cp_problem,
        inputs="rank 0: 1 video (4, 6, 40, 40) = 2,400 tokens; rank 1: 6 images (4, 1, 16, 16) = 64 tokens each; "
        "24 text tokens per sample; WanTransformer3DModel 2 layers, 4 heads × 32, ffn 512",
    )


def _qwen_case(smoke: bool, odd: bool):
    """A mixed-resolution Qwen-Image step: rank 0 one large image, rank 1 three smaller ones of
    other aspect ratios; ``odd``: one small image of 9×9 tokens and a 7-token prompt."""
    from diffusers import QwenImageTransformer2DModel

    from knapformer.integrations.qwenimage import (
        QwenImageSample,
        packed_qwenimage_forward,
        qwenimage_seq_lens,
        qwenimage_workload,
    )

    kw = dict(patch_size=2, in_channels=16, out_channels=4, num_attention_heads=4, attention_head_dim=32)
    kw.update(joint_attention_dim=64, axes_dims_rope=(8, 12, 12), num_layers=1 if smoke else 2)
    big = [((4, 6), 8)] if smoke else [((32, 40), 48)]
    small = [((16, 16), 20), ((12, 24), 32), ((9, 9) if odd else (20, 12), 7 if odd else 10)]

    def samples(rank):
        g = torch.Generator().manual_seed(rank)
        return [
            QwenImageSample(
                torch.randn(h * w, 16, generator=g),
                [(1, h, w)],
                torch.randn(t, 64, generator=g),
                torch.rand((), generator=g),
            )
            for (h, w), t in (big if rank == 0 else small)
        ]

    def stock(model, ss):
        return [
            model(
                hidden_states=s.latents[None],
                encoder_hidden_states=s.text[None],
                timestep=s.timestep[None],
                img_shapes=[s.img_shapes],
                return_dict=False,
            )[0][0]
            for s in ss
        ]

    def cp_problem(ss):
        bad = [(s.latents.shape[0], s.text.shape[0]) for s in ss if s.latents.shape[0] % 2 or s.text.shape[0] % 2]
        return f"(image, text) tokens {bad} not divisible by 2" if bad else ""

    shapes = "; ".join(f"{h}×{w} + {t} text" for (h, w), t in big + small)
    return dict(
        build=lambda: QwenImageTransformer2DModel(**kw),
        samples=samples,
        stock=stock,
        packed=packed_qwenimage_forward,
        seq_lens=lambda m, ss: qwenimage_seq_lens(m, ss),
        workload=qwenimage_workload,
        cp_problem=cp_problem,
        inputs=f"rank 0 / rank 1 token grids: {shapes}; QwenImageTransformer2DModel 2 layers, 4 heads × 32",
    )


CASES = {
    "wan": lambda smoke: _wan_case(smoke),
    "qwenimage": lambda smoke: _qwen_case(smoke, odd=False),
    "qwenimage-odd": lambda smoke: _qwen_case(smoke, odd=True),
}


# -- one rank ------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _one_cpu_device():
    """``torch.accelerator.device_count()`` = 1 on CPU-only torch (see the module docstring)."""
    real = torch.accelerator.device_count
    if real() == 0:
        torch.accelerator.device_count = lambda: 1
    try:
        yield
    finally:
        torch.accelerator.device_count = real


def _targets(outs, first: int):
    """Each sample's target from its own seed (its index in the step): the same in every method."""
    return [torch.randn(o.shape, generator=torch.Generator().manual_seed(1000 + first + i)) for i, o in enumerate(outs)]


def _step(case, method, model, mine, every, count, bal, rank):
    """One training step; returns after the gradient all-reduce."""
    from knapformer.training import sum_gradients

    if method == "knapformer auto":
        bal.plan(case["seq_lens"](model, mine))
        outs = case["packed"](model, mine, bal)
        extra = 0 * outs.flat.sum()
    else:
        outs = case["stock"](model, every if method == "diffusers CP" else mine)
        extra = 0
    first = 0 if method == "diffusers CP" or rank == 0 else len(every) - len(mine)
    tg = _targets(outs, first)
    loss = sum(((o - t) ** 2).sum() for o, t in zip(outs, tg)) / count + extra
    loss.backward()
    sum_gradients(model)


def _worker(rank: int, world: int, names: list[str], repeats: int, smoke: bool) -> dict:
    from diffusers import ContextParallelConfig

    from knapformer import BalancerConfig, SequenceBalancer
    from knapformer.cluster import hardware
    from knapformer.testing import keep_freed_memory, pin_to_core

    torch.set_num_threads(1)
    pin_to_core(rank, world)
    keep_freed_memory()
    report = {}
    for name in names:
        case = CASES[name](smoke)
        every = case["samples"](0) + case["samples"](1)
        mine = case["samples"](rank)
        models = {}
        for method in METHODS:
            torch.manual_seed(0)
            models[method] = case["build"]()
        with torch.no_grad():
            count = sum(o.numel() for o in case["stock"](models["data parallel"], every))
        problem = case["cp_problem"](every)
        status = {m: "" for m in METHODS}
        if problem:
            status["diffusers CP"] = f"cannot run: {problem}"
        else:
            with _one_cpu_device():
                models["diffusers CP"].enable_parallelism(config=ContextParallelConfig(ulysses_degree=2))
        hw = hardware("cpu-gloo")  # as ``knapformer simulate`` prices fp32 CPU ranks
        link = dataclasses.replace(hw.link(units_per_second=hw.flop_units_per_second), bytes_per_value=4)
        cost = case["workload"](models["knapformer auto"])
        bal = SequenceBalancer(BalancerConfig(layout="auto", cost=cost, link=link))
        runnable = [m for m in METHODS if not status[m]]
        grads, wall, cpu = {}, {m: [] for m in runnable}, {m: [] for m in runnable}
        for m in runnable:  # warm-up step, whose gradients are compared
            _step(case, m, models[m], mine, every, count, bal, rank)
            grads[m] = [p.grad.clone() for p in models[m].parameters() if p.grad is not None]
            models[m].zero_grad(set_to_none=True)
        for _ in range(repeats):
            for m in runnable:
                dist.barrier()
                t0, c0 = time.perf_counter(), time.thread_time()
                _step(case, m, models[m], mine, every, count, bal, rank)
                t1, c1 = time.perf_counter(), time.thread_time()
                slowest = torch.tensor([t1 - t0])
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                wall[m].append(slowest.item())
                cpu[m].append(c1 - c0)
                models[m].zero_grad(set_to_none=True)
        ref = grads["data parallel"]
        scale = max(g.abs().max().item() for g in ref)
        rows = {}
        for m in METHODS:
            if status[m]:
                rows[m] = {"status": status[m]}
                continue
            err = max((a - b).abs().max().item() for a, b in zip(grads[m], ref)) / scale
            rows[m] = {
                "status": "ok",
                "wall_s": statistics.median(wall[m]),
                "cpu_s": statistics.median(cpu[m]),
                "grad_err": err,
            }
        report[name] = {
            "rows": rows,
            "inputs": case["inputs"],
            "plan_sizes": sorted(set(map(len, bal.current_plan.groups))),
        }
    for name in names:  # last: diffusers' any-length mode on the cases plain CP cannot run
        if report[name]["rows"]["diffusers CP"]["status"] != "ok":
            report[name]["ulysses_anything"] = _try_any_length(CASES[name](smoke))
    return report


def _try_any_length(case) -> str:
    """One forward + backward of every sample under ``ulysses_anything=True``: what happens."""
    from diffusers import ContextParallelConfig

    torch.manual_seed(0)
    model = case["build"]()
    with _one_cpu_device():
        model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=2, ulysses_anything=True))
    try:
        outs = case["stock"](model, case["samples"](0) + case["samples"](1))
    except Exception as exc:  # what the mode does on these inputs is the result
        return f"forward raised {type(exc).__name__}: {str(exc)[:160]}"
    try:
        sum(o.sum() for o in outs).backward()
    except Exception as exc:
        return f"forward ran; backward raised {type(exc).__name__}: {str(exc)[:160]}"
    return "forward and backward ran"


def _measure(names, repeats, smoke) -> list[dict]:
    return run_distributed(_worker, 2, names, repeats, smoke, timeout=3600, pg_timeout=900)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--repeats", type=int, default=5, help="measured steps per method (after one warm-up step)")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated cases of {sorted(CASES)}")
    ap.add_argument("--load", action="store_true", help="measure again with a CPU hog process beside the ranks")
    ap.add_argument("--smoke", action="store_true", help="tiny inputs and 1 layer (a seconds-long check that it runs)")
    ap.add_argument("--out", default="runs/bench/side_by_side.json")
    args = ap.parse_args(argv)
    names = [n for n in args.cases.split(",") if n]
    unknown = sorted(set(names) - set(CASES))
    if unknown:
        ap.error(f"unknown cases {unknown}; choose from {sorted(CASES)}")
    passes = [("idle", None)]
    if args.load:
        passes.append(("loaded", [sys.executable, "-c", "while True: pass"]))
    rows = []
    for label, hog_cmd in passes:
        hog = subprocess.Popen(hog_cmd) if hog_cmd else None
        try:
            res = _measure(names, args.repeats, args.smoke)
        finally:
            if hog is not None:
                hog.terminate()
                hog.wait()
        for name in names:
            dp = res[0][name]["rows"]["data parallel"]
            for m in METHODS:
                r = res[0][name]["rows"][m]
                row = {"case": name, "machine": label, "method": m, "status": r["status"]}
                if r["status"] == "ok":
                    row.update(
                        wall_ms=1e3 * r["wall_s"],
                        vs_dp=dp["wall_s"] / r["wall_s"],
                        cpu0_ms=1e3 * r["cpu_s"],
                        cpu1_ms=1e3 * res[1][name]["rows"][m]["cpu_s"],
                        grad_err=r["grad_err"],
                    )
                rows.append(row)
    cols = [("case", ""), ("machine", ""), ("method", ""), ("wall_ms", ".0f"), ("vs_dp", ".2f")]
    cols += [("cpu0_ms", ".0f"), ("cpu1_ms", ".0f"), ("grad_err", ".1e")]
    print_table(rows, cols)
    for r in rows:
        if r["status"] != "ok":
            print(f"{r['case']} ({r['machine']}), {r['method']}: {r['status']}")
    anything = {n: res[0][n]["ulysses_anything"] for n in names if "ulysses_anything" in res[0][n]}
    for n, what in anything.items():
        print(f"{n}, diffusers CP with ulysses_anything=True (any length): {what}")
    inputs = {n: res[0][n]["inputs"] for n in names}
    plans = {n: res[0][n]["plan_sizes"] for n in names}
    meta = dict(repeats=args.repeats, smoke=args.smoke, inputs=inputs, knapformer_group_sizes=plans)
    write_json(args.out, rows, ulysses_anything=anything, **meta)
    return {"rows": rows, "inputs": inputs}


if __name__ == "__main__":
    main()
