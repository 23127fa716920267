"""Your own video + image DiT, balanced with knapformer and sharded with FSDP2, checked in fp64
against the same model run on every sample alone.

    torchrun --nproc-per-node 2 examples/own_dit.py    # CPU, gloo (any number of ranks)

docs/own_model.md walks through this file block by block (its code blocks are this file).
The model is the kind a team writes itself: a per-sample patch embedding of (C, T, H, W)
latents (an image is one frame), per-sample adaLN-Zero modulation, 3-D RoPE, joint [text;
visual] self-attention, cross-attention to a separate context, and GQA (4 query heads, 2
key/value heads). Rank 1 holds no sample. Each step prints the global mean loss and the
largest relative difference of the outputs and of every parameter gradient from the
per-sample computation; the script fails if either exceeds 1e-10.
"""

import copy
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard

from knapformer import SequenceBalancer, WorkloadModel
from knapformer.executor import LocalExecutor
from knapformer.training import global_mean_loss

# Legend: S samples, T tokens of this rank (text and visual, packed), R routed tokens,
# M routed context rows, D model width.
C, PATCH = 4, (1, 2, 2)  # latent channels; patch size in (frames, rows, columns)
D, HEADS, KV_HEADS, LAYERS = 48, 4, 2, 2
HEAD_DIM = D // HEADS
ROPE_AXES = (4, 4, 4)  # head dims rotated by the frame, row and column positions (sum = HEAD_DIM)
TXT_DIM, CTX_DIM, FREQ_DIM = 16, 12, 32  # text-encoder width, context width, timestep sinusoid width
PATCH_DIM = C * math.prod(PATCH)
DTYPE = torch.float64  # for the exactness check; a real run loads fp32 data and computes in bf16


# --- samples: what one rank loads -------------------------------------------------------------
@dataclass
class Sample:
    latents: torch.Tensor  # (C, T, H, W); an image is T = 1
    text: torch.Tensor  # (L_txt, TXT_DIM): joins the visual tokens in self-attention
    context: torch.Tensor  # (L_ctx, CTX_DIM): cross-attended (a second encoder, a reference image)
    t: torch.Tensor  # () diffusion time in [0, 1]
    target: torch.Tensor  # (C, T, H, W)


def patchify(latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(C, T, H, W) -> (N, PATCH_DIM) patch tokens and their (N, 3) integer (frame, row,
    column) positions. With the linear patch embedding below this is a Conv3d whose kernel and
    stride are the patch, run on this sample alone."""
    c, t, h, w = latents.shape
    (pt, ph, pw), grid = PATCH, (t // PATCH[0], h // PATCH[1], w // PATCH[2])
    x = latents.reshape(c, grid[0], pt, grid[1], ph, grid[2], pw).permute(1, 3, 5, 0, 2, 4, 6)
    pos = torch.stack(torch.meshgrid(*(torch.arange(n) for n in grid), indexing="ij"), -1)
    return x.reshape(-1, PATCH_DIM), pos.reshape(-1, 3)


def unpatchify(x: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Inverse of :func:`patchify`: (N, PATCH_DIM) -> (C, T, H, W)."""
    c, t, h, w = shape
    (pt, ph, pw), grid = PATCH, (t // PATCH[0], h // PATCH[1], w // PATCH[2])
    x = x.reshape(*grid, c, pt, ph, pw).permute(3, 0, 4, 1, 5, 2, 6)
    return x.reshape(c, t, h, w)


# --- packing: every sample of a rank in one token stream, [text_i; visual_i] per sample ---------
@dataclass
class Packed:
    seq_lens: list[int]  # tokens per sample: text + visual
    text: torch.Tensor  # (sum L_txt, TXT_DIM)
    patches: torch.Tensor  # (sum N, PATCH_DIM)
    order: torch.Tensor  # (T,) row of cat([text, patches]) for each token of the stream
    pos: torch.Tensor  # (T, 3) int64 (frame, row, column); text tokens (0, 0, 0)
    is_text: torch.Tensor  # (T,) bool
    visual: torch.Tensor  # (sum N,) the visual tokens' places in the stream, sample by sample
    t: torch.Tensor  # (S,)
    context: torch.Tensor  # (sum L_ctx, CTX_DIM)
    context_lens: list[int]


def pack(samples: list[Sample]) -> Packed:
    """A rank's samples as one stream. With no samples every tensor has zero rows
    (``torch.zeros(0, ...)``, no autograd history): the model runs on them unchanged."""
    text_rows, patch_rows, order, pos, is_text, visual, seq_lens = [], [], [], [], [], [], []
    n_text = sum(s.text.shape[0] for s in samples)
    start = t_row = p_row = 0
    for s in samples:
        patches, grid = patchify(s.latents)
        lt, n = s.text.shape[0], patches.shape[0]
        text_rows.append(s.text)
        patch_rows.append(patches)
        order += [torch.arange(t_row, t_row + lt), torch.arange(n_text + p_row, n_text + p_row + n)]
        pos += [torch.zeros(lt, 3, dtype=torch.int64), grid]
        is_text += [torch.ones(lt, dtype=torch.bool), torch.zeros(n, dtype=torch.bool)]
        visual.append(torch.arange(start + lt, start + lt + n))
        seq_lens.append(lt + n)
        start, t_row, p_row = start + lt + n, t_row + lt, p_row + n

    def cat(parts, *empty_shape, dtype=DTYPE):
        return torch.cat(parts) if parts else torch.zeros(0, *empty_shape, dtype=dtype)

    return Packed(
        seq_lens=seq_lens,
        text=cat(text_rows, TXT_DIM),
        patches=cat(patch_rows, PATCH_DIM),
        order=cat(order, dtype=torch.int64),
        pos=cat(pos, 3, dtype=torch.int64),
        is_text=cat(is_text, dtype=torch.bool),
        visual=cat(visual, dtype=torch.int64),
        t=cat([s.t.reshape(1) for s in samples]),
        context=cat([s.context for s in samples], CTX_DIM),
        context_lens=[s.context.shape[0] for s in samples],
    )


# --- layers -----------------------------------------------------------------------------------
def timestep_sinusoid(t_S: torch.Tensor) -> torch.Tensor:
    half = FREQ_DIM // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float64) / half)
    angles = 1000.0 * t_S.to(torch.float64)[:, None] * freqs
    return torch.cat([angles.cos(), angles.sin()], -1)


def rope_angles(pos_R3: torch.Tensor) -> torch.Tensor:
    """3-D RoPE: each axis (frame, row, column) rotates its own slice of the head dim by its
    integer position -> (R, HEAD_DIM / 2) angles (fp64 here; fp32 in a bf16 model)."""
    parts = []
    for axis, dim in enumerate(ROPE_AXES):
        freqs = 10000.0 ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        parts.append(pos_R3[:, axis, None].to(torch.float64) * freqs)
    return torch.cat(parts, -1)


def apply_rope(x_RHd: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    cos, sin = angles.cos()[:, None].to(x_RHd.dtype), angles.sin()[:, None].to(x_RHd.dtype)
    x1, x2 = x_RHd[..., 0::2], x_RHd[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).flatten(-2)


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale) + shift


# --- the block ---------------------------------------------------------------------------------
class Block(nn.Module):
    """adaLN-Zero DiT block: joint self-attention with 3-D RoPE (GQA), cross-attention to the
    sample's context, MLP. Text and visual tokens get their own modulation."""

    def __init__(self) -> None:
        super().__init__()
        self.ada = nn.Linear(D, 2 * 6 * D)  # per sample: 6 vectors for visual tokens, 6 for text
        nn.init.zeros_(self.ada.weight)  # adaLN-Zero: every gate starts at 0
        nn.init.zeros_(self.ada.bias)
        self.norm1 = nn.LayerNorm(D, elementwise_affine=False, eps=1e-6)
        self.qkv = nn.Linear(D, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
        self.proj = nn.Linear(D, D)
        self.norm_x = nn.LayerNorm(D, eps=1e-6)
        self.xq = nn.Linear(D, D)
        self.xkv = nn.Linear(D, 2 * KV_HEADS * HEAD_DIM)
        self.xproj = nn.Linear(D, D)
        self.norm2 = nn.LayerNorm(D, elementwise_affine=False, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(approximate="tanh"), nn.Linear(4 * D, D))

    def forward(self, h_RD, c_SD, seq_id, is_text, pos, context, context_MD, ex):
        visual, text = self.ada(F.silu(c_SD)).chunk(2, -1)  # once per sample of the whole group
        # rows of c_SD are group sequence ids, seq_id is each routed token's: [seq_id] = its sample's row
        mod = torch.where(is_text[:, None], text[seq_id], visual[seq_id])  # (R, 6D)
        shift1, scale1, gate1, shift2, scale2, gate2 = mod.chunk(6, -1)
        x = modulate(self.norm1(h_RD), shift1, scale1)
        angles = rope_angles(pos)  # from int64 positions here: FSDP2's mixed precision casts float arguments
        q, k, v = self.qkv(x).split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], -1)
        q = apply_rope(q.reshape(-1, HEADS, HEAD_DIM), angles)
        k = apply_rope(k.reshape(-1, KV_HEADS, HEAD_DIM), angles)
        o = ex.attention(q, k, v.reshape(-1, KV_HEADS, HEAD_DIM))  # within each sample, all its tokens
        h_RD = h_RD + gate1 * self.proj(o.reshape(-1, D))
        xq = self.xq(self.norm_x(h_RD)).reshape(-1, HEADS, HEAD_DIM)
        xk, xv = self.xkv(context_MD).reshape(-1, 2, KV_HEADS, HEAD_DIM).unbind(1)
        h_RD = h_RD + self.xproj(ex.cross_attention(xq, xk, xv, context).reshape(-1, D))  # no exchange
        return h_RD + gate2 * self.mlp(modulate(self.norm2(h_RD), shift2, scale2))


# --- the model: single-device code with an executor handle ------------------------------------
class OwnDiT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.patch_in = nn.Linear(PATCH_DIM, D)
        self.text_in = nn.Linear(TXT_DIM, D)
        self.context_in = nn.Linear(CTX_DIM, D)
        self.time_in = nn.Sequential(nn.Linear(FREQ_DIM, D), nn.SiLU(), nn.Linear(D, D))
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm_out = nn.LayerNorm(D, elementwise_affine=False, eps=1e-6)
        self.ada_out = nn.Linear(D, 2 * D)
        self.proj_out = nn.Linear(D, PATCH_DIM)

    def forward(self, batch: Packed, ex) -> torch.Tensor:
        """This rank's samples -> their visual tokens' outputs (sum N, PATCH_DIM), in order."""
        # 1. per-sample conditioning on the rank that loaded the sample, then the whole group's
        #    table (one differentiable all-gather). Its rows are in group sequence-id order — rank
        #    0's samples in its order, then rank 1's, … — the numbering routed_positions uses, so
        #    c_SD[seq_id] is each routed token's own sample's row
        c_SD = self.time_in(timestep_sinusoid(batch.t).to(self.time_in[0].weight.dtype))
        (c_SD,) = ex.gather_sequences(c_SD)
        # 2. embed the packed rows: every layer runs on every rank (zero rows on an empty one)
        h = torch.cat([self.text_in(batch.text), self.patch_in(batch.patches)])[batch.order]
        # 3. route the tokens with what each token needs beside it: its position and its stream
        h, pos, is_text = ex.route(
            h, batch.pos, batch.is_text, seq_lens=batch.seq_lens, names=("tokens", "positions", "is_text")
        )
        seq_id, _ = ex.routed_positions(h)  # the group sequence id of every routed token
        context = ex.route_context(batch.context, batch.context_lens)  # once per step, every layer reuses it
        context_MD = self.context_in(context.rows)
        for block in self.blocks:
            h = block(h, c_SD, seq_id, is_text, pos, context, context_MD, ex)
        shift, scale = self.ada_out(F.silu(c_SD))[seq_id].chunk(2, -1)
        out = ex.reverse_route(self.proj_out(modulate(self.norm_out(h), shift, scale)))  # (T, PATCH_DIM)
        return out[batch.visual]


# --- the cost model the planner prices sequences with ---------------------------------------
def own_workload(typical_context_len: int) -> WorkloadModel:
    """The planner's cost of one sequence in forward FLOPs per layer (the unit of the
    integrations' ``*_workload`` models). Per token: self-attention q/o (2·D²) and GQA k/v
    (2·D²·KV_HEADS/HEADS), cross-attention q/o (2·D²), the 4× MLP (8·D²) multiply-adds, 2 FLOPs
    each; per (query, context token) pair: scores and values, 4·D FLOPs whatever the kv heads.
    The model prices each rank's projection of a sample's context at 4·D²·C."""
    kv = KV_HEADS / HEADS
    return WorkloadModel(
        d_model=D,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        num_layers=LAYERS,
        linear=2.0 * (2 + 2 * kv + 2 + 8) * D * D,
        context_len=typical_context_len,
        cross=4.0 * D,
    )


# --- data of this sketch: rank 0 a video and an image, rank 1 nothing, others images ----------
def rank_samples(rank: int, step: int) -> list[Sample]:
    g = torch.Generator().manual_seed(1000 * step + rank)

    def sample(frames, h, w, words, ctx):
        shape = (C, frames, h, w)
        return Sample(
            latents=torch.randn(shape, generator=g, dtype=DTYPE),
            text=torch.randn(words, TXT_DIM, generator=g, dtype=DTYPE),
            context=torch.randn(ctx, CTX_DIM, generator=g, dtype=DTYPE),
            t=torch.rand((), generator=g, dtype=DTYPE),
            target=torch.randn(shape, generator=g, dtype=DTYPE),
        )

    if rank == 0:
        return [sample(5 + 2 * step, 8, 12, 7, 6), sample(1, 8, 8, 5, 3)]
    if rank == 1:
        return []  # no sample this step: the rank still runs every call on zero rows
    return [sample(1, 12, 8, 6, 4), sample(1, 4, 4 + 4 * step, 3, 5)]


def loss_sum(outs: list[torch.Tensor], samples: list[Sample], flat: torch.Tensor) -> torch.Tensor:
    """Summed squared error over this rank's samples. ``0 * flat.sum()`` keeps the loss a
    tensor of the model's output on a rank with no samples (``sum`` of nothing is the int 0):
    that rank's backward must run too, since it joins the exchanges' and FSDP2's collectives."""
    return sum((((o - s.target) ** 2).sum() for o, s in zip(outs, samples)), 0 * flat.sum())


def outputs(model: nn.Module, samples: list[Sample], ex) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Per-sample (C, T, H, W) outputs and the flat (sum N, PATCH_DIM) tensor they come from."""
    flat = model(pack(samples), ex)
    parts = flat.split([math.prod(s.latents.shape[1:]) // math.prod(PATCH) for s in samples])
    return [unpatchify(p, s.latents.shape) for p, s in zip(parts, samples)], flat


# --- the check: the same math, every sample alone in one process ------------------------------
def per_sample_reference(ref: nn.Module, everyone: list[list[Sample]], total: int):
    """Gradients of the global mean loss and each sample's output, one sample at a time with no
    balancer (``LocalExecutor``: tokens stay, attention within the one sequence)."""
    ref.zero_grad(set_to_none=True)
    outs = []
    for samples in everyone:
        outs.append([])
        for s in samples:
            (o,), flat = outputs(ref, [s], LocalExecutor(pack([s]).seq_lens))
            (loss_sum([o], [s], flat) / total).backward()
            outs[-1].append(o.detach())
    return outs, {name: p.grad for name, p in ref.named_parameters()}


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item() if b.numel() else 0.0


# --- the training step: FSDP2, plan, forward, global-mean loss, backward, check ---------------
def main() -> None:
    dist.init_process_group("gloo")  # "nccl" with CUDA tensors on GPUs
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial weights on every rank
    model = OwnDiT().to(DTYPE)
    for block in model.blocks:  # the check needs non-zero gates, or most gradients would be 0 = 0
        nn.init.normal_(block.ada.weight, std=0.05)
    ref = copy.deepcopy(model)  # unsharded, for the per-sample check
    for block in model.blocks:  # FSDP2: each block, then the root (embedders, output layer)
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    bal = SequenceBalancer("auto", own_workload(typical_context_len=8))

    for step in range(2):
        samples = rank_samples(rank, step)
        bal.plan(pack(samples).seq_lens)  # once per step, on every rank: text + visual tokens per sample
        outs, flat = outputs(model, samples, bal)
        err = loss_sum(outs, samples, flat)
        loss = global_mean_loss(err, sum(o.numel() for o in outs))  # FSDP2 averages: gradients="mean"
        loss.backward()

        # the check (fp64): the sharded, balanced step == every sample alone in one process
        ref.load_state_dict({k: v.full_tensor() for k, v in model.state_dict().items()})
        everyone = [rank_samples(r, step) for r in range(world)]
        total = sum(s.target.numel() for ss in everyone for s in ss)
        ref_outs, ref_grads = per_sample_reference(ref, everyone, total)
        out_err = max((max_rel(o, r) for o, r in zip(outs, ref_outs[rank])), default=0.0)
        grad_err = max(max_rel(p.grad.full_tensor(), ref_grads[n]) for n, p in model.named_parameters())
        errors = torch.tensor([out_err, grad_err], dtype=torch.float64)
        dist.all_reduce(errors, op=dist.ReduceOp.MAX)
        total_loss = loss.detach().clone()
        dist.all_reduce(total_loss)
        if rank == 0:
            sizes = sorted(set(map(len, bal.current_plan.groups)))
            print(
                f"step {step}: global mean loss {total_loss.item() / world:.6f}, group sizes {sizes}; "
                f"max relative error vs per-sample fp64: outputs {errors[0]:.1e}, gradients {errors[1]:.1e}"
            )
        if errors.max() > 1e-10:
            raise AssertionError(f"balanced step differs from per-sample math: {errors.tolist()}")
        opt.step()
        opt.zero_grad(set_to_none=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
