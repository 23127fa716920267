"""Packed, variable-length (and balanced) forward of a stock diffusers ``HunyuanVideo15Transformer3DModel``.

    from knapformer.integrations import hunyuanvideo15 as hv
    bal.plan(hv.hunyuanvideo15_seq_lens(model, samples))         # once per step: video + context tokens
    outs = hv.packed_hunyuanvideo15_forward(model, samples, bal)  # list of (C_out, F, H, W) tensors

Each sample brings its own frame count (an image is one frame), resolution, timestep and the
model's three kinds of conditioning, each of its own length: MLLM text (Qwen2.5-VL states,
refined by the model's token refiner), byT5 glyph text, and for I2V SigLIP image tokens.
Through the family seam (:mod:`knapformer.integrations.seam`; the processor and the refiner
are in :mod:`knapformer.integrations.hunyuanvideo15_attention`), what is its own:

- **Conditioning at home**, as the stock forward builds it per sample: the refiner over the
  sample's kept MLLM rows (their mean, its time embedding, self-attention within the sample),
  the byT5 and image projections, each kind's ``cond_type_embed`` row. Masked-out rows are
  dropped (the stock model masks them: they never reach a kept token). Absent or all-zero
  ``image_embeds`` make a sample text-to-video (the stock model masks its image tokens out).
- **One packed stream per sample**: its video tokens (the stock patch embedding), then its
  context, routed right after embedding with integer (frame, row, column) positions; each
  routed video token's RoPE is the stock ``get_1d_rotary_pos_embed`` at its position.
- **Modulation**: every AdaLN ``linear(silu(temb))`` runs once per sample this rank holds
  tokens of (``PerSample``).

Where it differs from a stock *batch*: the stock forward decides text-to-video for the whole
batch (``torch.all(image_embeds == 0)``), so a batch mixing I2V and T2V samples attends to the
T2V samples' zero image tokens; per sample (here, and in a stock batch of one) it does not.
Where it differs from the stock per-sample forward: a sample with no MLLM text makes the stock
refiner average over no token (0/0), so its gradients are NaN; here the refiner runs on none
of that sample's tokens. Otherwise fp64 outputs and gradients agree to ~1e-14 (under ring
plans the fp32 RoPE may round an attention's last-bit difference, as for Qwen-Image).

Legend: T tokens (this rank's routed ones after routing), S samples, D hidden size.
Importing knapformer never imports diffusers; this module does (diffusers >= 0.36, < 0.43).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from knapformer.executor import TokenExecutor
from knapformer.integrations import seam
from knapformer.integrations.configs_dit import HUNYUANVIDEO15_PRESETS, DiffusersHunyuanVideo15Config, hunyuan_workload
from knapformer.integrations.hunyuanvideo15_attention import (
    HunyuanPacked,
    prepare_hunyuanvideo15,
    refine_text,
    rope_rows,
)
from knapformer.workload import WorkloadModel

__all__ = [
    "DiffusersHunyuanVideo15Config",
    "HunyuanVideo15Family",
    "HunyuanVideo15Sample",
    "PackedHunyuanVideo15Output",
    "build_hunyuanvideo15",
    "hunyuanvideo15_seq_lens",
    "hunyuanvideo15_workload",
    "packed_hunyuanvideo15_forward",
    "prepare_hunyuanvideo15",
    "samples_from_batch",
]


@dataclass
class HunyuanVideo15Sample:
    """One training sample for a HunyuanVideo 1.5 model (no batch dimension anywhere)."""

    latents: torch.Tensor  # (C_in, F, H, W): noisy + condition latents + mask, as the pipeline joins them
    text: torch.Tensor  # (L, text_embed_dim) MLLM states
    timestep: torch.Tensor  # () in stock units (0..1000)
    text_mask: torch.Tensor | None = None
    """(L,) the MLLM mask (stock ``encoder_attention_mask``): False rows are dropped."""
    text_2: torch.Tensor | None = None
    """(L2, text_embed_2_dim) byT5 glyph states, or None (no glyph text)."""
    text_2_mask: torch.Tensor | None = None
    image_embeds: torch.Tensor | None = None
    """(L_img, image_embed_dim) SigLIP states (I2V); None or all zeros: text-to-video."""
    timestep_r: torch.Tensor | None = None
    """() the MeanFlow reference timestep (``use_meanflow`` models), or None."""


class PackedHunyuanVideo15Output(seam.PackedOutput):
    """Per-sample outputs (C_out, F, H, W) in order, plus ``flat``: this rank's outputs as
    (T, C_out·p_t·p·p) token rows (sample order; see ``PackedOutput``)."""


def hunyuanvideo15_workload(model, *, gamma: float = 1.0) -> WorkloadModel:
    """The planner's cost model of a ``HunyuanVideo15Transformer3DModel`` (its width, MLP
    ratio, dual-stream layers and heads; the 2-layer text refiner runs where the text was
    loaded and is left out)."""
    c = model.config
    d = c.num_attention_heads * c.attention_head_dim
    return hunyuan_workload(d, c.mlp_ratio, c.num_layers, c.num_attention_heads, gamma)


def build_hunyuanvideo15(cfg: DiffusersHunyuanVideo15Config):
    """Random-init ``HunyuanVideo15Transformer3DModel`` for a :class:`DiffusersHunyuanVideo15Config`."""
    same = ("in_channels", "out_channels", "num_layers", "num_refiner_layers", "mlp_ratio", "patch_size")
    same += ("patch_size_t", "rope_axes_dim", "use_meanflow")
    widths = {"text_embed_dim": cfg.text_dim, "text_embed_2_dim": cfg.text_2_dim, "image_embed_dim": cfg.image_dim}
    return seam.build_diffusers("HunyuanVideo15Transformer3DModel", cfg, *same, **widths)


# -- per-sample pieces ---------------------------------------------------------------------------------
def _kept(rows: torch.Tensor | None, mask) -> torch.Tensor:
    """Indices of the kept rows of an optional (L, *) tensor under an optional (L,) mask."""
    if rows is None or mask is None:
        return torch.arange(0 if rows is None else int(rows.shape[0]))
    return torch.nonzero(torch.as_tensor(mask).reshape(-1).to(torch.bool).cpu()).flatten()


def _image_rows(s: HunyuanVideo15Sample) -> int:
    """Image tokens the sample attends to: 0 for text-to-video (none, or all zeros)."""
    img = s.image_embeds
    return 0 if img is None or not bool(torch.as_tensor(img).ne(0).any()) else int(img.shape[0])


def _grid(model, latents: torch.Tensor) -> tuple[int, int, int]:
    c, (_, f, h, w) = model.config, latents.shape
    return f // c.patch_size_t, h // c.patch_size, w // c.patch_size


def _parts(model, s: HunyuanVideo15Sample) -> tuple[int, int, int, int]:
    """(video, image, byT5, MLLM) tokens of a sample as the packed forward lays them out."""
    glyph, mllm = _kept(s.text_2, s.text_2_mask).numel(), _kept(s.text, s.text_mask).numel()
    return math.prod(_grid(model, s.latents)), _image_rows(s), int(glyph), int(mllm)


def hunyuanvideo15_seq_lens(model, samples: Sequence[HunyuanVideo15Sample]) -> list[int]:
    """Tokens of each sample (video + image + byT5 + MLLM kept rows): the lengths to plan with.
    Never raises for a malformed sample: the forward reports it on every rank of the group."""
    return seam.safe_lens(lambda s: sum(_parts(model, s)), samples)


def _problem(model, samples: Sequence[HunyuanVideo15Sample]) -> str:
    """Why these samples cannot run on this model ("" if they can)."""
    c = model.config
    p = (c.patch_size_t, c.patch_size, c.patch_size)

    def of(i: int, s: HunyuanVideo15Sample):
        shape = tuple(s.latents.shape)
        if len(shape) != 4 or shape[0] != c.in_channels:
            yield f"sample {i}: latents must be ({c.in_channels}, F, H, W), got {shape}"
        if any(n % k or n == 0 for n, k in zip(shape[1:], p)):
            yield f"sample {i}: latents (F, H, W) = {shape[1:]} must be positive multiples of the patch size {p}"
        for name, t, m, width, optional in (
            ("text", s.text, s.text_mask, c.text_embed_dim, False),
            ("text_2", s.text_2, s.text_2_mask, c.text_embed_2_dim, True),
            ("image_embeds", s.image_embeds, None, c.image_embed_dim, True),
        ):
            yield seam.rows_problem(i, name, t, width, optional=optional)
            if t is not None:
                yield seam.mask_problem(i, f"the mask of {name}", m, t.shape[0])
        yield seam.scalar_problem(i, "timestep", s.timestep)
        if s.timestep_r is not None and not c.use_meanflow:
            yield f"sample {i}: timestep_r is given but this model has no MeanFlow embedder (use_meanflow=False)"

    return seam.first(p for i, s in enumerate(samples) for p in of(i, s))


# -- forward -------------------------------------------------------------------------------------------
def _time(model, samples, ts, dtype, device) -> torch.Tensor:
    """(S, D) time embeddings (plus the MeanFlow reference embedding of samples that have one)."""
    te = model.time_embed
    temb = te.timestep_embedder(te.time_proj(ts).to(dtype))  # fp32 timesteps, as stock (its module would
    # cast the projection to the timesteps' dtype, which a bf16 model without autocast cannot take)
    if te.use_meanflow:  # (runs on no rows too: every rank's parameters get a gradient)
        has = torch.tensor([s.timestep_r is not None for s in samples], dtype=torch.bool)
        idx = torch.nonzero(has).flatten().to(device)
        r = seam.stack_scalars([s.timestep_r for s in samples if s.timestep_r is not None], device)
        temb = temb.index_add(0, idx, te.timestep_embedder_r(te.time_proj_r(r).to(dtype)))
    return temb


def packed_hunyuanvideo15_forward(
    model, samples: Sequence[HunyuanVideo15Sample], executor: TokenExecutor | None = None
) -> PackedHunyuanVideo15Output:
    """Outputs (C_out, F, H, W) for each sample, in order; differentiable.

    ``executor`` is a ``SequenceBalancer`` already planned for this step with
    ``hunyuanvideo15_seq_lens(model, samples)`` (every rank of the group calls this function),
    a ``LocalExecutor``, or None (everything on this process)."""
    return seam.through_root(model, lambda: _packed_hunyuanvideo15(model, samples, executor))


def _packed_hunyuanvideo15(
    model, samples: Sequence[HunyuanVideo15Sample], executor: TokenExecutor | None = None
) -> PackedHunyuanVideo15Output:
    """:func:`packed_hunyuanvideo15_forward`'s work, run as the model's own call (``seam.through_root``)."""
    proj = model.x_embedder.proj
    c, device, dtype = seam.begin(model, samples, executor, prepare_hunyuanvideo15, _problem, proj.weight)
    grids = [_grid(model, s.latents) for s in samples]
    pk = seam.Packing([_parts(model, s) for s in samples], _STREAMS, device)
    ts = seam.stack_scalars([s.timestep for s in samples], device)  # not rounded to the model's dtype
    # 1. embed at home: every module runs (on empty inputs too), so every parameter gets a gradient
    vid = seam.embed_latents(model.x_embedder, proj, [s.latents for s in samples], device, dtype)
    imgs = [s.image_embeds for s in samples if _image_rows(s)]
    img = model.image_embedder(seam.cat_or_empty(imgs, (0, c.image_embed_dim), device, dtype))
    b5 = [s.text_2.index_select(0, _kept(s.text_2, s.text_2_mask)) for s in samples if s.text_2 is not None]
    b5 = model.context_embedder_2(seam.cat_or_empty(b5, (0, c.text_embed_2_dim), device, dtype))
    mllm = [s.text.index_select(0, _kept(s.text, s.text_mask)) for s in samples]
    txt = refine_text(model, mllm, ts, device, dtype)
    kinds = torch.cat([torch.full((n.shape[0],), k, device=device) for k, n in ((2, img), (1, b5), (0, txt))])
    ctx = torch.cat([img, b5, txt]) + model.cond_type_embed(kinds.long())
    h_local = pk.merge(vid, *torch.split(ctx, [img.shape[0], b5.shape[0], txt.shape[0]]))
    pos = [
        torch.cat([_positions(*g, device), torch.zeros(n - math.prod(g), 3, dtype=torch.int64, device=device)])
        for g, n in zip(grids, pk.seq_lens)
    ]  # context rows have no position
    # 2. route with the grid positions; the time embedding to the group
    temb = _time(model, samples, ts, dtype, device)
    r = pk.route(
        executor, h_local, seam.cat_or_empty(pos, (0, 3), device, torch.int64), per_sample=(temb,), names=("temb",)
    )
    temb_p = r.present_rows(r.per_sample[0])
    per = seam.PerSample(temb_p, {"vid": r.slot_of("vid"), "ctx": r.slot_of("ctx")})
    packed = HunyuanPacked(routed=r)
    rope = rope_rows(model, r.take(r.side[0], "vid"))
    vid_s, ctx_s = r.take(r.h, "vid").unsqueeze(1), r.take(r.h, "ctx").unsqueeze(1)  # (T, 1, D)
    # 3. stock dual-stream blocks
    for block in model.transformer_blocks:
        vid_s, ctx_s = seam.call_block(model, block, vid_s, ctx_s, per, packed, rope)
    # 4. the stock output norm with each video token's own row, the projection, back home
    mod = model.norm_out.linear(model.norm_out.silu(temb_p).to(dtype)).index_select(0, per.rows["vid"])
    scale, shift = torch.chunk(mod, 2, dim=1)
    out_vid = model.proj_out(model.norm_out.norm(vid_s) * (1 + scale)[:, None, :] + shift[:, None, :])[:, 0]
    rows = r.home(r.merge(out_vid, out_vid.new_zeros(r.count("ctx"), out_vid.shape[1])), 0)
    return PackedHunyuanVideo15Output.of(
        seam.unpatchify(rows, grids, (c.patch_size_t, c.patch_size, c.patch_size), channels_first=True), rows
    )


_STREAMS = {"vid": (0,), "ctx": (1, 2, 3)}
"""A sample's segments: its video, then its image, byT5 and MLLM context (the stock order)."""


def _positions(f: int, h: int, w: int, device) -> torch.Tensor:
    """(f·h·w, 3) int64 (frame, row, column) of each video token in stock flatten order."""
    grid = torch.meshgrid(*(torch.arange(n, device=device) for n in (f, h, w)), indexing="ij")
    return torch.stack(grid, dim=-1).reshape(-1, 3)


def samples_from_batch(batch, cfg: DiffusersHunyuanVideo15Config, *, seed: int) -> list[HunyuanVideo15Sample]:
    """HunyuanVideo 1.5 samples from a synthetic :class:`~knapformer.data.batches.Batch`: each
    sequence's visual rows become one frame on the most square exact grid (a text-only
    sequence gets a 1-token stand-in), its text rows random MLLM states (T2V, no glyph text)."""
    g = torch.Generator().manual_seed(seed)
    pt, p = cfg.patch_size_t, cfg.patch_size
    out = []
    for s in seam.batch_samples(batch):
        rows, h, w = seam.square_image(s, cfg.in_dim)
        lat = seam.unpatchify(rows, [(1, h, w)], (pt, p, p), channels_first=True)[0]
        text = torch.randn(s.text.shape[0], cfg.text_dim, generator=g).to(batch.x.dtype)
        out.append(HunyuanVideo15Sample(latents=lat, text=text, timestep=s.timestep * 1000))
    return out


class HunyuanVideo15Family(seam.PackedFamily):
    """Stock diffusers ``HunyuanVideo15Transformer3DModel`` for the tools (presets
    ``diffusers-hunyuanvideo15-tiny`` and ``diffusers-hunyuanvideo15-8.3b``, the released size)."""

    name = "diffusers-hunyuanvideo15"
    presets = HUNYUANVIDEO15_PRESETS
    build_model, packed_forward = staticmethod(build_hunyuanvideo15), staticmethod(packed_hunyuanvideo15_forward)
    synthetic = staticmethod(samples_from_batch)

    def seq_lens(self, samples):
        return [v + int(s.text.shape[0]) for v, s in zip(self.target_rows(samples), samples)]

    def target_rows(self, samples):
        cfg = self.config
        return [math.prod(s.latents.shape[1:]) // (cfg.patch_size_t * cfg.patch_size**2) for s in samples]

    def blocks(self, device, dtype, causal):
        """One stock dual-stream block on packed tokens of the given lengths (an eighth of each
        sequence context, the rest video), through a ``LocalExecutor``."""
        cfg = self.config
        model = self.block_model(device, dtype, causal, num_layers=1, num_refiner_layers=1)
        prepare_hunyuanvideo15(model)
        block = model.transformer_blocks[0]

        def make(seq_lens, backward):
            r = seam.timing_tokens(seq_lens, {"vid": (1,), "ctx": (0,)}, device)
            temb = torch.randn(len(seq_lens), cfg.dim, device=device, dtype=dtype)
            per = seam.PerSample(temb, {"vid": r.sample_of("vid"), "ctx": r.sample_of("ctx")})
            rope = rope_rows(model, r.take(r.side[0], "vid"))
            x = lambda n: torch.randn(n, 1, cfg.dim, device=device, dtype=dtype, requires_grad=backward)  # noqa: E731
            vid, ctx = x(r.count("vid")), x(r.count("ctx"))
            return seam.block_runner(lambda: torch.cat(block(vid, ctx, per, HunyuanPacked(routed=r), rope)), backward)

        return [("hunyuanvideo15", cfg.num_layers, make)]
