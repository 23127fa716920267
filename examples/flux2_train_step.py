"""Balanced training steps of a stock diffusers Flux2Transformer2DModel (tiny, random init),
one sample editing with a reference image.

torchrun --nproc-per-node 2 examples/flux2_train_step.py

The loss is the mean over the image tokens of *all* ranks (each rank sums its squared errors
and divides by the global count); reference-image tokens condition the image but have no
output, as in the stock pipeline.
"""

import torch
import torch.distributed as dist
from diffusers import Flux2Transformer2DModel

from knapformer import BalancerConfig, SequenceBalancer, WorkloadModel
from knapformer.integrations.flux2 import Flux2Sample, flux2_seq_lens, packed_flux2_forward
from knapformer.training import global_mean_loss, sum_gradients

dist.init_process_group("gloo")
torch.manual_seed(0)  # the same initial weights on every rank
model = Flux2Transformer2DModel(
    in_channels=16,
    num_layers=1,
    num_single_layers=2,
    attention_head_dim=16,
    num_attention_heads=4,
    joint_attention_dim=32,
    timestep_guidance_channels=32,
    axes_dims_rope=(4, 4, 4, 4),
    guidance_embeds=False,
)
c = model.config
cost = WorkloadModel(
    d_model=c.num_attention_heads * c.attention_head_dim,
    num_layers=c.num_layers + c.num_single_layers,
    num_heads=c.num_attention_heads,
)
bal = SequenceBalancer(BalancerConfig(layout="auto", cost=cost))
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
g = torch.Generator().manual_seed(dist.get_rank())


def ids(h, w, t=0):  # (t, row, column, 0) of each latent token
    grid = torch.stack(torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij"), -1).reshape(-1, 2)
    return torch.cat([torch.full((h * w, 1), t), grid, torch.zeros(h * w, 1)], dim=1).float()


def sample(h, w, txt, ref=None):  # an h*w latent image, txt text tokens, optionally a reference
    return Flux2Sample(
        latents=torch.randn(h * w, 16, generator=g),
        text=torch.randn(txt, 32, generator=g),
        timestep=torch.rand((), generator=g),
        img_ids=ids(h, w),
        txt_ids=torch.zeros(txt, 4),
        ref_latents=None if ref is None else torch.randn(ref[0] * ref[1], 16, generator=g),
        ref_ids=None if ref is None else ids(*ref, t=10),
    )


for step in range(2):
    samples = [sample(8, 8, 10), sample(4, 6, 3)] if dist.get_rank() == 0 else [sample(24, 24, 20, ref=(16, 16))]
    bal.plan(flux2_seq_lens(model, samples))  # once per step: text + image + reference tokens per sample
    out = packed_flux2_forward(model, samples, bal)  # per-sample (T_img, C), original order
    targets = torch.randn(out.flat.shape, generator=g)
    err = ((out.flat - targets) ** 2).sum()
    loss = global_mean_loss(err, out.flat.numel(), gradients="sum")  # the mean over every rank's image values
    loss.backward()
    sum_gradients(model)  # plain data parallel (or FSDP2 per block, with gradients="mean")
    opt.step()
    opt.zero_grad(set_to_none=True)
    total = loss.detach().clone()
    dist.all_reduce(total)
    if dist.get_rank() == 0:
        degrees = sorted(set(map(len, bal.current_plan.groups)))
        print(f"step {step}: global mean loss {total.item():.4f}, group sizes this step {degrees}")
dist.destroy_process_group()
