"""Train with each step's plan made ahead, in the DataLoader's worker processes.

    torchrun --nproc-per-node 2 examples/plans_ahead_train.py [--epochs 2] [--workers 2]

``examples/sampler_train.py`` plans on the training loop's thread: ``bal.plan(seq_lens)``
gathers every rank's lengths and solves, every step, while the GPU waits (0.1–0.6 s at 512 to
4,096 GPUs, docs/results.md). The token-budget sampler is a pure function of ``(seed, epoch)``,
so every process already knows every rank's lengths of every step. ``PlannedSteps`` iterates
the sampler's steps in the DataLoader's workers, solves each step there with the balancer's
planner (``bal.planner()``, a picklable snapshot of its settings) and hands the batch with its
plan; the loop runs it with ``bal.use_plan(plan)`` — no gather, no solve — and hands the next
step's plan to ``bal.plan_ahead``, whose digest is then agreed in this step's ``route``: a
steady step meets the whole group once (``route``'s agreement; ``with_next`` reads one step
ahead). The plans are the ones ``bal.plan`` would make (a test checks digests, outputs and
gradients against it).
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sampler_train import CFG, MixedResolution  # noqa: E402  (the same synthetic dataset)

from knapformer import SequenceBalancer, WorkloadModel  # noqa: E402
from knapformer.data import PackedCollate, PlannedSteps, TokenBudgetBatchSampler, with_next  # noqa: E402
from knapformer.models import build_model  # noqa: E402
from knapformer.training import global_mean_loss, sum_gradients  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--samples", type=int, default=40)
    ap.add_argument("--budget", type=int, default=2048, help="tokens per rank per step the sampler packs")
    ap.add_argument("--workers", type=int, default=2, help="DataLoader worker processes (they plan)")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cost = WorkloadModel(d_model=CFG.dim, num_heads=CFG.num_heads, num_layers=CFG.num_layers)
    bal = SequenceBalancer("auto", cost, link="free")

    ds = MixedResolution(args.samples)
    sampler = TokenBudgetBatchSampler(ds.length, args.budget, num_samples=len(ds), buckets=ds.shape, seed=0)
    collate = PackedCollate(("tokens", "target"), example=ds[0])
    steps = PlannedSteps(sampler, bal.planner(), dataset=ds, collate_fn=collate)
    loader = DataLoader(steps, batch_size=None, num_workers=args.workers)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # before iter(loader): the workers get the sampler then
        for step, after in with_next(loader):
            batch = step.batch
            bal.use_plan(step.plan)  # made in a worker; its digest agreed in the last step's route
            if after is not None:
                bal.plan_ahead(after.plan)  # rides on this step's route: the step's one collective
            out = model(batch["tokens"], batch["seq_lens"], batch["txt_len"], batch["t"], batch["vec"], executor=bal)
            err = ((out - batch["target"]) ** 2).sum()
            loss = global_mean_loss(err, out.numel(), gradients="sum")
            loss.backward()
            sum_gradients(model)
            opt.step()
            opt.zero_grad(set_to_none=True)
            total = loss.detach().clone()
            dist.all_reduce(total)
            if dist.get_rank() == 0:
                print(
                    f"epoch {epoch} step {step.step}: global mean loss {total.item():.4f}, "
                    f"{len(batch['seq_lens'])} samples on rank 0, plan made ahead in "
                    f"{1e3 * step.plan.plan_seconds:.1f} ms"
                )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
