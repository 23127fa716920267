"""Packed, variable-length (and balanced) forward of torchtitan's ``FluxModel``.

    from knapformer.integrations.torchtitan_flux import TitanFluxSample, titan_flux_seq_lens, packed_titan_flux_forward
    bal.plan(titan_flux_seq_lens(model, samples))          # once per step, like any model
    outs = packed_titan_flux_forward(model, samples, bal)   # list of (T_img_i, C) tensors

torchtitan (``torchtitan.models.flux``) trains Flux on padded, fixed-shape batches (one
resolution per batch, every prompt padded to one T5 length). Here each sample brings its own
resolution, text length, timestep, pooled (CLIP) vector and RoPE ids. Through the family seam
(:mod:`knapformer.integrations.seam`), what is torchtitan's own:

- **Blocks run their stock ``forward``** (torchtitan's FSDP2 per block and its activation
  checkpoint wrappers keep working) on one packed batch row: ``[1, T_img, D]`` image and
  ``[1, T_txt, D]`` text tokens, RoPE of every token from the stock ``EmbedND``.
- **Modulation**: ``vec`` is a :class:`PackedVec`; pre-hooks on each ``Modulation`` (and the
  final layer's ``adaLN_modulation``) run it once per sample, forward hooks expand the
  ``ModulationOut`` fields to the stream's tokens.
- **Attention**: each block's ``inner_attention`` becomes a :class:`PackedTitanAttention`
  (no parameters: the state dict and torchtitan's checkpoints are unchanged), which calls the
  stock module unless the block was called with a :class:`PackedVec`.

torchtitan's ``FluxModel`` has no guidance embedding, so samples carry none.
``pip install 'knapformer[torchtitan]'`` installs the tested versions (torchtitan 0.3.0); this
module imports torchtitan when a model is prepared, never at import.

Legend: T tokens (this rank's routed ones after routing), S samples, D hidden size.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn

from knapformer.executor import TokenExecutor
from knapformer.integrations import seam
from knapformer.integrations._torchtitan import TitanFluxConfig, build_titan_flux, require_torchtitan
from knapformer.integrations.configs import TITAN_FLUX_PRESETS

__all__ = [
    "PackedTitanAttention",
    "PackedTitanFluxOutput",
    "PackedVec",
    "TitanFluxConfig",
    "TitanFluxFamily",
    "TitanFluxSample",
    "build_titan_flux",
    "flow_matching_sample",
    "packed_titan_flux_forward",
    "prepare_titan_flux",
    "require_torchtitan",
    "titan_flux_seq_lens",
    "titan_flux_workload",
]


@dataclass
class TitanFluxSample:
    """One training sample for torchtitan's ``FluxModel`` (no batch dimension anywhere)."""

    latents: torch.Tensor  # (T_img, in_channels) packed 2x2 latent patches (torchtitan's pack_latents)
    text: torch.Tensor  # (T_txt, context_in_dim) T5 encodings, unpadded
    pooled: torch.Tensor  # (vec_in_dim,) CLIP pooled vector
    timestep: torch.Tensor  # () in [0, 1]
    img_ids: torch.Tensor  # (T_img, 3)
    txt_ids: torch.Tensor  # (T_txt, 3)

    @property
    def num_tokens(self) -> int:
        return int(self.text.shape[0] + self.latents.shape[0])


class PackedTitanFluxOutput(seam.PackedOutput):
    """Per-sample image outputs (T_img_i, C) in order, plus ``flat``: all of this rank's image
    outputs as one (T_img, C) tensor (see :class:`~knapformer.integrations._diffusers.PackedOutput`)."""


@dataclass
class _Attend:
    """How this rank's packed tokens attend: the routed streams (joint order: all text rows,
    then all image rows, as the stock blocks concatenate them)."""

    routed: seam.Routed
    pad: int = 0
    """Trailing stand-in rows (a rank with no routed token runs the blocks on one zero token:
    the stock RoPE cannot reshape zero tokens); they attend to nothing and output zeros."""


@dataclass
class PackedVec:
    """The ``vec`` a packed forward hands the stock blocks: per-sample conditioning (S, D) and,
    per stream (``txt``, ``img``, ``all`` = text rows then image rows), the sample of each
    token. The modulation hooks compute per sample and expand to the tokens."""

    per_sample: torch.Tensor
    rows: dict[str, torch.Tensor]
    attend: _Attend


class PackedTitanAttention(nn.Module):
    """A block's ``inner_attention`` for packed calls: the stock module (``stock``) unless the
    block was called with a :class:`PackedVec`, then attention within each sample through the
    executor. q/k/v arrive as ``(1, T, H, Dh)`` in joint order, as the stock block builds them.

    Flux attends bidirectionally, and :func:`titan_flux_workload` prices it so: a packed call
    that omits ``is_causal`` runs non-causal attention (the stock module's own default applies
    to stock calls only), and one that asks for causal attention raises, since its plan priced
    the other mask."""

    def __init__(self, stock: nn.Module) -> None:
        super().__init__()
        self.stock = stock
        self._attend: _Attend | None = None

    def forward(self, q, k, v, *args, is_causal: bool | None = None, **kwargs):
        attend, self._attend = self._attend, None
        if attend is None:
            if is_causal is not None:
                kwargs["is_causal"] = is_causal
            return self.stock(q, k, v, *args, **kwargs)
        if is_causal:
            raise ValueError(
                "a packed torchtitan Flux call asked for causal attention: Flux attends bidirectionally "
                "and titan_flux_workload prices non-causal attention; pass is_causal=False or leave it out"
            )
        r = attend.routed
        q, k, v = (t[0].index_select(0, r.inv) for t in (q, k, v))
        o = r.executor.attention(q, k, v, causal=False).index_select(0, r.joint)
        if attend.pad:
            o = torch.cat([o, o.new_zeros(attend.pad, *o.shape[1:])])
        return o.unsqueeze(0).to(q.dtype)


def _vec_arg(args, kwargs, position: int):
    return kwargs["vec"] if "vec" in kwargs else (args[position] if len(args) > position else None)


def _block_hook(position: int):
    """Pre-hook of a block: a packed call (``vec`` is a :class:`PackedVec`) arms its attention."""

    def hook(block, args, kwargs):
        vec = _vec_arg(args, kwargs, position)
        block.inner_attention._attend = vec.attend if isinstance(vec, PackedVec) else None

    return hook


def _mod_pre(stream: str):
    """Pre-hook of a modulation module: per-sample rows in, the stream's token->sample rows
    noted for :func:`_mod_post`; cast as FSDP2's mixed precision casts a tensor ``vec``."""

    def hook(module, args):
        if not args or not isinstance(args[0], PackedVec):
            module._knapformer_rows = None
            return None
        vec = args[0]
        module._knapformer_rows = vec.rows[stream]
        weight = next(module.parameters())
        return (vec.per_sample.to(weight.dtype), *args[1:])

    return hook


def _mod_post(module, inputs, output):
    """(S, ...) modulation -> one row per token: a block's ``ModulationOut`` pair becomes
    ``(1, T, D)`` fields (the packed batch row); the final layer's ``(S, 2D)`` becomes (T, 2D)."""
    rows, module._knapformer_rows = getattr(module, "_knapformer_rows", None), None
    if rows is None:
        return None
    if isinstance(output, torch.Tensor):
        return output.index_select(0, rows)

    def expand(mod):
        if mod is None:
            return None
        fields = {f.name: getattr(mod, f.name)[:, 0].index_select(0, rows)[None] for f in dataclasses.fields(mod)}
        return type(mod)(**fields)

    return tuple(expand(m) for m in output)


def _inner(block: nn.Module) -> nn.Module:
    """The block under torchtitan's activation-checkpoint wrapper, if any."""
    return getattr(block, "_checkpoint_wrapped_module", block)


def prepare_titan_flux(model) -> None:
    """Install the packed attention and the modulation hooks on this model instance only (the
    stock forward keeps its behaviour: every hook passes a plain tensor through). Idempotent;
    works before or after torchtitan's ``parallelize_flux`` (FSDP2, activation checkpointing)."""
    require_torchtitan()
    hooks = []
    for block in model.double_blocks:
        b = _inner(block)
        hooks += [(b, 2, {b.img_mod: "img", b.txt_mod: "txt"})]
    for block in model.single_blocks:
        b = _inner(block)
        hooks += [(b, 1, {b.modulation: "all"})]
    for b, position, mods in hooks:
        if not isinstance(b.inner_attention, PackedTitanAttention):
            b.inner_attention = PackedTitanAttention(b.inner_attention)
        if not getattr(b, "_knapformer_hooked", False):
            b.register_forward_pre_hook(_block_hook(position), with_kwargs=True)
            b._knapformer_hooked = True
        for mod, stream in mods.items():
            _hook_modulation(mod, stream)
    _hook_modulation(model.final_layer.adaLN_modulation, "img")


def _hook_modulation(mod: nn.Module, stream: str) -> None:
    if not getattr(mod, "_knapformer_hooked", False):
        mod.register_forward_pre_hook(_mod_pre(stream))
        mod.register_forward_hook(_mod_post)
        mod._knapformer_hooked = True


# -- sizes, cost, samples ------------------------------------------------------------------------
@dataclass(frozen=True)
class _Dims:
    in_channels: int
    context: int
    vec: int
    axes: int
    hidden: int
    heads: int


def _dims(model) -> _Dims:
    return _Dims(
        in_channels=model.img_in.in_features,
        context=model.txt_in.in_features,
        vec=model.vector_in.in_layer.in_features,
        axes=len(model.pe_embedder.axes_dim),
        hidden=model.hidden_size,
        heads=model.num_heads,
    )


def titan_flux_workload(model, *, gamma: float = 1.0):
    """The planner's cost model of a ``FluxModel``: d_model its hidden size (the blocks cost
    ``24·d²`` FLOPs per token in either stream with the stock 4× MLP), every double and single
    block a layer, and its heads bound the Ulysses degrees ``auto`` may choose."""
    from knapformer.workload import WorkloadModel

    return WorkloadModel(
        d_model=model.hidden_size,
        gamma=gamma,
        num_layers=len(model.double_blocks) + len(model.single_blocks),
        num_heads=model.num_heads,
    )


def titan_flux_seq_lens(model, samples: Sequence[TitanFluxSample] | None = None) -> list[int]:
    """Tokens of each sample as the packed forward lays them out (its text, then its image):
    the lengths to plan the step with (0 for a malformed sample: the forward names it). The
    old form ``titan_flux_seq_lens(model, samples)`` is deprecated."""
    _, samples = seam.model_and_samples("titan_flux_seq_lens", model, samples)
    return _lengths(samples)


def _lengths(samples: Sequence[TitanFluxSample]) -> list[int]:
    return seam.safe_lens(lambda s: s.text.shape[0] + s.latents.shape[0], samples)


def _problem(d: _Dims, samples: Sequence[TitanFluxSample]) -> str:
    """Why these samples cannot run on this model ("" if they can)."""

    def of(i: int, s):
        if not isinstance(s, TitanFluxSample):
            yield f"sample {i} is a {type(s).__name__}, expected a TitanFluxSample"
            return
        yield seam.rows_problem(i, "latents", s.latents, d.in_channels, rows="T_img")
        yield seam.rows_problem(i, "text", s.text, d.context, rows="T_txt")
        yield seam.shape_problem(i, "img_ids", s.img_ids, (s.latents.shape[0], d.axes))
        yield seam.shape_problem(i, "txt_ids", s.txt_ids, (s.text.shape[0], d.axes))
        yield seam.shape_problem(i, "pooled", s.pooled, (d.vec,))
        yield seam.scalar_problem(i, "timestep", s.timestep)

    return seam.first(p for i, s in enumerate(samples) for p in of(i, s))


def packed_titan_flux_forward(
    model, samples: Sequence[TitanFluxSample], executor: TokenExecutor | None = None
) -> PackedTitanFluxOutput:
    """Outputs (T_img_i, out_channels) for each sample, in order; differentiable.

    ``executor`` is a ``SequenceBalancer`` already planned for this step with
    ``titan_flux_seq_lens(model, samples)`` (every rank of the group calls this function), a
    ``LocalExecutor``, or None (attention within each sample on this process). A malformed
    sample raises on every rank of the balancer's group."""
    return seam.through_root(model, lambda: _packed_titan_flux(model, samples, executor))


def _packed_titan_flux(
    model, samples: Sequence[TitanFluxSample], executor: TokenExecutor | None = None
) -> PackedTitanFluxOutput:
    """:func:`packed_titan_flux_forward`'s work, run as the model's own call (``seam.through_root``)."""
    from torchtitan.models.flux.model.layers import timestep_embedding

    prepare_titan_flux(model)
    d = _dims(model)
    seam.raise_problem(executor, _problem(d, samples))
    weight = model.img_in.weight
    device, dtype = weight.device, weight.dtype
    pk = seam.Packing([(s.text.shape[0], s.latents.shape[0]) for s in samples], {"txt": (0,), "img": (1,)}, device)
    # 1. embed locally (every embedder runs, possibly on empty inputs: all params get grads)
    img_h = model.img_in(seam.cat_or_empty([s.latents for s in samples], (0, d.in_channels), device, dtype))
    txt_h = model.txt_in(seam.cat_or_empty([s.text for s in samples], (0, d.context), device, dtype))
    ts = seam.stack_scalars([s.timestep for s in samples], device)  # not rounded to the model's dtype
    pooled = seam.cat_or_empty([s.pooled[None] for s in samples], (0, d.vec), device, dtype)
    vec = model.time_in(timestep_embedding(ts, 256).to(dtype)) + model.vector_in(pooled)  # (S, D), as the stock forward
    ids_dtype = samples[0].img_ids.dtype if samples else torch.float32
    ids = seam.cat_or_empty([torch.cat([s.txt_ids, s.img_ids]) for s in samples], (0, d.axes), device, torch.float64)
    # 2. route (a local executor keeps everything in place); ids travel losslessly in float64
    r = pk.route(executor, pk.merge(txt_h, img_h), ids, per_sample=(vec,), names=("vec",))
    (vec_all,), (ids_r,), h, seq_id, joint = r.per_sample, r.side, r.h, r.seq_id, r.joint
    r_txt, r_img = r.rows["txt"], r.rows["img"]
    # a rank with no routed token still runs every block (each attention is collective): on one
    # zero image token with a zero vec (the stock RoPE cannot reshape zero tokens)
    pad = int(joint.numel() == 0)
    # modulation per sample present here only (its FLOPs do not grow with the group)
    vec_p = r.present_rows(vec_all)
    per_sample = torch.cat([vec_p, vec_p.new_zeros(pad, vec_p.shape[1])])
    stand_in = torch.full((pad,), vec_p.shape[0], dtype=seq_id.dtype, device=device)
    sample_txt = r.slot_of("txt")
    sample_img = torch.cat([r.slot_of("img"), stand_in])
    packed = PackedVec(
        per_sample=per_sample,
        rows={"txt": sample_txt, "img": sample_img, "all": torch.cat([sample_txt, sample_img])},
        attend=_Attend(r, pad=pad),
    )
    ids_j = torch.cat([ids_r.index_select(0, joint), ids_r.new_zeros(pad, d.axes)])
    pe = model.pe_embedder(ids_j.to(ids_dtype)[None])  # (1, T, 1, Dh/2, 2, 2)
    txt_s = h.index_select(0, r_txt)[None]  # (1, T_txt, D)
    img_s = torch.cat([h.index_select(0, r_img), h.new_zeros(pad, h.shape[1])])[None]
    # 3. double blocks, then single blocks over text + image (stock forwards)
    for block in model.double_blocks:
        img_s, txt_s = block(img=img_s, txt=txt_s, vec=packed, pe=pe)
    num_txt = txt_s.shape[1]
    x = torch.cat([txt_s, img_s], dim=1)
    for block in model.single_blocks:
        x = block(x, vec=packed, pe=pe)
    # 4. output head per image token ("batch = tokens": its modulation is (T, 2D)), back home
    out_img = model.final_layer(x[0, num_txt:].unsqueeze(1), packed)[: x.shape[1] - num_txt - pad, 0]  # (R_img, C)
    img_rows = r.home(r.merge(out_img.new_zeros(num_txt, out_img.shape[1]), out_img), 1)
    return PackedTitanFluxOutput.of(pk.split(img_rows, 1), img_rows)


def flow_matching_sample(
    latent: torch.Tensor, t5: torch.Tensor, clip: torch.Tensor, *, timestep: torch.Tensor, noise: torch.Tensor
) -> tuple[TitanFluxSample, torch.Tensor]:
    """What torchtitan's ``FluxTrainer.forward_backward_step`` makes of a batch, for one image of
    any size: the noised latent ``(1 − t)·x + t·noise`` cut into 2×2 patches with torchtitan's
    ``pack_latents``, their ids from ``create_position_encoding_for_latents``, zero text ids; and
    the flow-matching target ``noise − x`` packed the same way.

    ``latent``: (C, H, W) from the autoencoder (H, W even); ``t5``: (T_txt, context) the prompt's
    T5 encodings *without* padding; ``clip``: (vec,) its pooled CLIP vector; ``timestep``: () in
    [0, 1]; ``noise``: like ``latent``. Returns (sample, target (T_img, 4·C))."""
    from torchtitan.models.flux.utils import create_position_encoding_for_latents, pack_latents

    if latent.dim() != 3 or latent.shape[1] % 2 or latent.shape[2] % 2:
        raise ValueError(f"latent must be (C, H, W) with H and W even, got {tuple(latent.shape)}")
    if noise.shape != latent.shape:
        raise ValueError(f"noise must have the latent's shape {tuple(latent.shape)}, got {tuple(noise.shape)}")
    if t5.dim() != 2 or clip.dim() != 1:
        raise ValueError(f"t5 must be (T_txt, width) and clip (width,), got {tuple(t5.shape)} and {tuple(clip.shape)}")
    t = torch.as_tensor(timestep, dtype=latent.dtype, device=latent.device).reshape(())
    x, n = latent[None], noise[None]
    sample = TitanFluxSample(
        latents=pack_latents((1 - t) * x + t * n)[0],
        text=t5,
        pooled=clip,
        timestep=t,
        img_ids=create_position_encoding_for_latents(1, latent.shape[1], latent.shape[2], 3)[0].to(latent.device),
        txt_ids=torch.zeros(t5.shape[0], 3, device=latent.device),
    )
    return sample, pack_latents(n - x)[0]


# -- synthetic samples for the tools ------------------------------------------------------------
def samples_from_batch(batch, cfg: TitanFluxConfig, *, seed: int) -> list[TitanFluxSample]:
    """Samples from a synthetic :class:`~knapformer.data.batches.Batch` (text rows first in
    each sequence; image ids on a near-square grid)."""
    g = torch.Generator().manual_seed(seed)
    return [
        TitanFluxSample(
            latents=s.visual[:, : cfg.in_dim],
            text=torch.randn(s.text.shape[0], cfg.text_dim, generator=g).to(batch.x.dtype),
            pooled=s.vec[: cfg.vec_dim],
            timestep=s.timestep,
            img_ids=seam.grid_ids(s.visual.shape[0], dtype=torch.float32),
            txt_ids=torch.zeros(s.text.shape[0], 3),
        )
        for s in seam.batch_samples(batch)
    ]


class TitanFluxFamily(seam.PackedFamily):
    """torchtitan's ``FluxModel`` for the tools (preset ``torchtitan-flux-tiny``)."""

    name = "torchtitan-flux"
    presets = TITAN_FLUX_PRESETS
    build_model, packed_forward = staticmethod(build_titan_flux), staticmethod(packed_titan_flux_forward)
    synthetic, lengths = staticmethod(samples_from_batch), staticmethod(_lengths)
