"""Train the reference MMDiT from a dataset of mixed image resolutions and short videos, fed by
the token-budget sampler and balanced across ranks.

    torchrun --nproc-per-node 2 examples/sampler_train.py [--epochs 2] [--budget 2048]

The dataset knows each sample's token count without loading it (``lengths``), so the sampler
can pack every rank's batch up to ``--budget`` tokens, one bucket (resolution or frame count)
per batch, the same number of steps on every rank. ``PackedCollate`` concatenates the batch
into ``(sum L, C)`` + ``seq_lens``; the balancer then evens out the attention and MLP work of
each step (``max_tokens_per_rank`` bounds what a rank computes on after routing, the sampler's
budget what it loads). Resuming: ``sampler.state_dict(steps_done=...)`` next to the model's.
"""

import argparse

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from knapformer import SequenceBalancer, WorkloadModel
from knapformer.data import PackedCollate, TokenBudgetBatchSampler
from knapformer.models import build_model, preset
from knapformer.training import global_mean_loss, sum_gradients

CFG = preset("mmdit-tiny")
# (frames, height, width) in latent patches: 3 image resolutions and 2 short video shapes
SHAPES = [(1, 8, 8), (1, 16, 16), (1, 24, 32), (4, 8, 8), (8, 12, 16)]


class MixedResolution(Dataset):
    """Synthetic latents: sample i has shape SHAPES[i % 5] and 4-20 text tokens."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def shape(self, i: int) -> tuple[int, int, int]:
        return SHAPES[i % len(SHAPES)]

    def text_len(self, i: int) -> int:
        return 4 + (7 * i) % 17

    def length(self, i: int) -> int:  # tokens of the packed sequence: text then latents
        f, h, w = self.shape(i)
        return self.text_len(i) + f * h * w

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(i)
        n = self.length(i)
        return {
            "tokens": torch.randn(n, CFG.in_dim, generator=g),
            "target": torch.randn(n, CFG.out_dim, generator=g),
            "txt_len": self.text_len(i),  # an int: PackedCollate stacks it into an (S,) int64 tensor
            "t": torch.rand((), generator=g),
            "vec": torch.randn(CFG.vec_dim, generator=g),
        }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--samples", type=int, default=40)
    ap.add_argument("--budget", type=int, default=2048, help="tokens per rank per step the sampler packs")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    torch.manual_seed(0)  # the same initial weights on every rank
    model = build_model(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    bal = SequenceBalancer("auto", WorkloadModel(d_model=CFG.dim, num_heads=CFG.num_heads, num_layers=CFG.num_layers))

    ds = MixedResolution(args.samples)
    sampler = TokenBudgetBatchSampler(
        ds.length, args.budget, num_samples=len(ds), buckets=ds.shape, seed=0
    )  # rank and world from the process group
    loader = DataLoader(ds, batch_sampler=sampler, collate_fn=PackedCollate(("tokens", "target"), example=ds[0]))
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for step, batch in enumerate(loader):
            bal.plan(batch["seq_lens"])  # once per step
            out = model(batch["tokens"], batch["seq_lens"], batch["txt_len"], batch["t"], batch["vec"], executor=bal)
            err = ((out - batch["target"]) ** 2).sum()
            loss = global_mean_loss(err, out.numel(), gradients="sum")  # mean over every rank's tokens
            loss.backward()
            sum_gradients(model)
            opt.step()
            opt.zero_grad(set_to_none=True)
            total = loss.detach().clone()
            dist.all_reduce(total)
            tokens = torch.tensor([sum(batch["seq_lens"])])
            dist.all_reduce(tokens, op=dist.ReduceOp.MAX)
            if dist.get_rank() == 0:
                print(
                    f"epoch {epoch} step {step}: global mean loss {total.item():.4f}, "
                    f"{len(batch['seq_lens'])} samples / {sum(batch['seq_lens'])} tokens on rank 0 "
                    f"(largest rank {tokens.item()}), group sizes {sorted(set(map(len, bal.current_plan.groups)))}"
                )
        if dist.get_rank() == 0:
            print(f"epoch {epoch}: {len(sampler)} steps")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
