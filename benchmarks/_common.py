"""Shared helpers for benchmark scripts: table printing and JSON output."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path


def print_table(rows: list[dict], columns: list[tuple[str, str]]) -> None:
    """Print rows as a fixed-width table; ``columns`` = [(key, format spec)]."""
    widths = [max(len(k), 10) for k, _ in columns]
    print("  ".join(k.rjust(w) for (k, _), w in zip(columns, widths)))
    for r in rows:
        cells = []
        for (k, fmt), w in zip(columns, widths):
            v = r.get(k)
            cells.append(("n/a" if v is None else format(v, fmt)).rjust(w))
        print("  ".join(cells))


def write_json(path: str | Path, rows: list[dict], **meta) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    doc = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": platform.platform(), **meta, "rows": rows}
    Path(path).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"\nwrote {path}")


MIXRES_RANKS = {2: [0, 28], 4: [0, 16, 20, 28]}
"""Which ranks of paper-mixres (32 ranks, scaled 4×) the exchange benchmarks keep: the
low-res end ... the 2048² end, so that a bag plan moves and splits real sequences."""


def mixres_rank_lens(world: int) -> list[list[int]]:
    """Per rank: the sequence lengths of :data:`MIXRES_RANKS` (2 or 4 ranks)."""
    from knapformer.data import sample_seq_lens

    mix = sample_seq_lens("paper-mixres", scale=4, seed=0)
    return [mix[r] for r in MIXRES_RANKS[world]]


def demo_rank(rank: int, world: int):
    """One CPU rank of the demo (the simulator's defaults): one pinned thread, freed memory
    kept, the same model weights on every rank, and a balancer with one bag of all ranks.
    Returns ``(model, balancer, model_config, sim_config)``; call after init_process_group."""
    import torch

    from knapformer.distributed import SequenceBalancer
    from knapformer.models import build_model, preset
    from knapformer.testing import keep_freed_memory, pin_to_core
    from knapformer.tools.sim_config import SimConfig
    from knapformer.workload import WorkloadModel

    torch.set_num_threads(1)
    pin_to_core(rank, world)
    keep_freed_memory()
    cfg = SimConfig()
    mcfg = preset(cfg.model)
    torch.manual_seed(cfg.seed)
    model = build_model(mcfg)
    bal = SequenceBalancer(f"g{world}n1", WorkloadModel(d_model=mcfg.dim, gamma=cfg.gamma, num_layers=mcfg.num_layers))
    return model, bal, mcfg, cfg


def demo_batch(rank: int, world: int, step: int, mcfg, cfg):
    """This rank's demo batch of ``step`` (fp32)."""
    import torch

    from knapformer.data.batches import make_batch

    return make_batch(
        cfg.mix,
        rank=rank,
        num_ranks=world,
        step=step,
        seed=cfg.seed,
        scale=cfg.scale,
        in_dim=mcfg.in_dim,
        vec_dim=mcfg.vec_dim,
        out_dim=mcfg.out_dim,
        dtype=torch.float32,
    )


def demo_loss(model, batch, bal, mode: str):
    """Forward + loss of one demo batch: ``unbalanced`` runs locally, any other mode plans the
    batch and runs through the balancer."""
    from knapformer.models import LocalExecutor

    if mode == "unbalanced":
        ex = LocalExecutor(batch.seq_lens)
    else:
        bal.plan(batch.seq_lens)
        ex = bal
    out = model(batch.x, batch.seq_lens, batch.txt_lens, batch.t, batch.vec, executor=ex)
    return ((out - batch.target) ** 2).mean()


def flux_h100():
    """(WorkloadModel, LinkModel) of the Flux size on the ``h100`` preset's links, the pricing
    the planner benchmarks share."""
    from knapformer.cluster import ModelShape, hardware
    from knapformer.integrations.registry import model_config
    from knapformer.workload import WorkloadModel

    hw = hardware("h100")
    shape = ModelShape.from_config(model_config("flux"))
    model = WorkloadModel(d_model=shape.dim, num_heads=shape.heads, num_layers=shape.layers)
    return model, hw.link(shape, units_per_second=hw.flop_units_per_second)
