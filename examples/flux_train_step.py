"""Balanced training steps of a stock diffusers FluxTransformer2DModel (tiny, random init).

torchrun --nproc-per-node 2 examples/flux_train_step.py

The loss is the mean over the image tokens of *all* ranks: each rank sums its squared errors
and divides by the global token count (one all-reduce of a scalar), and the gradients are
summed over ranks. A per-rank ``.mean()`` with averaged gradients would weight the tokens of
a rank with few tokens more than those of a rank with many.
"""

import torch
import torch.distributed as dist
from diffusers import FluxTransformer2DModel

from knapformer import BalancerConfig, SequenceBalancer
from knapformer.integrations.flux import FluxSample, flux_seq_lens, flux_workload, packed_flux_forward
from knapformer.training import global_mean_loss, sum_gradients

dist.init_process_group("gloo")
torch.manual_seed(0)  # the same initial weights on every rank
model = FluxTransformer2DModel(
    in_channels=16,
    num_layers=2,
    num_single_layers=2,
    attention_head_dim=32,
    num_attention_heads=4,
    joint_attention_dim=32,
    pooled_projection_dim=32,
    axes_dims_rope=(8, 12, 12),
)
bal = SequenceBalancer(BalancerConfig(layout="auto", cost=flux_workload(model)))
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
g = torch.Generator().manual_seed(dist.get_rank())


def sample(h, w, txt):  # one image of h*w latent tokens + txt text tokens
    ids = torch.stack(torch.meshgrid(torch.arange(1), torch.arange(h), torch.arange(w), indexing="ij"), -1)
    return FluxSample(
        latents=torch.randn(h * w, 16, generator=g),
        text=torch.randn(txt, 32, generator=g),
        pooled=torch.randn(32, generator=g),
        timestep=torch.rand((), generator=g),
        img_ids=ids.reshape(-1, 3).float(),
        txt_ids=torch.zeros(txt, 3),
    )


for step in range(2):
    samples = [sample(8, 8, 10), sample(4, 6, 3)] if dist.get_rank() == 0 else [sample(32, 32, 20)]
    bal.plan(flux_seq_lens(model, samples))  # once per step: text + image tokens per sample
    out = packed_flux_forward(model, samples, bal)  # per-sample (T_img, C), original order
    targets = torch.randn(out.flat.shape, generator=g)
    err = ((out.flat - targets) ** 2).sum()
    loss = global_mean_loss(err, out.flat.numel(), gradients="sum")  # the mean over every rank's image values
    loss.backward()  # every rank, also one without samples (out.flat is connected)
    sum_gradients(model)  # plain data parallel (or FSDP2 per block, with gradients="mean")
    opt.step()
    opt.zero_grad(set_to_none=True)
    total = loss.detach().clone()
    dist.all_reduce(total)
    if dist.get_rank() == 0:
        degrees = sorted(set(map(len, bal.current_plan.groups)))
        print(f"step {step}: global mean loss {total.item():.4f}, group sizes this step {degrees}")
dist.destroy_process_group()
