"""HunyuanVideo 1.5's packed attention, RoPE rows and text refiner (diffusers' model).

- :class:`PackedHunyuanAttnProcessor`, set on this model instance's attention modules: for the
  dual-stream blocks it computes q/k/v of the video and of the context tokens with the stock
  projections and norms, rotates the video's q/k with the stock ``apply_rotary_emb``, and
  attends within each sample through the routed streams (Ulysses inside the sample's group,
  rings beyond the heads); for the text refiner's blocks it attends within each sample's text
  on the rank that loaded it. The packed metadata (:class:`HunyuanPacked`) arrives as the
  blocks' ``attention_mask`` argument, so activation-checkpoint recompute sees it; any other
  call goes to the module's previous (stock) processor.
- Per-sample modulation: the blocks' ``temb`` argument is a ``PerSample``; every AdaLN module
  (``norm1``, ``norm1_context``, the refiner's ``norm_out``) is hooked by the seam's
  ``hook_norm``.
- :func:`refine_text`: the stock token refiner over each sample's MLLM text, packed.

Used by :mod:`knapformer.integrations.hunyuanvideo15`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from knapformer.executor import LocalExecutor, local_positions
from knapformer.integrations import seam

__all__ = [
    "HunyuanPacked",
    "PackedHunyuanAttnProcessor",
    "prepare_hunyuanvideo15",
    "refine_text",
    "rope_rows",
]


@dataclass(eq=False)
class HunyuanPacked:
    """How this rank's packed tokens attend: the routed streams (dual-stream blocks; joint
    order = all video rows, then all context rows, as the stock processor concatenates them), or
    for the text refiner's blocks the executor holding each sample's text in order."""

    routed: seam.Routed | None = None
    executor: LocalExecutor | None = None


class PackedHunyuanAttnProcessor:
    """HunyuanVideo 1.5 attention over packed ``[T, 1, D]`` tokens; ``stock`` when not packed."""

    def __init__(self, stock) -> None:
        self.stock = stock

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        if not isinstance(attention_mask, HunyuanPacked):
            if image_rotary_emb is None:  # the refiner's processor (AttnProcessor2_0) takes no RoPE
                return self.stock(attn, hidden_states, encoder_hidden_states, attention_mask)
            return self.stock(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
        packed = attention_mask
        q, k, v = (seam.heads(f(hidden_states), attn.heads) for f in (attn.to_q, attn.to_k, attn.to_v))
        q = attn.norm_q(q) if attn.norm_q is not None else q
        k = attn.norm_k(k) if attn.norm_k is not None else k
        if encoder_hidden_states is None:  # the text refiner: self-attention within each sample's text
            o = packed.executor.attention(q, k, v).flatten(1, 2).unsqueeze(1).to(q.dtype)
            o = attn.to_out[1](attn.to_out[0](o))
            if attn.residual_connection:
                o = o + hidden_states
            return o / attn.rescale_output_factor
        q, k = seam.rotate(q, image_rotary_emb), seam.rotate(k, image_rotary_emb)
        e = encoder_hidden_states
        eq, ek, ev = (seam.heads(f(e), attn.heads) for f in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))
        eq = attn.norm_added_q(eq) if attn.norm_added_q is not None else eq
        ek = attn.norm_added_k(ek) if attn.norm_added_k is not None else ek
        o = packed.routed.attention(*(torch.cat([a, b]) for a, b in ((q, eq), (k, ek), (v, ev))))
        n_vid = hidden_states.shape[0]
        return attn.to_out[1](attn.to_out[0](o[:n_vid])), attn.to_add_out(o[n_vid:])


def prepare_hunyuanvideo15(model) -> None:
    """Install the packed processor (wrapping whatever processor each module had) and the
    modulation hooks on this model instance only; checked every call, so a module whose
    processor was replaced since (``set_attn_processor``) gets a packed one again."""
    seam.require_diffusers()
    refiner = model.context_embedder.token_refiner.refiner_blocks
    attns = [b.attn for b in [*model.transformer_blocks, *refiner]]
    seam.install(attns, PackedHunyuanAttnProcessor, make=lambda attn: PackedHunyuanAttnProcessor(attn.processor))
    for b in model.transformer_blocks:
        seam.hook_norm(b.norm1, "vid")
        seam.hook_norm(b.norm1_context, "ctx")
    for b in refiner:
        seam.hook_norm(b.norm_out, "txt")


def rope_rows(model, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE (cos, sin), each (T, Dh), of video tokens at integer (frame, row, column) positions
    ``pos`` (T, 3): the stock ``get_1d_rotary_pos_embed`` on each axis's float32 positions,
    what the stock ``HunyuanVideo15RotaryPosEmbed`` computes for the whole grid."""
    from diffusers.models.embeddings import get_1d_rotary_pos_embed

    r = model.rope
    axes = [
        get_1d_rotary_pos_embed(d, pos[:, i].to(torch.float32), r.theta, use_real=True)
        for i, d in enumerate(r.rope_dim)
    ]
    return torch.cat([a[0] for a in axes], dim=1), torch.cat([a[1] for a in axes], dim=1)


def refine_text(model, rows: list[torch.Tensor], ts: torch.Tensor, device, dtype) -> torch.Tensor:
    """The stock token refiner (``context_embedder``) over each sample's kept MLLM rows
    (``rows[i]``: (L_i, text_embed_dim)) with its timestep ``ts[i]``, packed on this rank: the
    pooled mean of the sample's rows, its time + text embedding, self-attention within the
    sample. -> (sum L_i, D). A sample with no rows gets a zero mean (the stock 0/0 is NaN) that
    no token uses."""
    ce = model.context_embedder
    lens = [int(r.shape[0]) for r in rows]
    x = seam.cat_or_empty(rows, (0, ce.proj_in.in_features), device, dtype)
    seg, _ = local_positions(lens, device)
    counts = torch.tensor(lens, dtype=dtype).clamp(min=1).to(device, non_blocking=True)
    pooled = x.new_zeros(len(rows), x.shape[1]).index_add(0, seg, x) / counts[:, None]
    h = ce.proj_in(x).unsqueeze(1)  # (T_txt, 1, D)
    temb = seam.PerSample(ce.time_text_embed(ts, pooled), {"txt": seg})
    attend = HunyuanPacked(executor=LocalExecutor(lens))
    for block in ce.token_refiner.refiner_blocks:
        h = seam.call_block(model, block, h, temb, attend)
    return h[:, 0]
