"""Simulator configuration and CLI flags (torch-free, so `knapformer --help` stays light)."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

from knapformer.cluster.hardware import hardware
from knapformer.config import BalancerConfig
from knapformer.data.codes import mix_num_ranks, resolve_mix
from knapformer.integrations.registry import resolve_model
from knapformer.layout import AutoLayout, parse_layout
from knapformer.tools.cli_support import (
    BALANCER_FLAGS,
    add_balancer_args,
    balancer_settings,
    positive_float,
    positive_int,
)
from knapformer.workload import WorkloadModel

__all__ = ["DEMO_MIX", "SimConfig", "add_args", "config_from_args"]

DEMO_MIX = "g1b8i256f1s0,g1b1i1024f3s0"
"""Two ranks: 8 small images vs one 1024² three-frame clip (CPU demo, with ``--scale 2``)."""


@dataclass(frozen=True, kw_only=True)
class SimConfig:
    """Simulator options (the CLI flags mirror these fields)."""

    ranks: int = 2
    """Processes to spawn (ignored under torchrun: the world size is used)."""
    mix: str = DEMO_MIX
    """Mix name (paper-lowres, paper-mixres, paper-joint) or data codes; tiled over the ranks."""
    scale: int | None = None
    """Resolution divisor so a CPU run keeps the mix's shape at 1/scale² of the tokens; None = 2
    for the built-in demo mix, 1 (the data codes as written) for any other mix."""
    bags: str | None = None
    """Bag layout of the balanced run; None = one bag of all ranks (g{ranks}n1)."""
    model: str = "mmdit-small"
    """Model: a preset name or ``module:callable`` (see ``knapformer.integrations.registry``)."""
    steps: int = 6
    """Measured steps per run."""
    warmup: int = 2
    """Unmeasured steps per run before measuring."""
    seed: int = 0
    gamma: float = 1.0
    """γ of the paper cost form used for planning (ignored with a profile; calibrated CPU
    profiles of the tiny presets measure γ ≈ 0.5–0.8)."""
    profile: str | None = None
    """Workload profile JSON (from the calibrator) the planner uses instead of γ."""
    solver: str | None = None
    """Planner of the balanced run (None: ``lpt`` for bag layouts, ``moldable`` for ``auto``)."""
    max_tokens_per_rank: int | None = None
    """Memory cap of the balanced run (routed tokens per rank)."""
    rank_speed: tuple[float, ...] | None = None
    """Relative speed of each rank of a balancing group (the planner gives slow ranks less)."""
    attn_path: str = "auto"
    """How the balanced run's planner prices ring groups (``BalancerConfig.attn_path``; the
    simulated models call ``bal.attention``)."""
    attn_backend: str = "auto"
    """Varlen attention kernel of both runs."""
    debug: bool = False
    """Per-layer cross-rank checks in the balanced run."""
    time_budget_s: float | None = None
    """Planning budget per step (layout ``auto``: more candidate plans)."""
    measure: bool = False
    """The balancer times its region every step (telemetry: measured vs predicted)."""
    recalibrate: bool = False
    """The balancer refits its cost model online from the timings (implies ``measure``)."""
    estimate_speed: bool = False
    """With ``recalibrate``: per-rank speeds estimated too."""
    recalibrate_warmup: int = 1
    """With ``recalibrate``: timed steps at the start the fit skips (one-time costs)."""
    hardware: str | None = None
    """Hardware preset (``knapformer.cluster.HARDWARE``) whose links price the exchanges for
    the planner; None = ``cpu-gloo`` on CPU and ``h100`` on CUDA for layout ``auto``, and no
    pricing for bag layouts (their plans do not depend on it)."""
    device: str = "cpu"
    """cpu (gloo) or cuda (NCCL)."""
    checkpointing: bool = False
    """Activation checkpointing per block (counts recompute FLOPs in HFU)."""
    peak_tflops: float | None = None
    """Peak per rank for HFU; None = measured with a matmul probe."""
    dtype: str = "float32"
    progress: bool = True
    pin_cpus: bool = True
    """On CPU, pin each rank to its own core when there are enough cores: fewer migrations
    and less cache thrash when ranks (and gloo's I/O threads) compete for cores."""
    keep_memory: bool = True
    """On CPU, keep freed buffers mapped (glibc ``mallopt``) instead of page-faulting them in
    again each step; both runs get it (see ``knapformer.testing.keep_freed_memory``)."""

    def __post_init__(self) -> None:
        if self.scale is None:
            object.__setattr__(self, "scale", 2 if self.mix == DEMO_MIX else 1)
        if self.ranks < 1:
            raise ValueError(f"ranks must be >= 1, got {self.ranks}")
        if self.steps < 1 or self.warmup < 0:
            raise ValueError(f"steps must be >= 1 and warmup >= 0 (got {self.steps}, {self.warmup})")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be float32 or bfloat16, got {self.dtype!r}")
        codes = resolve_mix(self.mix)  # raises on malformed codes
        if self.ranks % mix_num_ranks(codes):
            raise ValueError(
                f"mix {self.mix!r} describes {mix_num_ranks(codes)} ranks; {self.ranks} ranks is not a multiple"
            )

    def layout(self, world: int) -> str:
        """The balanced run's layout for ``world`` ranks (default: one bag of all of them)."""
        return self.bags or f"g{world}n1"

    def balancer_config(self, world: int) -> BalancerConfig:
        """The balanced run's :class:`BalancerConfig` for ``world`` ranks (validates every
        setting, and that the layout tiles the world, before any process starts)."""
        family = resolve_model(self.model)
        dims = family.dims()
        layout = parse_layout(self.layout(world))
        layout.num_replicas(world)  # raises if the layout's group does not tile the world
        if self.profile:
            cost = WorkloadModel.from_profile(self.profile)
            if cost.d_model != dims.dim:
                raise ValueError(f"profile d_model {cost.d_model} does not match model {self.model!r} (dim {dims.dim})")
            if cost.num_heads is None:
                cost = dataclasses.replace(cost, num_heads=dims.num_heads, num_kv_heads=dims.num_kv_heads)
        else:
            cost = family.workload(gamma=self.gamma)
        link = "free"  # bag layouts: their plans do not depend on it (no probe at construction)
        default = ("cpu-gloo" if self.device == "cpu" else "h100") if isinstance(layout, AutoLayout) else None
        name = self.hardware or default
        if name is not None:
            hw = hardware(name)
            units = 1.0 if self.profile else hw.flop_units_per_second  # profile: seconds; paper form: FLOPs
            link = hw.link(units_per_second=units)
            if self.dtype == "float32":
                link = dataclasses.replace(link, bytes_per_value=4)
        settings = {f: getattr(self, f) for f in BALANCER_FLAGS}
        return BalancerConfig(layout=layout, cost=cost, link=link, **settings)


def add_args(p: argparse.ArgumentParser) -> None:
    d = SimConfig()
    p.add_argument(
        "--ranks", type=positive_int, default=d.ranks, help="ranks to spawn on this machine (not under torchrun)"
    )
    p.add_argument("--mix", default=d.mix, help="mix name or data codes g{G}b{B}i{R}f{F}s{S},...")
    p.add_argument(
        "--scale",
        type=positive_int,
        default=None,
        help="resolution divisor for CPU runs (default: 2 for the built-in demo mix, 1 for any other mix)",
    )
    p.add_argument(
        "--model", default=d.model, help="model preset: mmdit-tiny, mmdit-small, transformer-tiny, flux, ..."
    )
    p.add_argument("--steps", type=positive_int, default=d.steps, help="measured steps")
    p.add_argument("--warmup", type=int, default=d.warmup, help="warm-up steps (not measured)")
    p.add_argument("--seed", type=int, default=d.seed, help="data and weight seed")
    p.add_argument("--device", default=d.device, choices=["cpu", "cuda"], help="cpu (gloo) or cuda (NCCL)")
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing per block")
    p.add_argument(
        "--peak-tflops", type=positive_float, default=None, help="peak TFLOP/s per rank for HFU (default: probe)"
    )
    p.add_argument("--dtype", default=d.dtype, choices=["float32", "bfloat16"])
    p.add_argument("--no-progress", "--quiet", action="store_true", help="no progress bar")
    p.add_argument("--no-pin", action="store_true", help="do not pin CPU ranks to cores")
    p.add_argument(
        "--no-keep-memory", action="store_true", help="let glibc return freed buffers to the OS (page faults each step)"
    )
    p.add_argument(
        "--hardware",
        default=None,
        help="hardware preset pricing the exchanges for the planner (default for --bags auto: "
        "cpu-gloo on CPU, h100 on CUDA)",
    )
    p.add_argument("--report", default=None, help="write the JSON report here")
    p.add_argument("--metrics", default=None, help="write the balancer's per-step telemetry here (JSONL)")
    p.add_argument("--plot-dir", default=None, help="write PNG charts here")
    add_balancer_args(
        p, bags_default=d.bags, bags_help="bag layout of the balanced run (default: one bag of all ranks)"
    )


def config_from_args(args: argparse.Namespace) -> SimConfig:
    return SimConfig(
        ranks=args.ranks,
        mix=args.mix,
        scale=args.scale,
        bags=args.bags,
        model=args.model,
        steps=args.steps,
        warmup=args.warmup,
        seed=args.seed,
        gamma=args.gamma,
        profile=args.profile,
        hardware=args.hardware,
        device=args.device,
        checkpointing=args.checkpointing,
        peak_tflops=args.peak_tflops,
        dtype=args.dtype,
        progress=not args.no_progress,
        pin_cpus=not args.no_pin,
        keep_memory=not args.no_keep_memory,
        **balancer_settings(args),
    )
