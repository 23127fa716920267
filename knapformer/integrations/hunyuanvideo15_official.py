"""Packed (and balanced) forward of the *official* HunyuanVideo 1.5 transformer.

    from knapformer.integrations import hunyuanvideo15_official as hv
    bal.plan(hv.official_seq_lens(model, samples))     # once per step: video + context tokens
    outs = hv.packed_official_forward(model, samples, bal)  # list of (C_out, F, H, W) tensors

``model`` is the authors' ``HunyuanVideo_1_5_DiffusionTransformer`` (github.com/Tencent-Hunyuan/
HunyuanVideo-1.5, what their ``train.py`` builds), used through its own modules and found by
their names only: nothing here imports their package. Each sample brings its own frames,
resolution, timestep, MLLM text (with its mask), byT5 glyph text and, for I2V, vision states.
Through the family seam (:mod:`knapformer.integrations.seam`), what is this class's own:

- **Conditioning at home, per sample**: the token refiner ``txt_in`` on the sample's text and
  mask (the stock call, a batch of one), ``byt5_in`` and ``vision_in`` on the kept rows, each
  kind's ``cond_type_embedding`` row; padded rows are dropped (the official attention drops
  them as queries and keys); absent or all-zero vision states make the sample text-to-video.
- **Blocks**: each double-stream block's ``forward`` is replaced on the instance (FSDP2 per
  block and ``checkpoint_wrapper`` keep working) by the same sequence of its own modules and
  module-level ``modulate``/``apply_gate``/``apply_rotary_emb`` on ``[T, 1, D]`` tokens, each
  token modulated by its sample's rows, attention within each sample through the executor.
  Other calls run the stock forward. The model's ``forward`` is replaced the same way, so the
  packed forward runs inside an FSDP2 root's hooks.
- **RoPE** of each routed video token from the model's own axis tables at its position.

Not supported: single-stream blocks (the released 8.3B has none; a model with some is
refused), sequence parallelism of their own (knapformer's plan replaces it).
"""

from __future__ import annotations

import math
import types
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from knapformer.executor import TokenExecutor
from knapformer.integrations import seam
from knapformer.integrations.configs_dit import hunyuan_workload

__all__ = ["OfficialSample", "official_seq_lens", "official_workload", "packed_official_forward", "prepare_official"]


@dataclass
class OfficialSample:
    """One training sample for the official class (no batch dimension anywhere)."""

    latents: torch.Tensor  # (2C + 1, F, H, W): noised latents, condition latents, mask, as train.py joins them
    timestep: torch.Tensor  # () in stock units (0..1000)
    text: torch.Tensor  # (L, text_states_dim) MLLM states
    text_mask: torch.Tensor | None = None  # (L,) False rows are padding
    byt5: torch.Tensor | None = None  # (L2, byT5 width) glyph states (glyph_byT5_v2 models)
    byt5_mask: torch.Tensor | None = None
    vision: torch.Tensor | None = None  # (L3, vision_states_dim) SigLIP states; None or zeros: T2V
    timestep_r: torch.Tensor | None = None  # () MeanFlow reference timestep (use_meanflow models)


def _byt5_in(model):
    """The glyph (byT5) mapper, or None: the official class creates ``byt5_in`` only when
    ``glyph_byT5_v2`` is set (its default is off), so the attribute may not exist at all."""
    return getattr(model, "byt5_in", None) if getattr(model, "glyph_byT5_v2", True) else None


def _kept(rows, mask) -> torch.Tensor:
    n = 0 if rows is None else int(rows.shape[0])
    return torch.arange(n) if mask is None else torch.nonzero(torch.as_tensor(mask).reshape(-1).bool().cpu()).flatten()


def _parts(model, s: OfficialSample) -> tuple[int, int, int, int]:
    """(video, vision, byT5, text) tokens of a sample as the packed forward lays them out."""
    grid = math.prod(n // p for n, p in zip(s.latents.shape[1:], model.patch_size))
    i2v = s.vision is not None and bool(torch.as_tensor(s.vision).ne(0).any())
    return grid, int(s.vision.shape[0]) if i2v else 0, len(_kept(s.byt5, s.byt5_mask)), len(_kept(s.text, s.text_mask))


def official_seq_lens(model, samples: Sequence[OfficialSample]) -> list[int]:
    """Tokens of each sample (a placeholder for a malformed one: the forward names it): the lengths to plan with."""
    return seam.safe_lens(lambda s: sum(_parts(model, s)), samples)


def official_workload(model, *, gamma: float = 1.0):
    """The planner's cost model: width, MLP ratio (4 in the released class), double blocks, heads."""
    return hunyuan_workload(model.hidden_size, 4.0, len(model.double_blocks), model.heads_num, gamma)


def _problem(model, samples: Sequence[OfficialSample]) -> str:
    widths = {"text": model.txt_in.input_embedder.in_features}
    byt5_in = _byt5_in(model)
    widths["byt5"] = byt5_in.fc1.in_features if byt5_in is not None else None
    widths["vision"] = model.vision_in.proj[0].normalized_shape[0] if model.vision_in is not None else None
    c_in, patch = model.img_in.proj.in_channels, tuple(model.patch_size)

    def of(i, s):
        yield seam.grid_problem(i, "latents", s.latents, c_in, patch, "F, H, W")
        for name, mask in (("text", s.text_mask), ("byt5", s.byt5_mask), ("vision", None)):
            t = getattr(s, name)
            if t is not None and widths[name] is None:
                yield f"sample {i}: {name} was given but this model has no {name} input"
            yield seam.rows_problem(i, name, t, widths[name] or 0, optional=name != "text")
            yield seam.mask_problem(i, f"{name}_mask", mask, 0 if t is None else t.shape[0])
        if s.text_mask is not None and not bool(torch.as_tensor(s.text_mask).bool().any()):
            yield f"sample {i}: text_mask keeps no text row (the refiner would average over none)"
        yield seam.scalar_problem(i, "timestep", s.timestep)
        if s.timestep_r is not None and model.time_r_in is None:
            yield f"sample {i}: timestep_r is given but this model has no MeanFlow embedder"

    if len(model.single_blocks):
        return "the packed forward runs double-stream blocks only; this model has single-stream blocks"
    return seam.first(p for i, s in enumerate(samples) for p in of(i, s))


def _block_forward(self, img, txt, vec, freqs_cis=None, text_mask=None, attn_param=None, *args, **kwargs):
    """A double block's instance ``forward``: packed when ``vec`` is a :class:`seam.PerSample`."""
    if not isinstance(vec, seam.PerSample):
        return type(self).forward(self, img, txt, vec, freqs_cis, text_mask, attn_param, *args, **kwargs)
    g = type(self).forward.__globals__  # the official module-level helpers
    mods = {
        s: getattr(self, f"{s}_mod")(vec.per_sample).index_select(0, vec.rows[s]).chunk(6, dim=-1)
        for s in ("img", "txt")
    }
    qkv, x = {}, {"img": img, "txt": txt}
    for s in ("img", "txt"):
        h = g["modulate"](getattr(self, f"{s}_norm1")(x[s]), shift=mods[s][0], scale=mods[s][1])
        q, k, v = (seam.heads(getattr(self, f"{s}_attn_{n}")(h), self.heads_num) for n in "qkv")
        q, k = getattr(self, f"{s}_attn_q_norm")(q).to(v), getattr(self, f"{s}_attn_k_norm")(k).to(v)
        if s == "img" and freqs_cis is not None and q.shape[0]:
            q, k = (t[0] for t in g["apply_rotary_emb"](q[None], k[None], freqs_cis, head_first=False))
        qkv[s] = (q, k, v)
    o = attn_param.attention(*(torch.cat([a, b]) for a, b in zip(qkv["img"], qkv["txt"])))
    attn = {"img": o[: img.shape[0]], "txt": o[img.shape[0] :]}
    for s, (_, _, gate1, shift2, scale2, gate2) in mods.items():
        y = x[s] + g["apply_gate"](getattr(self, f"{s}_attn_proj")(attn[s]), gate=gate1)
        mlp = getattr(self, f"{s}_mlp")(g["modulate"](getattr(self, f"{s}_norm2")(y), shift=shift2, scale=scale2))
        x[s] = y + g["apply_gate"](mlp, gate=gate2)
    return x["img"], x["txt"]


def prepare_official(model) -> None:
    """Replace each double block's ``forward`` on these instances only (the inner module under a
    ``checkpoint_wrapper``); stock calls keep their behaviour. Idempotent. (The root's call is
    ``seam.through_root``'s, for the packed call only.)"""
    for block in model.double_blocks:
        inner = getattr(block, "_checkpoint_wrapped_module", block)
        inner.forward = types.MethodType(_block_forward, inner)


def packed_official_forward(model, samples: Sequence[OfficialSample], executor: TokenExecutor | None = None):
    """Outputs (C_out, F, H, W) per sample, in order; differentiable. ``executor``: a balancer
    planned with ``official_seq_lens(model, samples)`` on every rank, a ``LocalExecutor``, or None."""
    prepare_official(model)
    return seam.through_root(model, lambda: _packed(model, samples, executor))


def _context(model, samples, ts, device, dtype, like) -> tuple[torch.Tensor, ...]:
    """(video, vision, byT5, text) rows of all samples for :meth:`Packing.merge`: ``like`` (the
    video rows), then each context kind's kept rows with its condition-type row; the refiner runs
    per sample, as the stock batch of one does."""
    e = model.cond_type_embedding

    def cond(x, kind):
        return x if e is None else x + e(torch.full((x.shape[0],), kind, dtype=torch.long, device=device))

    def embed(module, name, keep):
        if module is None:
            return like[:0]
        parts = [getattr(s, name).index_select(0, keep(s)) for s in samples if getattr(s, name) is not None]
        width = module.fc1.in_features if name == "byt5" else module.proj[0].normalized_shape[0]
        return module(seam.cat_or_empty(parts, (0, width), device, dtype))

    txt = []
    for s, t in zip(samples, ts):
        mask = torch.ones(s.text.shape[0]) if s.text_mask is None else torch.as_tensor(s.text_mask).reshape(-1)
        mask = mask[None].to(device) if model.use_attention_mask else None
        out = model.txt_in(s.text[None].to(device, dtype), t[None], mask)[0]
        txt.append(out.index_select(0, _kept(s.text, s.text_mask).to(device)))
    if not samples:  # a rank with no sample: a stand-in, so the refiner's parameters join the backward
        stand_in = like.new_zeros(1, 1, model.txt_in.input_embedder.in_features)
        like = like + 0 * model.txt_in(stand_in, ts.new_zeros(1), like.new_ones(1, 1)).sum()
    vis = embed(model.vision_in, "vision", lambda s: torch.arange(_parts(model, s)[1]))
    b5 = embed(_byt5_in(model), "byt5", lambda s: _kept(s.byt5, s.byt5_mask))
    txt = seam.cat_or_empty(txt, (0, model.hidden_size), device, dtype)
    return like, cond(vis, 2), cond(b5, 1), cond(txt, 0)


def _packed(model, samples, executor):
    _, device, dtype = seam.begin(model, samples, executor, lambda m: None, _problem, model.img_in.proj.weight)
    pk = seam.Packing([_parts(model, s) for s in samples], {"img": (0,), "txt": (1, 2, 3)}, device)
    grids = [tuple(n // p for n, p in zip(s.latents.shape[1:], model.patch_size)) for s in samples]
    ts = seam.stack_scalars([s.timestep for s in samples], device)  # fp32, as train.py passes them
    vid = seam.embed_latents(model.img_in, model.img_in.proj, [s.latents for s in samples], device, dtype)
    vec = model.time_in(ts)
    if model.guidance_embed:  # the stock default strength (train.py passes none)
        vec = vec + model.guidance_in(torch.full_like(ts, 6016.0))
    if model.time_r_in is not None:
        has = [i for i, s in enumerate(samples) if s.timestep_r is not None]
        r_ts = seam.stack_scalars([samples[i].timestep_r for i in has], device)
        vec = vec.index_add(0, torch.tensor(has, dtype=torch.long, device=device), model.time_r_in(r_ts))
    pos = seam.cat_or_empty([_grid(g, n, device) for g, n in zip(grids, pk.seq_lens)], (0, 3), device, torch.int64)
    h = pk.merge(*_context(model, samples, ts, device, dtype, vid))
    r = pk.route(executor, h, pos, per_sample=(vec,), names=("vec",))
    vec_p = r.present_rows(r.per_sample[0])
    per = seam.PerSample(vec_p, {"img": r.slot_of("img"), "txt": r.slot_of("txt")})
    rope = _rope(model, r.take(r.side[0], "img"))
    img_s, txt_s = r.take(r.h, "img").unsqueeze(1), r.take(r.h, "txt").unsqueeze(1)  # (T, 1, D)
    for block in model.double_blocks:
        img_s, txt_s = block(img_s, txt_s, per, rope, None, r)
    img_s = _ZeroGradTo.apply(img_s, txt_s)  # the official forward joins and slices: zeros, not None
    fl = model.final_layer
    shift, scale = fl.adaLN_modulation(vec_p).index_select(0, per.rows["img"]).chunk(2, dim=1)
    out = fl.linear(type(fl).forward.__globals__["modulate"](fl.norm_final(img_s), shift=shift, scale=scale))[:, 0]
    flat = r.home(r.merge(out, out.new_zeros(r.count("txt"), out.shape[1])), 0)
    # (copies, not views of ``flat``: FSDP2 hooks the root's outputs, and warns on views)
    outs = [model.unpatchify(o[None], *g)[0].clone() for o, g in zip(pk.split(flat, 0), grids)]
    return seam.PackedOutput.of(outs, flat)


class _ZeroGradTo(torch.autograd.Function):
    """``x`` unchanged; ``unused`` gets an exact-zero gradient. The official forward joins image
    and text after the last block and slices the image back out, so the last block's text-only
    parameters (``txt_attn_proj``, ``txt_mlp``) get zero gradients, not None: AdamW's weight
    decay then still moves them, as in a stock run. (``x + 0 * unused.sum()`` would turn an inf
    in the unused rows into a NaN output.)"""

    @staticmethod
    def forward(ctx, x, unused):  # type: ignore[override]
        ctx.unused = (unused.shape, unused.dtype, unused.device)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        shape, dtype, device = ctx.unused
        return grad, torch.zeros(shape, dtype=dtype, device=device)


def _grid(g, n: int, device) -> torch.Tensor:
    """(n, 3) positions of a sample's tokens: its video grid (frame, row, column), then zeros."""
    grid = torch.stack(torch.meshgrid(*(torch.arange(k, device=device) for k in g), indexing="ij"), -1).reshape(-1, 3)
    return torch.cat([grid, grid.new_zeros(n - grid.shape[0], 3)])


def _rope(model, pos: torch.Tensor):
    """(cos, sin) (T, head dim) of video tokens at grid positions ``pos`` from the model's axis
    tables (a position's rotation does not depend on the grid it came from)."""
    if not pos.shape[0]:
        return None
    dims, hi = model.rope_dim_list, (pos.max(0).values + 1).tolist()
    parts = ([], [])
    for axis in range(3):
        size = [1, 1, 1]
        size[axis] = hi[axis]
        lo = sum(dims[:axis])
        for out, table in zip(parts, model.get_rotary_pos_embed(tuple(size))):
            out.append(table[:, lo : lo + dims[axis]].to(pos.device).index_select(0, pos[:, axis]))
    return torch.cat(parts[0], dim=1), torch.cat(parts[1], dim=1)
