"""Train from a dataset in Parquet shards: latents and text embeddings read by DataLoader
workers, token-budget batches from shared memory-mapped lengths, balanced across ranks.

    torchrun --nproc-per-node 2 examples/sharded_train.py [--samples 240] [--shards 6] [--steps 2]

Rank 0 writes the dataset (``knapformer.data.write_shards``: each sample's latent patches and
text embedding as bytes, with its token count and latent shape) to a temporary folder; every
rank then maps the ``tokens`` and ``bucket`` columns (computed one shard at a time into ``.npy``
files beside the shards, so the processes of a node share the pages), deals token-budget
batches with ``TokenBudgetBatchSampler`` — window by window here (``--window``), as for a
dataset of millions — and reads its batch's samples in two ``DataLoader`` workers, each keeping
the shard it read last. ``PackedCollate`` packs them; the balancer plans each step.

The check (fp64): the balanced step's parameter gradients, summed over ranks, equal the same
model run on every sample alone in this process — per-sample math, whatever the plan did.
"""

import argparse
import shutil
import tempfile

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from knapformer import SequenceBalancer, WorkloadModel
from knapformer.data import PackedCollate, ParquetShards, TokenBudgetBatchSampler, write_shards
from knapformer.models import build_model, preset
from knapformer.training import sum_gradients

CFG = preset("mmdit-tiny")
SHAPES = [(1, 4, 4), (1, 8, 8), (1, 6, 10), (3, 4, 4), (5, 4, 6)]
"""Latent grids (frames, rows, columns) in patches: three images and two short clips."""


def samples(n: int):
    """The dataset's rows: latent patches (f·h·w, in_dim) and text (4–20, in_dim) as float32
    bytes, their token count (the packed sequence: text then latents) and latent shape."""
    for i in range(n):
        rng = np.random.default_rng(i)
        f, h, w = SHAPES[int(rng.integers(len(SHAPES)))]
        txt = int(rng.integers(4, 21))
        latents = rng.standard_normal((f * h * w, CFG.in_dim)).astype(np.float32)
        text = rng.standard_normal((txt, CFG.in_dim)).astype(np.float32)
        yield {
            "latents": latents.tobytes(),
            "text": text.tobytes(),
            "txt_len": txt,
            "tokens": txt + f * h * w,
            "bucket": (f << 20) | (h << 10) | w,
            "t": float(rng.random()),
        }


class ShardedLatents(Dataset):
    """Sample i from the shards: tokens (L, in_dim) = text then latents, float64."""

    def __init__(self, root: str) -> None:
        self.shards = ParquetShards(root)

    def __len__(self) -> int:
        return len(self.shards)

    def __getitem__(self, i: int) -> dict:
        row = self.shards[i]
        text = np.frombuffer(row["text"], dtype=np.float32).reshape(-1, CFG.in_dim)
        lat = np.frombuffer(row["latents"], dtype=np.float32).reshape(-1, CFG.in_dim)
        tokens = torch.from_numpy(np.concatenate([text, lat])).double()
        g = torch.Generator().manual_seed(i)
        return {
            "tokens": tokens,
            "target": torch.randn(tokens.shape[0], CFG.out_dim, generator=g, dtype=torch.float64),
            "txt_len": int(row["txt_len"]),
            "t": torch.tensor(row["t"], dtype=torch.float64),
            "vec": torch.randn(CFG.vec_dim, generator=g, dtype=torch.float64),
        }


def per_sample_grads(model, ds: ShardedLatents, indices) -> list[torch.Tensor]:
    """The same loss on each sample alone, in this process (no balancer): gradients."""
    model.zero_grad(set_to_none=True)
    for i in indices:
        s = ds[i]
        n = s["tokens"].shape[0]
        out = model(s["tokens"], [n], torch.tensor([s["txt_len"]]), s["t"][None], s["vec"][None])
        ((out - s["target"]) ** 2).sum().backward()
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=240)
    ap.add_argument("--shards", type=int, default=6)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--budget", type=int, default=1024, help="tokens per rank per step the sampler packs")
    ap.add_argument("--window", type=int, default=64, help="samples per window of the sampler's deal")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    folder = [tempfile.mkdtemp(prefix="knapformer-shards-") if rank == 0 else None]
    if rank == 0:
        write_shards(folder[0], samples(args.samples), rows_per_shard=-(-args.samples // args.shards))
    dist.broadcast_object_list(folder)
    ds = ShardedLatents(folder[0])
    if rank == 0:  # each column read into a .npy file once, beside the shards; then every rank maps it
        ds.shards.column("tokens", np.int32)
        ds.shards.column("bucket", np.int64)
    dist.barrier()
    lengths, buckets = ds.shards.column("tokens", np.int32), ds.shards.column("bucket", np.int64)
    sampler = TokenBudgetBatchSampler(lengths, args.budget, buckets=buckets, window=args.window, block=8, seed=0)
    loader = DataLoader(
        ds, batch_sampler=sampler, num_workers=2, collate_fn=PackedCollate(("tokens", "target"), example=ds[0])
    )
    torch.manual_seed(0)  # the same initial weights on every rank
    model = build_model(CFG).double()
    bal = SequenceBalancer(
        "auto", WorkloadModel(d_model=CFG.dim, num_heads=CFG.num_heads, num_layers=CFG.num_layers), link="free"
    )
    worst = 0.0
    for step, batch in zip(range(args.steps), loader):
        bal.plan(batch["seq_lens"])
        model.zero_grad(set_to_none=True)
        out = model(batch["tokens"], batch["seq_lens"], batch["txt_len"], batch["t"], batch["vec"], executor=bal)
        loss = ((out - batch["target"]) ** 2).sum()
        loss.backward()
        sum_gradients(model)  # summed over ranks
        balanced = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
        # per-sample math: every rank's samples of this step, each alone here
        mine = sampler.steps()[step]
        ref = per_sample_grads(model, ds, [i for b in mine for i in b])
        err = max(float((a - b).abs().max() / b.abs().max().clamp(min=1e-30)) for a, b in zip(balanced, ref))
        worst = max(worst, err)
        if rank == 0:
            print(
                f"step {step}: {len(batch['seq_lens'])} samples / {sum(batch['seq_lens'])} tokens on rank 0, "
                f"gradient error vs per-sample math {err:.2e}"
            )
    del loader  # its workers end before the folder goes
    dist.barrier()
    if rank == 0:
        print(f"worst gradient error vs per-sample math {worst:.2e} ({len(ds)} samples in {args.shards} shards)")
        shutil.rmtree(folder[0], ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
