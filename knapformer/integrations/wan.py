"""Packed, variable-length (and balanced) forward of a stock diffusers ``WanTransformer3DModel``.

    from knapformer.integrations.wan import WanSample, packed_wan_forward, wan_seq_lens
    bal.plan(wan_seq_lens(model, samples))              # once per step: video tokens per sample
    outs = packed_wan_forward(model, samples, bal)       # list of (C_out, F, H, W) tensors

Each sample brings its own frame count, resolution, text (any length, no padding), timestep
(one, or one per video token as Wan 2.2 TI2V uses) and, for I2V models, its image context.
Through the family seam (:mod:`knapformer.integrations.seam`), what is Wan's own:

- **Patch embedding per sample** (the model's ``Conv3d`` on each ``(1, C, F, H, W)``), then the
  video tokens of all samples are one packed stream ``[1, T, D]``; a ``SequenceBalancer``
  routes them (with their integer (frame, row, column) grid positions) right after it.
- **3-D RoPE after routing**: each routed token's cos/sin rows are looked up in the model's
  own ``rope`` buffers at its grid position (what the stock ``WanRotaryPosEmbed`` computes
  for the whole grid), so no per-token float tables travel.
- **Per-token modulation through the stock path**: Wan blocks accept a per-token
  ``temb`` ``[1, T, 6, D]`` (the Wan 2.2 TI2V form). The time embedding runs once per sample
  (or per token for per-token timesteps) and is expanded to the routed tokens by index; the
  adds/multiplies this costs are elementwise (no extra matmul), but the per-token shift/scale
  tensors the blocks keep for backward are (T, D) instead of (1, D) — about 4·T·D fp32 values
  per block (recomputed instead with gradient checkpointing).
- **Self-attention** (``attn1``): a per-instance processor (:class:`PackedWanAttnProcessor`)
  computes q/k/v with the stock projections and norms, applies Wan's RoPE, and attends within
  each sample through ``executor.attention`` (Ulysses inside the sample's group, any degree).
- **Cross-attention** (``attn2``): each sample's text is embedded once on the rank that loaded
  it and sent, once per step, only to the ranks holding that sample's tokens
  (``executor.route_context``); each layer projects the routed text to keys/values and every
  rank attends its own query tokens to its samples' text with all heads
  (``executor.cross_attention``, varlen with q lengths ≠ kv lengths, no exchange). I2V's image
  context takes the same path and its attention is added, as in the stock processor.
- The packed metadata travels in the ``rotary_emb`` and ``encoder_hidden_states`` arguments.

Exactness: the stock model computes its norms and residual adds in fp32 (``FP32LayerNorm``,
``hidden_states.float()``) even in an fp64 model, so packed and stock agree to fp32 rounding
(~1e-6 relative), not fp64's.

Importing knapformer never imports diffusers; this module does (diffusers >= 0.35, < 0.43).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from knapformer.executor import LocalExecutor, TokenExecutor, local_positions
from knapformer.integrations import seam
from knapformer.integrations.configs import WAN_PRESETS, DiffusersWanConfig, wan_cost
from knapformer.integrations.wan_attention import CrossPacked, PackedWanAttnProcessor, SelfPacked, rope_tables
from knapformer.workload import WorkloadModel

__all__ = [
    "DiffusersWanConfig",
    "PackedWanAttnProcessor",
    "PackedWanOutput",
    "WanFamily",
    "WanSample",
    "build_wan",
    "packed_wan_forward",
    "prepare_wan",
    "samples_from_batch",
    "wan_grid",
    "wan_seq_lens",
    "wan_workload",
]


@dataclass
class WanSample:
    """One training sample for a Wan model (no batch dimension anywhere)."""

    latents: torch.Tensor  # (C, F, H, W) video latents (an image: F = 1)
    text: torch.Tensor  # (L_txt, text_dim) text encoder states (unpadded, or padded as you like)
    timestep: torch.Tensor  # () or (F'·H'·W',) one per video token (Wan 2.2 TI2V), stock units
    image: torch.Tensor | None = None
    """(L_img, image_dim) image encoder states, for I2V models (CLIP: 257 tokens); for models with
    a learned image position table (first/last-frame, ``pos_embed_seq_len``) both images' rows,
    (2·L_img, image_dim)."""


class PackedWanOutput(seam.PackedOutput):
    """Per-sample outputs (C_out, F, H, W) in order, plus ``flat``: this rank's outputs as
    (T, C_out·p_t·p_h·p_w) token rows (sample order, stock token order within a sample); see
    :class:`~knapformer.integrations._diffusers.PackedOutput`."""


def wan_workload(model, *, context_len: int = 512, gamma: float = 1.0) -> WorkloadModel:
    """The planner's cost model of a ``WanTransformer3DModel`` (its width, FFN, layers and
    heads from ``model.config``); ``context_len`` = text (+ image) tokens per sample (stock Wan
    pads text to 512; I2V adds 257 image tokens)."""
    c = model.config
    d = c.num_attention_heads * c.attention_head_dim
    return wan_cost(d, c.ffn_dim, c.num_layers, c.num_attention_heads, context_len, gamma)


def build_wan(cfg: DiffusersWanConfig):
    """Random-init ``WanTransformer3DModel`` for a :class:`DiffusersWanConfig`."""
    same = ("patch_size", "in_channels", "out_channels", "text_dim", "freq_dim", "ffn_dim", "num_layers", "image_dim")
    return seam.build_diffusers(
        "WanTransformer3DModel", cfg, *same, added_kv_proj_dim=cfg.dim if cfg.image_dim else None
    )


def prepare_wan(model) -> None:
    """Install the packed processor on this model instance's attention modules (checked every
    call: one replaced since, e.g. by ``set_attn_processor``, gets it again)."""
    seam.require_diffusers()
    seam.install([a for b in model.blocks for a in (b.attn1, b.attn2)], PackedWanAttnProcessor)


# -- shapes ------------------------------------------------------------------------------------------
def _post_patch(model, latents: torch.Tensor) -> tuple[int, int, int]:
    p = model.config.patch_size
    if latents.dim() != 4:
        raise ValueError(f"WanSample.latents must be (C, F, H, W), got shape {tuple(latents.shape)}")
    C, F, H, W = latents.shape
    if C != model.config.in_channels:
        raise ValueError(f"latents have {C} channels, the model takes {model.config.in_channels}")
    if F % p[0] or H % p[1] or W % p[2] or min(F, H, W) == 0:
        raise ValueError(f"latents (F, H, W) = {(F, H, W)} must be positive multiples of the patch size {tuple(p)}")
    return F // p[0], H // p[1], W // p[2]


def wan_seq_lens(model, samples: Sequence[WanSample]) -> list[int]:
    """Video tokens of each sample (F'·H'·W' after patching): the lengths to plan with. Never
    raises for a malformed sample (0 tokens, or its whole patches): ``packed_wan_forward``
    reports it, on every rank of a balancer's group, so no rank is left waiting in ``plan``."""
    p = model.config.patch_size

    def tokens(s: WanSample) -> int:
        shape = tuple(s.latents.shape)
        return math.prod(n // k for n, k in zip(shape[1:], p)) if len(shape) == 4 else 0

    return seam.safe_lens(tokens, samples)


def wan_grid(tokens: int, max_side: int = 1024) -> tuple[int, int, int]:
    """A (frames, height, width) token grid of at most ``tokens`` cells (exactly, when a
    near-square factorisation with every side below ``max_side`` exists; else the largest
    count below that has one), for synthetic samples."""
    for n in range(max(int(tokens), 1), 0, -1):
        for h in range(math.isqrt(n), 0, -1):
            if n % h:
                continue
            rest = n // h
            w = next((w for w in range(min(rest, max_side - 1), 0, -1) if rest % w == 0), 1)
            if rest // w < max_side and w <= 4 * h + 4:
                return rest // w, h, w
    raise ValueError(f"no (F, H, W) token grid for {tokens} tokens")


def samples_from_batch(batch, cfg: DiffusersWanConfig, *, seed: int) -> list[WanSample]:
    """Wan samples from a synthetic :class:`~knapformer.data.batches.Batch`: each sequence's
    first visual rows become a video (``wan_grid``: its F'·H'·W' tokens are the visual rows, or
    the most of them a grid fits), its text rows random text states."""
    out = []
    g = torch.Generator().manual_seed(seed)
    for s in seam.batch_samples(batch):
        v = s.visual.shape[0]
        f, h, w = wan_grid(max(v, 1))
        rows = s.visual[: f * h * w, : cfg.in_dim] if v else batch.x.new_zeros(1, cfg.in_dim)
        lat = seam.unpatchify(rows, [(f, h, w)], cfg.patch_size)[0]
        text = torch.randn(s.text.shape[0], cfg.text_dim, generator=g).to(batch.x.dtype)
        image = torch.randn(257, cfg.image_dim, generator=g).to(batch.x.dtype) if cfg.image_dim else None
        out.append(WanSample(latents=lat, text=text, timestep=s.timestep * 1000, image=image))
    return out


# -- forward -------------------------------------------------------------------------------------------
def _time_embed(model, timesteps: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The condition embedder's time path: (N,) timesteps -> temb (N, D), projection (N, 6, D)."""
    ce = model.condition_embedder
    t = ce.timesteps_proj(timesteps)
    dtype = next(iter(ce.time_embedder.parameters())).dtype
    if t.dtype != dtype and dtype != torch.int8:
        t = t.to(dtype)
    temb = ce.time_embedder(t).type_as(like)
    return temb, ce.time_proj(ce.act_fn(temb)).unflatten(1, (6, -1))


def _embed_image(model, image: torch.Tensor) -> torch.Tensor:
    """One sample's image context (L_img, image_dim) -> (L_img, D) with the stock embedder. With
    a learned position table (first/last-frame models) the stock batch holds each sample's two
    images as two rows that the embedder joins; a sample's (2·L, dim) is split back into them."""
    ie = model.condition_embedder.image_embedder
    if ie.pos_embed is not None:
        return ie(image.unflatten(0, (2, -1)))[0]
    return ie(image[None])[0]


def _grid_positions(f: int, h: int, w: int, device) -> torch.Tensor:
    """(f·h·w, 3) int64 (frame, row, column) of each token in stock flatten order."""
    ff, hh, ww = torch.meshgrid(
        torch.arange(f, device=device), torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij"
    )
    return torch.stack([ff, hh, ww], dim=-1).reshape(-1, 3)


def _problem(model, samples: Sequence[WanSample]) -> str:
    """Why these samples cannot run on this model ("" if they can)."""
    cfg = model.config
    i2v = cfg.added_kv_proj_dim is not None

    def of(i: int, s: WanSample):
        try:
            grid = _post_patch(model, s.latents)
        except ValueError as exc:
            yield f"sample {i}: {exc}"
            return
        if max(grid) >= model.rope.max_seq_len:
            yield f"sample {i}: a video side of {max(grid)} tokens exceeds the RoPE table ({model.rope.max_seq_len})"
        yield seam.rows_problem(i, "text", s.text, cfg.text_dim, rows="L_txt")
        if i2v and s.image is None:
            yield f"sample {i}: this Wan model has image cross-attention (I2V) and needs WanSample.image"
        if not i2v and s.image is not None:
            yield f"sample {i}: an image context was given but this Wan model has no image cross-attention"
        yield seam.rows_problem(i, "image", s.image, cfg.image_dim or 0, optional=True, rows="L_img")
        n = torch.as_tensor(s.timestep).numel()
        if n not in (1, math.prod(grid)):
            yield f"sample {i}: timestep must be a scalar or one per video token ({math.prod(grid)}), got {n}"

    return seam.first(p for i, s in enumerate(samples) for p in of(i, s))


def packed_wan_forward(model, samples: Sequence[WanSample], executor: TokenExecutor | None = None) -> PackedWanOutput:
    """Outputs (C_out, F, H, W) for each sample, in order; differentiable.

    ``executor`` is a ``SequenceBalancer`` already planned for this step with
    ``wan_seq_lens(model, samples)`` (every rank of the group calls this function), a
    ``LocalExecutor``, or None (everything on this process)."""
    return seam.through_root(model, lambda: _packed_wan(model, samples, executor))


def _packed_wan(model, samples: Sequence[WanSample], executor: TokenExecutor | None = None) -> PackedWanOutput:
    """:func:`packed_wan_forward`'s work, run as the model's own call (``seam.through_root``)."""
    cfg, device, dtype = seam.begin(model, samples, executor, prepare_wan, _problem, model.patch_embedding.weight)
    grids = [_post_patch(model, s.latents) for s in samples]
    pk = seam.Packing([(math.prod(g),) for g in grids], {"vid": (0,)}, device)
    # 1. per-sample patch embedding (an empty rank runs it on one empty patch: params get grads)
    if samples:
        x_local = torch.cat(
            [
                model.patch_embedding(s.latents[None].to(device, dtype, non_blocking=True)).flatten(2)[0].T
                for s in samples
            ]
        )
        pos_local = torch.cat([_grid_positions(*g, device) for g in grids])
    else:
        empty = torch.zeros((0, cfg.in_channels, *cfg.patch_size), device=device, dtype=dtype)
        x_local = (
            model.patch_embedding(empty)
            .flatten(2)
            .transpose(1, 2)
            .reshape(0, cfg.num_attention_heads * cfg.attention_head_dim)
        )
        pos_local = torch.zeros(0, 3, dtype=torch.int64, device=device)
    # 2. conditioning at home: the time embedding once per sample (per token for per-token
    # timesteps, after routing, as the stock model does), text and image embedded
    first_t, per_token, ts_local = seam.timestep_table([s.timestep for s in samples], pk.seq_lens, device)
    text_local = torch.cat([s.text for s in samples]) if samples else torch.zeros(0, cfg.text_dim)
    text_local = model.condition_embedder.text_embedder(text_local.to(device, dtype, non_blocking=True)[None])[0]
    temb_s, tproj_s = _time_embed(model, first_t, text_local)
    # 3. route tokens with their grid positions and timesteps; per-sample conditioning to the group
    side = (pos_local, ts_local)
    r = pk.route(executor, x_local, *side, per_sample=(temb_s, tproj_s), names=_GATHERED)
    pos, ts_r = r.side
    temb_all, tproj_all = r.per_sample
    # which samples have per-token timesteps: host flags, exchanged on the host (no device sync)
    (per_token_all,) = r.executor.gather_sequences(per_token, names=("per-token timesteps",))
    embed = lambda t: _time_embed(model, t, text_local)  # noqa: E731
    temb, tproj = seam.per_token_rows(r.seq_id, (temb_all, tproj_all), per_token_all, ts_r, embed)
    ex = r.executor
    text = ex.route_context(text_local, [int(s.text.shape[0]) for s in samples])
    image = None
    if cfg.added_kv_proj_dim is not None:
        imgs = [_embed_image(model, s.image.to(device, dtype)) for s in samples]
        if imgs:
            img_local = torch.cat(imgs)
        else:  # run the embedder on a stand-in so its parameters join the backward
            pairs = model.condition_embedder.image_embedder.pos_embed is not None
            stand_in = torch.zeros(2 if pairs else 1, cfg.image_dim, device=device, dtype=dtype)
            img_local = _embed_image(model, stand_in)[:0]
        image = ex.route_context(img_local, [int(t.shape[0]) for t in imgs])
    cos, sin = rope_tables(model, pos)
    selfp, crossp = SelfPacked(executor=ex, cos=cos, sin=sin), CrossPacked(executor=ex, text=text, image=image)
    # 4. stock blocks over the packed stream [1, R, D] with per-token modulation [1, R, 6, D]
    h = r.h[None]
    for block in model.blocks:
        h = seam.call_block(model, block, h, crossp, tproj[None], selfp)
    # 5. output head per token (the stock per-token form), back to the caller's order
    shift, scale = (model.scale_shift_table.unsqueeze(0) + temb[None].unsqueeze(2)).chunk(2, dim=2)
    h = (model.norm_out(h.float()) * (1 + scale.squeeze(2)) + shift.squeeze(2)).type_as(h)
    out = r.home(model.proj_out(h)[0], 0)
    return PackedWanOutput.of(seam.unpatchify(out, grids, cfg.patch_size), out)


_GATHERED = ("time embedding", "time projection")


class WanFamily(seam.PackedFamily):
    """Stock diffusers ``WanTransformer3DModel`` for the tools (preset ``diffusers-wan-tiny``)."""

    name = "diffusers-wan"
    presets = WAN_PRESETS
    build_model, packed_forward = staticmethod(build_wan), staticmethod(packed_wan_forward)
    synthetic = staticmethod(samples_from_batch)

    def seq_lens(self, samples):
        return self.target_rows(samples)

    def target_rows(self, samples):
        return [math.prod(s.latents.shape[1:]) // math.prod(self.config.patch_size) for s in samples]

    def blocks(self, device, dtype, causal):
        """One stock ``WanTransformerBlock`` on packed tokens of the given lengths, each sequence
        cross-attending to ``context_len`` text tokens (what the planner's term assumes)."""
        cfg = self.config
        model = self.block_model(device, dtype, causal, num_layers=1)
        prepare_wan(model)
        block = model.blocks[0]

        def make(seq_lens, backward):
            ex = LocalExecutor(seq_lens)
            T, D = sum(seq_lens), cfg.dim
            x = torch.randn(1, T, D, device=device, dtype=dtype, requires_grad=backward)
            temb = torch.randn(1, T, 6, D, device=device, dtype=dtype)
            ctx = torch.randn(cfg.context_len * len(seq_lens), D, device=device, dtype=dtype)
            text = ex.route_context(ctx, [cfg.context_len] * len(seq_lens))
            _, pos = local_positions(seq_lens, device)
            grid = torch.stack([pos // 4096, (pos // 64) % 64, pos % 64], dim=1)
            cos, sin = rope_tables(model, grid)
            cross = CrossPacked(executor=ex, text=text, image=None)
            selfp = SelfPacked(executor=ex, cos=cos, sin=sin)
            return seam.block_runner(lambda: block(x, cross, temb, selfp), backward)

        return [("wan", cfg.num_layers, make)]
