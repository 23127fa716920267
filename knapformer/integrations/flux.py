"""Packed, variable-length (and balanced) forward of a stock diffusers ``FluxTransformer2DModel``.

    from knapformer.integrations.flux import FluxSample, flux_seq_lens, packed_flux_forward
    bal.plan(flux_seq_lens(model, samples))                 # once per step, like any model
    outs = packed_flux_forward(model, samples, bal)          # list of (T_img_i, C) tensors

Each sample brings its own resolution, text length, timestep, guidance and RoPE ids. Through
the family seam (:mod:`knapformer.integrations.seam`), what is Flux's own: double blocks get a
sample's text as ``encoder_hidden_states`` and its image as ``hidden_states``, single blocks
all tokens in joint order (text, then image) with an empty ``[T, 0, D]`` text; every AdaLN norm
(``norm1``, ``norm1_context``, ``norm``, ``norm_out``) modulates per sample; the packed
metadata travels in ``joint_attention_kwargs``. Needs ``pip install 'knapformer[diffusers]'``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from knapformer.executor import TokenExecutor
from knapformer.integrations import seam
from knapformer.integrations._diffusers import flux_sizes
from knapformer.integrations.configs import FLUX_PRESETS, DiffusersFluxConfig

__all__ = [
    "DiffusersFluxConfig",
    "FluxFamily",
    "FluxSample",
    "PackedFluxAttnProcessor",
    "PackedFluxOutput",
    "build_flux",
    "flux_seq_lens",
    "flux_workload",
    "packed_flux_forward",
    "prepare_flux",
    "require_diffusers",
    "samples_from_batch",
]


require_diffusers = seam.require_diffusers  # public here since 0.1


@dataclass
class FluxSample:
    """One training sample for a Flux model (no batch dimension anywhere)."""

    latents: torch.Tensor  # (T_img, in_channels) packed latent patches
    text: torch.Tensor  # (T_txt, joint_attention_dim) text encoder states
    pooled: torch.Tensor  # (pooled_projection_dim,)
    timestep: torch.Tensor  # () in [0, 1]
    img_ids: torch.Tensor  # (T_img, 3)
    txt_ids: torch.Tensor  # (T_txt, 3)
    guidance: torch.Tensor | None = None  # () for guidance-distilled models

    @property
    def num_tokens(self) -> int:
        return int(self.text.shape[0] + self.latents.shape[0])


class PackedFluxOutput(seam.PackedOutput):
    """Per-sample image outputs (T_img_i, C) in order, plus ``flat``: them as one tensor."""


class PackedFluxAttnProcessor(seam.PackedProcessor):
    """Flux attention over packed ``[T, 1, D]`` tokens (joint order: text, then image; single
    blocks: no ``encoder_hidden_states``); stock behaviour when not packed. Flux.2's
    double-stream processor is this one over its own stock projections."""

    stock = "diffusers.models.transformers.transformer_flux:FluxAttnProcessor"

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rope=None, packed=None):
        if packed is None:
            return self._stock(attn, hidden_states, encoder_hidden_states, attention_mask, rope)
        qkv = self.stock_module()._get_qkv_projections(attn, hidden_states, encoder_hidden_states)
        q, k, v, eq, ek, ev = (t if t is None else seam.heads(t, attn.heads) for t in qkv)
        q, k = attn.norm_q(q), attn.norm_k(k)
        if encoder_hidden_states is not None:
            eq, ek = attn.norm_added_q(eq), attn.norm_added_k(ek)
            q, k, v = torch.cat([eq, q]), torch.cat([ek, k]), torch.cat([ev, v])
        o = packed.attention(seam.rotate(q, rope), seam.rotate(k, rope), v)
        if encoder_hidden_states is None:
            return o
        enc, img = o[: packed.count("txt")], o[packed.count("txt") :]
        return attn.to_out[1](attn.to_out[0](img.contiguous())), attn.to_add_out(enc.contiguous())


def build_flux(cfg):
    """Random-init ``FluxTransformer2DModel`` for a :class:`DiffusersFluxConfig` (no download)."""
    return seam.build_diffusers(
        "FluxTransformer2DModel",
        cfg,
        "axes_dims_rope",
        **flux_sizes(cfg),
        pooled_projection_dim=cfg.vec_dim,
        guidance_embeds=False,
    )


def samples_from_batch(batch, cfg, *, seed: int) -> list[FluxSample]:
    """Flux samples from a synthetic :class:`~knapformer.data.batches.Batch` (text tokens first
    in each sequence; image ids on a near-square grid)."""
    g = torch.Generator().manual_seed(seed)
    return [
        FluxSample(
            latents=s.visual[:, : cfg.in_dim],
            text=torch.randn(s.text.shape[0], cfg.text_dim, generator=g).to(batch.x.dtype),
            pooled=s.vec[: cfg.vec_dim],
            timestep=s.timestep,
            img_ids=seam.grid_ids(s.visual.shape[0]),
            txt_ids=torch.zeros(s.text.shape[0], 3, dtype=torch.float64),
        )
        for s in seam.batch_samples(batch)
    ]


def prepare_flux(model) -> None:
    """Install the packed attention processor and the per-stream modulation hooks on this model
    instance only (the stock forward keeps its behaviour); checked every call."""
    seam.require_diffusers()
    seam.install(
        [b.attn for b in [*model.transformer_blocks, *model.single_transformer_blocks]], PackedFluxAttnProcessor
    )
    for b in model.transformer_blocks:
        seam.hook_norm(b.norm1, "img")
        seam.hook_norm(b.norm1_context, "txt")
    for b in model.single_transformer_blocks:
        seam.hook_norm(b.norm, "all")
    seam.hook_norm(model.norm_out, "img")


def flux_workload(model, *, gamma: float = 1.0):
    """The planner's cost model of a ``FluxTransformer2DModel``: every double and single block a
    layer of ``24·d²`` FLOPs per token (``seam.diffusers_workload``)."""
    return seam.diffusers_workload(model, model.config.num_layers + model.config.num_single_layers, gamma)


def flux_seq_lens(model, samples: Sequence[FluxSample] | None = None) -> list[int]:
    """Tokens of each sample as the packed forward lays them out (its text, then its image):
    the lengths to plan the step with (0 for a malformed sample: the forward names it). The
    old form ``flux_seq_lens(model, samples)`` is deprecated (``seam.model_and_samples``)."""
    _, samples = seam.model_and_samples("flux_seq_lens", model, samples)
    return _lengths(samples)


def _lengths(samples: Sequence[FluxSample]) -> list[int]:
    return seam.safe_lens(lambda s: s.text.shape[0] + s.latents.shape[0], samples)


def _problem(model, samples: Sequence[FluxSample]) -> str:
    """Why these samples cannot run on this model ("" if they can)."""
    c = model.config

    def of(i: int, s: FluxSample):
        yield seam.rows_problem(i, "latents", s.latents, c.in_channels, rows="T_img")
        yield seam.rows_problem(i, "text", s.text, c.joint_attention_dim, rows="T_txt")
        yield seam.shape_problem(i, "img_ids", s.img_ids, (s.latents.shape[0], 3))
        yield seam.shape_problem(i, "txt_ids", s.txt_ids, (s.text.shape[0], 3))
        yield seam.shape_problem(i, "pooled", s.pooled, (c.pooled_projection_dim,))
        yield seam.scalar_problem(i, "timestep", s.timestep)
        if c.guidance_embeds and s.guidance is None:
            yield "this model is guidance-distilled: every FluxSample needs a guidance value"

    return seam.first(p for i, s in enumerate(samples) for p in of(i, s))


def packed_flux_forward(
    model, samples: Sequence[FluxSample], executor: TokenExecutor | None = None
) -> PackedFluxOutput:
    """Outputs (T_img_i, out_channels) for each sample, in order; differentiable.

    ``executor`` is a ``SequenceBalancer`` already planned for this step with
    ``flux_seq_lens(model, samples)`` (every rank of the group calls this function), a
    ``LocalExecutor``, or None (attention within each sample on this process)."""
    return seam.through_root(model, lambda: _packed_flux(model, samples, executor))


def _packed_flux(model, samples: Sequence[FluxSample], executor: TokenExecutor | None = None) -> PackedFluxOutput:
    """:func:`packed_flux_forward`'s work, run as the model's own call (``seam.through_root``)."""
    c, device, dtype = seam.begin(model, samples, executor, prepare_flux, _problem, model.x_embedder.weight)
    pk = seam.Packing([(s.text.shape[0], s.latents.shape[0]) for s in samples], {"txt": (0,), "img": (1,)}, device)
    # 1. embed at home (every embedder runs, possibly on empty inputs: all params get grads)
    img_h = model.x_embedder(seam.cat_or_empty([s.latents for s in samples], (0, c.in_channels), device, dtype))
    txt_h = model.context_embedder(
        seam.cat_or_empty([s.text for s in samples], (0, c.joint_attention_dim), device, dtype)
    )
    ts = seam.stack_scalars([s.timestep for s in samples], device, dtype) * 1000
    pooled = seam.cat_or_empty([s.pooled[None] for s in samples], (0, c.pooled_projection_dim), device, dtype)
    if c.guidance_embeds:
        temb = model.time_text_embed(
            ts, seam.stack_scalars([s.guidance for s in samples], device, dtype) * 1000, pooled
        )
    else:
        temb = model.time_text_embed(ts, pooled)
    ids = seam.cat_or_empty([torch.cat([s.txt_ids, s.img_ids]) for s in samples], (0, 3), device, None)
    # 2. route with the RoPE ids; the per-sample temb to the group
    r = pk.route(executor, pk.merge(txt_h, img_h), ids.to(torch.float64), per_sample=(temb,), names=("temb",))
    rope = model.pos_embed(r.side[0].index_select(0, r.joint)) if r.joint.numel() else None
    # modulation per sample present here only (its FLOPs do not grow with the group)
    txt_rows, img_rows = r.slot_of("txt"), r.slot_of("img")
    temb_p = r.present_rows(r.per_sample[0])
    st = seam.PerSample(temb_p, {"txt": txt_rows, "img": img_rows, "all": torch.cat([txt_rows, img_rows])})
    txt_s, img_s = r.take(r.h, "txt").unsqueeze(1), r.take(r.h, "img").unsqueeze(1)  # (T, 1, D)
    kw = {"packed": r}
    # 3. double blocks (stock forwards), then single blocks over all tokens in joint order
    for block in model.transformer_blocks:
        txt_s, img_s = seam.call_block(model, block, img_s, txt_s, st, rope, kw)
    allt = torch.cat([txt_s, img_s])
    empty = allt.new_zeros(allt.shape[0], 0, model.inner_dim)
    for block in model.single_transformer_blocks:
        _, allt = seam.call_block(model, block, allt, empty, st, rope, kw)
    # 4. output head on image tokens (per-token norm_out modulation), back home
    out_img = model.proj_out(model.norm_out(allt[r.count("txt") :], st))[:, 0]  # (R_img, C)
    rows = r.home(r.merge(out_img.new_zeros(r.count("txt"), out_img.shape[1]), out_img), 1)
    return PackedFluxOutput.of(pk.split(rows, 1), rows)


class FluxFamily(seam.PackedFamily):
    """Stock diffusers ``FluxTransformer2DModel`` for the tools (preset ``diffusers-flux-tiny``)."""

    name = "diffusers-flux"
    presets = FLUX_PRESETS
    build_model, packed_forward = staticmethod(build_flux), staticmethod(packed_flux_forward)
    synthetic, lengths = staticmethod(samples_from_batch), staticmethod(_lengths)
