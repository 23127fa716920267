"""One balanced training step of a stock diffusers FluxTransformer2DModel (tiny, random init).

torchrun --nproc-per-node 2 examples/flux_train_step.py
"""

import torch
import torch.distributed as dist
from diffusers import FluxTransformer2DModel

from knapformer import SequenceBalancer, WorkloadModel
from knapformer.integrations.diffusers import FluxSample, flux_seq_lens, packed_flux_forward

dist.init_process_group("gloo")  # torchrun --nproc-per-node 2 train.py
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
bal = SequenceBalancer("g2n1", WorkloadModel(d_model=128))
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)


def sample(h, w, txt):  # one image of h*w latent tokens + txt text tokens
    ids = torch.stack(torch.meshgrid(torch.arange(1), torch.arange(h), torch.arange(w), indexing="ij"), -1)
    return FluxSample(
        latents=torch.randn(h * w, 16),
        text=torch.randn(txt, 32),
        pooled=torch.randn(32),
        timestep=torch.rand(()),
        img_ids=ids.reshape(-1, 3).float(),
        txt_ids=torch.zeros(txt, 3),
    )


samples = [sample(8, 8, 10), sample(4, 6, 3)] if dist.get_rank() == 0 else [sample(32, 32, 20)]
bal.plan(flux_seq_lens(samples))  # once per step: text + image tokens of each sample
out = packed_flux_forward(model, samples, bal)  # per-sample (T_img, C), original order
targets = torch.cat([torch.randn_like(o) for o in out]) if out else out.flat
loss = ((out.flat - targets) ** 2).mean()
loss.backward()  # every rank, also one without samples (out.flat)
for p in model.parameters():  # plain data parallel (or FSDP2 per block)
    dist.all_reduce(p.grad)
opt.step()
print(f"rank {dist.get_rank()}: {len(samples)} samples, loss {loss.item():.4f}")
dist.destroy_process_group()
