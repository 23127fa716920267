"""Train through a rank failure: checkpoint every few steps, and let torchrun restart the job —
on as many ranks as before, or on another number — from the last checkpoint, losing nothing.

    torchrun --nproc-per-node 4 --max-restarts 1 examples/restart_train.py --ckpt runs/restart
    torchrun --nproc-per-node 4 --max-restarts 1 examples/restart_train.py --ckpt runs/restart \\
        --kill-at 5 --kill-rank 2        # rank 2 dies at step 5; torchrun restarts all 4 ranks
    torchrun --nproc-per-node 3 examples/restart_train.py --ckpt runs/restart   # resume on 3 ranks

What a checkpoint holds (plain ``torch.save``, written by rank 0 and swapped in atomically):
the model and optimizer (identical on every rank: gradients are summed over all ranks), the
sampler's position (a few numbers: epoch, steps consumed, ranks), and the balancer's state
(its cost model fit). After a restart every rank loads it: on the same number of ranks the
run continues exactly as if nothing had happened (same batches, same plans, same losses in
fp64); on another number the sampler deals the epoch's remaining samples over the new ranks
(every sample still exactly once in that epoch) and the balancer keeps its fitted cost model.

``--record`` (rank 0) appends one JSON line per step: attempt, ranks, epoch, step, the step
it resumed at, the global mean loss and the sample indices every rank trained on (the tests
read it). ``--kill-at`` kills one
rank with SIGKILL at that global step of the first attempt only (``TORCHELASTIC_RESTART_COUNT``
0 and no checkpoint loaded): the others leave the exchange they wait in with
``PeerLostError`` at once, and the launcher restarts the job.
"""

import argparse
import json
import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from knapformer import SequenceBalancer, WorkloadModel
from knapformer.data import PackedCollate, TokenBudgetBatchSampler
from knapformer.models import build_model, preset
from knapformer.training import global_mean_loss, init_restartable, sum_gradients

CFG = preset("mmdit-tiny")
SHAPES = [(1, 4, 4), (1, 8, 8), (1, 8, 12), (2, 4, 8)]  # (frames, height, width) in latent patches


class Mixed(Dataset):
    """Synthetic fp64 latents: sample i has shape SHAPES[i % 4] and 3-9 text tokens."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def shape(self, i: int):
        return SHAPES[i % len(SHAPES)]

    def text_len(self, i: int) -> int:
        return 3 + (5 * i) % 7

    def length(self, i: int) -> int:
        f, h, w = self.shape(i)
        return self.text_len(i) + f * h * w

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(i)
        n = self.length(i)
        return {
            "tokens": torch.randn(n, CFG.in_dim, generator=g, dtype=torch.float64),
            "target": torch.randn(n, CFG.out_dim, generator=g, dtype=torch.float64),
            "txt_len": torch.tensor(self.text_len(i)),
            "t": torch.rand((), generator=g, dtype=torch.float64),
            "vec": torch.randn(CFG.vec_dim, generator=g, dtype=torch.float64),
            "index": torch.tensor(i),
        }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True, help="checkpoint folder (resumed from when it holds one)")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--budget", type=int, default=150, help="tokens per rank per step the sampler packs")
    ap.add_argument("--every", type=int, default=2, help="checkpoint every this many steps")
    ap.add_argument("--kill-at", type=int, default=None, help="global step at which --kill-rank dies (first attempt)")
    ap.add_argument("--kill-rank", type=int, default=1)
    ap.add_argument("--record", default=None, help="rank 0 appends a JSON line per step here")
    ap.add_argument(
        "--link",
        choices=("measure", "free"),
        default="measure",
        help="links the plans price: measured at start-up (a restart reuses the checkpoint's), or free; "
        "two separate jobs plan alike only with the same links (the tests compare two with free)",
    )
    args = ap.parse_args()
    attempt = init_restartable("gloo")  # a key space per restart (a plain init_process_group breaks)
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial weights on every rank
    model = build_model(CFG).double()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cost = WorkloadModel(d_model=CFG.dim, num_heads=CFG.num_heads, num_layers=CFG.num_layers)
    bal = SequenceBalancer("auto", cost, collective_timeout_s=60, link=args.link)
    ds = Mixed(args.samples)
    sampler = TokenBudgetBatchSampler(ds.length, args.budget, num_samples=len(ds), buckets=ds.shape, seed=0)
    collate = PackedCollate(("tokens", "target"), example=ds[0])
    loader = DataLoader(ds, batch_sampler=sampler, collate_fn=collate)

    ckpt = Path(args.ckpt) / "last.pt"
    first_epoch, step, resumed = 0, 0, False  # step: global steps done
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sampler.load_state_dict(state["sampler"])  # on another number of ranks: the epoch's remaining samples
        bal.load_state_dict(state["balancer"])
        first_epoch, step, resumed = state["epoch"], state["step"], True
    first = step
    if rank == 0:
        print(f"attempt {attempt}: {world} ranks, {'resumed at step ' + str(step) if resumed else 'fresh start'}")
    for epoch in range(first_epoch, args.epochs):
        sampler.set_epoch(epoch)
        start = sampler.pass_start  # where this pass begins (a resumed one: not at 0)
        for i, batch in enumerate(loader):
            if args.kill_at == step and rank == args.kill_rank and attempt == 0 and not resumed:
                os.kill(os.getpid(), signal.SIGKILL)
            bal.plan(batch["seq_lens"])
            out = model(batch["tokens"], batch["seq_lens"], batch["txt_len"], batch["t"], batch["vec"], executor=bal)
            loss = global_mean_loss(((out - batch["target"]) ** 2).sum(), out.numel(), gradients="sum")
            loss.backward()
            sum_gradients(model)
            opt.step()
            opt.zero_grad(set_to_none=True)
            total = loss.detach().clone()
            dist.all_reduce(total)
            seen = [None] * world
            dist.all_gather_object(seen, batch["index"].tolist())
            step += 1
            if rank == 0:
                line = {"attempt": attempt, "ranks": world, "epoch": epoch, "step": step, "loss": total.item()}
                line["resumed_at"] = first  # steps after it that an earlier attempt recorded were lost
                print(f"epoch {epoch} step {step}: global mean loss {line['loss']:.6f}", flush=True)
                if args.record:
                    with open(args.record, "a") as f:
                        f.write(json.dumps({**line, "samples": seen}) + "\n")
            if step % args.every == 0:  # every rank joins bal.state_dict (a collective); rank 0 writes
                state = {
                    "model": model.state_dict(),
                    "opt": opt.state_dict(),
                    "sampler": sampler.state_dict(steps_done=start + i + 1),
                    "balancer": bal.state_dict(),
                    "epoch": epoch,
                    "step": step,
                }
                if rank == 0:
                    ckpt.parent.mkdir(parents=True, exist_ok=True)
                    torch.save(state, ckpt.with_suffix(".tmp"))
                    os.replace(ckpt.with_suffix(".tmp"), ckpt)
                dist.barrier()
    if rank == 0:
        print(f"done: {step} steps")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
