"""Packed, variable-length (and balanced) forward of a stock diffusers ``Flux2Transformer2DModel``.

    from knapformer.integrations.flux2 import Flux2Sample, flux2_seq_lens, packed_flux2_forward
    bal.plan(flux2_seq_lens(model, samples))                 # once per step, like any model
    outs = packed_flux2_forward(model, samples, bal)          # list of (T_img_i, C) tensors

Each sample brings its own resolution, text length, timestep, guidance, RoPE ids and optional
reference-image tokens (Flux.2's multi-reference editing: they join the image stream with
their own ids, and their outputs are dropped, as the stock pipeline slices them off). Through
the family seam (:mod:`knapformer.integrations.seam`), what is Flux.2's own:

- **Modulation**: computed once per step from the time embedding and handed to every block
  (``temb_mod_img``, ``temb_mod_txt``, ``temb_mod``); here once per sample by the stock
  modules, gathered to the group and expanded to the routed tokens by index (the stock FLOPs;
  the per-token shift/scale tensors cost 15·D values per token once per forward).
- :class:`PackedFlux2AttnProcessor` (Flux's joint processor over Flux.2's projections) for the
  double-stream blocks, :class:`PackedFlux2ParallelProcessor` for the single-stream
  ("parallel") blocks; the metadata travels in ``joint_attention_kwargs``.

Importing knapformer never imports diffusers; this module does (diffusers >= 0.35, < 0.43,
with ``Flux2Transformer2DModel``: diffusers 0.42).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from knapformer.executor import TokenExecutor
from knapformer.integrations import seam
from knapformer.integrations._diffusers import flux_sizes
from knapformer.integrations.configs import FLUX2_PRESETS, DiffusersFlux2Config
from knapformer.integrations.flux import PackedFluxAttnProcessor

__all__ = [
    "DiffusersFlux2Config",
    "Flux2Family",
    "Flux2Sample",
    "PackedFlux2AttnProcessor",
    "PackedFlux2Output",
    "PackedFlux2ParallelProcessor",
    "build_flux2",
    "flux2_seq_lens",
    "packed_flux2_forward",
    "prepare_flux2",
    "samples_from_batch",
]


@dataclass
class Flux2Sample:
    """One training sample for a Flux.2 model (no batch dimension anywhere)."""

    latents: torch.Tensor  # (T_img, in_channels) packed latent patches
    text: torch.Tensor  # (T_txt, joint_attention_dim) text encoder states
    timestep: torch.Tensor  # () in [0, 1] (the model multiplies by 1000)
    img_ids: torch.Tensor  # (T_img, len(axes_dims_rope))
    txt_ids: torch.Tensor  # (T_txt, len(axes_dims_rope))
    guidance: torch.Tensor | None = None  # () for guidance-distilled models
    ref_latents: torch.Tensor | None = None
    """(T_ref, in_channels) reference-image tokens (multi-reference editing), or None."""
    ref_ids: torch.Tensor | None = None
    """(T_ref, len(axes_dims_rope)) their ids (Flux.2 offsets the first axis per reference)."""

    @property
    def num_ref(self) -> int:
        return 0 if self.ref_latents is None else int(self.ref_latents.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.text.shape[0] + self.latents.shape[0]) + self.num_ref


class PackedFlux2Output(seam.PackedOutput):
    """Per-sample image outputs (T_img_i, C) in order (reference tokens' outputs dropped), plus
    ``flat``: this rank's image outputs as one tensor (see ``PackedOutput``)."""


class PackedFlux2AttnProcessor(PackedFluxAttnProcessor):
    """Flux.2 double-stream attention over packed ``[T, 1, D]`` tokens (Flux's, with Flux.2's
    projections); stock when not packed."""

    stock = "diffusers.models.transformers.transformer_flux2:Flux2AttnProcessor"


class PackedFlux2ParallelProcessor(seam.PackedProcessor):
    """Flux.2 single-stream ("parallel") attention + MLP over packed tokens; stock when not packed."""

    stock = "diffusers.models.transformers.transformer_flux2:Flux2ParallelSelfAttnProcessor"

    def __call__(self, attn, hidden_states, attention_mask=None, rope=None, packed: seam.Routed | None = None):
        if packed is None:
            return self._stock(attn, hidden_states, attention_mask, rope)
        h = attn.to_qkv_mlp_proj(hidden_states)
        qkv_dim = 3 * attn.inner_dim
        mlp_dim = attn.mlp_hidden_dim * attn.mlp_mult_factor
        local_qkv = h.shape[-1] * qkv_dim // (qkv_dim + mlp_dim)  # the stock split (TP-agnostic)
        qkv, mlp = torch.split(h, [local_qkv, h.shape[-1] - local_qkv], dim=-1)
        q, k, v = (seam.heads(t, attn.heads) for t in qkv.chunk(3, dim=-1))
        q, k = attn.norm_q(q), attn.norm_k(k)
        o = packed.attention(seam.rotate(q, rope), seam.rotate(k, rope), v)
        return attn.to_out(torch.cat([o, attn.mlp_act_fn(mlp)], dim=-1))


def build_flux2(cfg: DiffusersFlux2Config):
    """Random-init ``Flux2Transformer2DModel`` for a :class:`DiffusersFlux2Config` (no download)."""
    return seam.build_diffusers(
        "Flux2Transformer2DModel",
        cfg,
        "axes_dims_rope",
        **flux_sizes(cfg),
        timestep_guidance_channels=32,
        guidance_embeds=cfg.guidance,
    )


def prepare_flux2(model) -> None:
    """Install the packed processors on this model instance only (checked every call: a module
    whose processor was replaced since, e.g. by ``set_attn_processor``, gets its own again)."""
    seam.require_diffusers()
    seam.install([b.attn for b in model.transformer_blocks], PackedFlux2AttnProcessor)
    seam.install([b.attn for b in model.single_transformer_blocks], PackedFlux2ParallelProcessor)


def flux2_seq_lens(model, samples: Sequence[Flux2Sample] | None = None) -> list[int]:
    """Tokens of each sample as the packed forward lays them out (its text, its image, its
    reference tokens): the lengths to plan the step with (0 for a malformed sample: the
    forward names it). The old form ``flux2_seq_lens(model, samples)`` is deprecated."""
    _, samples = seam.model_and_samples("flux2_seq_lens", model, samples)
    return _lengths(samples)


def _lengths(samples: Sequence[Flux2Sample]) -> list[int]:
    return seam.safe_lens(lambda s: s.num_tokens, samples)


def _problem(model, samples: Sequence[Flux2Sample]) -> str:
    """Why these samples cannot run on this model ("" if they can)."""
    c = model.config
    axes = len(c.axes_dims_rope)

    def of(i: int, s: Flux2Sample):
        yield seam.rows_problem(i, "latents", s.latents, c.in_channels, rows="T_img")
        yield seam.rows_problem(i, "text", s.text, c.joint_attention_dim, rows="T_txt")
        yield seam.shape_problem(i, "img_ids", s.img_ids, (s.latents.shape[0], axes))
        yield seam.shape_problem(i, "txt_ids", s.txt_ids, (s.text.shape[0], axes))
        if (s.ref_latents is None) != (s.ref_ids is None):
            yield f"sample {i}: give ref_latents and ref_ids together"
        if s.ref_latents is not None and (
            seam.rows_problem(i, "ref_latents", s.ref_latents, c.in_channels)
            or tuple(s.ref_ids.shape) != (s.ref_latents.shape[0], axes)
        ):
            yield f"sample {i}: ref_latents (T_ref, {c.in_channels}) and ref_ids (T_ref, {axes}) do not match"
        if c.guidance_embeds and s.guidance is None:
            yield f"sample {i}: this model is guidance-distilled: every Flux2Sample needs a guidance value"

    return seam.first(p for i, s in enumerate(samples) for p in of(i, s))


def packed_flux2_forward(
    model, samples: Sequence[Flux2Sample], executor: TokenExecutor | None = None
) -> PackedFlux2Output:
    """Outputs (T_img_i, out_channels) for each sample, in order; differentiable.

    ``executor`` is a ``SequenceBalancer`` already planned for this step with
    ``flux2_seq_lens(model, samples)`` (every rank of the group calls this function), a
    ``LocalExecutor``, or None (attention within each sample on this process)."""
    return seam.through_root(model, lambda: _packed_flux2(model, samples, executor))


def _packed_flux2(model, samples: Sequence[Flux2Sample], executor: TokenExecutor | None = None) -> PackedFlux2Output:
    """:func:`packed_flux2_forward`'s work, run as the model's own call (``seam.through_root``)."""
    c, device, dtype = seam.begin(model, samples, executor, prepare_flux2, _problem, model.x_embedder.weight)
    img_lens = [int(s.latents.shape[0]) for s in samples]
    pk = seam.Packing([(s.text.shape[0], n + s.num_ref) for s, n in zip(samples, img_lens)], _STREAMS, device)
    # 1. embed at home (image and reference tokens are one visual stream, as in the stock batch)
    vis = [torch.cat([s.latents, s.ref_latents]) if s.num_ref else s.latents for s in samples]
    vis_h = model.x_embedder(seam.cat_or_empty(vis, (0, c.in_channels), device, dtype))
    txt_h = model.context_embedder(
        seam.cat_or_empty([s.text for s in samples], (0, c.joint_attention_dim), device, dtype)
    )
    ts = seam.stack_scalars([s.timestep for s in samples], device, dtype) * 1000
    guidance = seam.stack_scalars([s.guidance for s in samples], device, dtype) * 1000 if c.guidance_embeds else None
    temb = model.time_guidance_embed(ts, guidance)  # (S, D): once per sample, as the stock batch
    mods = (
        model.double_stream_modulation_img(temb),
        model.double_stream_modulation_txt(temb),
        model.single_stream_modulation(temb),
        model.norm_out.linear(model.norm_out.silu(temb).to(dtype)),  # the output norm's (S, 2D)
    )
    ids = [torch.cat([s.txt_ids, s.img_ids, *([s.ref_ids] if s.num_ref else [])]) for s in samples]
    ids = seam.cat_or_empty(ids, (0, len(c.axes_dims_rope)), device, torch.float64)
    # 2. route with the RoPE ids; per-sample modulation to every rank of the group
    r = pk.route(executor, pk.merge(txt_h, vis_h), ids, per_sample=mods, names=_MODS)
    rope = model.pos_embed(r.side[0].index_select(0, r.joint)) if r.joint.numel() else None
    s_txt, s_vis = r.sample_of("txt"), r.sample_of("vis")
    mod_img, mod_txt, mod_single, mod_out = r.per_sample
    mod_img, mod_txt, mod_out = mod_img.index_select(0, s_vis), mod_txt.index_select(0, s_txt), mod_out[s_vis]
    mod_single = mod_single.index_select(0, torch.cat([s_txt, s_vis]))
    txt_s, vis_s = r.take(r.h, "txt").unsqueeze(1), r.take(r.h, "vis").unsqueeze(1)  # (T, 1, D)
    kw = {"packed": r}
    # 3. double blocks (stock forwards), then single blocks over all tokens in joint order
    for block in model.transformer_blocks:
        txt_s, vis_s = seam.call_block(model, block, vis_s, txt_s, mod_img, mod_txt, rope, kw)
    allt = torch.cat([txt_s, vis_s])
    for block in model.single_transformer_blocks:
        allt = seam.call_block(model, block, allt, None, mod_single, rope, kw)
    # 4. the stock output norm with each visual token's own row, the projection, back home
    scale, shift = torch.chunk(mod_out, 2, dim=1)
    vis_s = allt[r.count("txt") :]
    out_vis = model.proj_out(model.norm_out.norm(vis_s) * (1 + scale)[:, None, :] + shift[:, None, :])[:, 0]
    rows = r.home(r.merge(out_vis.new_zeros(r.count("txt"), out_vis.shape[1]), out_vis), 1)
    parts = [v[:n] for v, n in zip(pk.split(rows, 1), img_lens)]  # reference tokens' outputs dropped
    return PackedFlux2Output.of(parts, torch.cat(parts) if parts else rows)


_STREAMS = {"txt": (0,), "vis": (1,)}
_MODS = ("image modulation", "text modulation", "single-stream modulation", "output modulation")


def samples_from_batch(batch, cfg: DiffusersFlux2Config, *, seed: int) -> list[Flux2Sample]:
    """Flux.2 samples from a synthetic :class:`~knapformer.data.batches.Batch` (text rows as
    random text states, visual rows as latents on a near-square grid)."""
    g = torch.Generator().manual_seed(seed)
    axes = len(cfg.axes_dims_rope)
    out = []
    for s in seam.batch_samples(batch):
        n, t = s.visual.shape[0], s.text.shape[0]
        w = max(1, int(n**0.5))
        ids = torch.zeros(n, axes, dtype=torch.float64)
        ids[:, 1], ids[:, 2] = torch.arange(n) // w, torch.arange(n) % w
        out.append(
            Flux2Sample(
                latents=s.visual[:, : cfg.in_dim],
                text=torch.randn(t, cfg.text_dim, generator=g).to(batch.x.dtype),
                timestep=s.timestep,
                img_ids=ids,
                txt_ids=torch.zeros(t, axes, dtype=torch.float64),
                guidance=torch.tensor(3.5) if cfg.guidance else None,
            )
        )
    return out


class Flux2Family(seam.PackedFamily):
    """Stock diffusers ``Flux2Transformer2DModel`` for the tools (preset ``diffusers-flux2-tiny``)."""

    name = "diffusers-flux2"
    presets = FLUX2_PRESETS
    build_model, packed_forward = staticmethod(build_flux2), staticmethod(packed_flux2_forward)
    synthetic, lengths = staticmethod(samples_from_batch), staticmethod(_lengths)

    def blocks(self, device, dtype, causal):
        """One stock double-stream and one single-stream block on packed tokens of the given
        lengths (an eighth of each sequence text, the rest image), through a ``LocalExecutor``."""
        cfg = self.config
        model = self.block_model(device, dtype, causal, num_double=1, num_single=1)
        prepare_flux2(model)
        D, axes = cfg.dim, len(cfg.axes_dims_rope)

        def inputs(seq_lens, backward):
            packed = seam.timing_tokens(seq_lens, _STREAMS, device)
            ids = torch.zeros(packed.h.shape[0], axes, device=device)
            ids[:, :3] = packed.side[0]
            rope = model.pos_embed(ids.index_select(0, packed.joint))
            x = lambda n: torch.randn(n, 1, D, device=device, dtype=dtype, requires_grad=backward)  # noqa: E731
            mod = lambda n, k: torch.randn(n, k * D, device=device, dtype=dtype)  # noqa: E731
            return packed, rope, packed.count("txt"), packed.count("vis"), x, mod

        def make_double(seq_lens, backward):
            packed, rope, nt, nv, x, mod = inputs(seq_lens, backward)
            vis, txt, m_img, m_txt = x(nv), x(nt), mod(nv, 6), mod(nt, 6)
            block = model.transformer_blocks[0]

            def run():
                enc, hid = block(vis, txt, m_img, m_txt, rope, {"packed": packed})
                return torch.cat([enc, hid])

            return seam.block_runner(run, backward)

        def make_single(seq_lens, backward):
            packed, rope, nt, nv, x, mod = inputs(seq_lens, backward)
            allt, m = x(nt + nv), mod(nt + nv, 3)
            block = model.single_transformer_blocks[0]
            return seam.block_runner(lambda: block(allt, None, m, rope, {"packed": packed}), backward)

        return [("double", cfg.num_double, make_double), ("single", cfg.num_single, make_single)]
