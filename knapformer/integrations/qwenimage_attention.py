"""Qwen-Image's packed attention and per-sample modulation: the processor of each block's joint
attention over packed ``[T, 1, D]`` tokens, the hooks that expand a block's per-sample
``img_mod``/``txt_mod`` output to its tokens, and the MSRoPE rows of routed tokens.

Used by :mod:`knapformer.integrations.qwenimage`; stock behaviour when a call is not packed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from knapformer.integrations import seam

__all__ = ["PackedQwenAttnProcessor", "QwenPacked", "prepare_qwenimage", "rope_rows"]

TABLE = 4096
"""Rows of ``QwenEmbedRope``'s positive (and of its negative) frequency table."""


@dataclass(eq=False)
class QwenPacked:
    """What a packed block call needs: the routed streams (joint order = all text rows, then all
    image rows) and each token's row of the block's ``temb``."""

    routed: seam.Routed
    img_rows: torch.Tensor  # per image token: its row of the block's temb
    txt_rows: torch.Tensor  # per text token: its row of the block's temb


class PackedQwenAttnProcessor(seam.PackedProcessor):
    """Qwen-Image joint attention over packed ``[T, 1, D]`` tokens; stock when not packed."""

    stock = "diffusers.models.transformers.transformer_qwenimage:QwenDoubleStreamAttnProcessor2_0"

    def __call__(
        self,
        attn,
        hidden_states,
        encoder_hidden_states=None,
        encoder_hidden_states_mask=None,
        attention_mask=None,
        image_rotary_emb=None,
        packed: QwenPacked | None = None,
    ):
        if packed is None:
            return self._stock(
                attn, hidden_states, encoder_hidden_states, encoder_hidden_states_mask, attention_mask, image_rotary_emb
            )
        apply_rotary_emb_qwen = self.stock_module().apply_rotary_emb_qwen
        e = encoder_hidden_states
        q, k, v = (seam.heads(f(hidden_states), attn.heads) for f in (attn.to_q, attn.to_k, attn.to_v))
        tq, tk, tv = (seam.heads(f(e), attn.heads) for f in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))
        q = attn.norm_q(q) if attn.norm_q is not None else q
        k = attn.norm_k(k) if attn.norm_k is not None else k
        tq = attn.norm_added_q(tq) if attn.norm_added_q is not None else tq
        tk = attn.norm_added_k(tk) if attn.norm_added_k is not None else tk
        img_freqs, txt_freqs = image_rotary_emb
        if q.shape[0]:  # the stock rotation cannot reshape zero tokens
            q, k = (apply_rotary_emb_qwen(t[None], img_freqs, use_real=False)[0] for t in (q, k))
        if tq.shape[0]:
            tq, tk = (apply_rotary_emb_qwen(t[None], txt_freqs, use_real=False)[0] for t in (tq, tk))
        o = packed.routed.attention(*(torch.cat([a, b]) for a, b in ((tq, q), (tk, k), (tv, v))))
        n_txt = e.shape[0]
        img_o = attn.to_out[0](o[n_txt:].contiguous())
        if len(attn.to_out) > 1:
            img_o = attn.to_out[1](img_o)
        return img_o, attn.to_add_out(o[:n_txt].contiguous())


def _note(block, args, kwargs):
    """Forward pre-hook of a block: a packed call's token -> temb rows, noted on its two
    modulation modules (cleared for a stock call): the block chunks ``temb`` itself, so the
    rows cannot ride on it."""
    jak = kwargs["joint_attention_kwargs"] if "joint_attention_kwargs" in kwargs else (args[5:6] or [None])[0]
    packed = jak.get("packed") if isinstance(jak, dict) else None
    seam.note_rows(block.img_mod, None if packed is None else packed.img_rows)
    seam.note_rows(block.txt_mod, None if packed is None else packed.txt_rows)


def rope_rows(model, pos: torch.Tensor) -> torch.Tensor:
    """Complex RoPE rows (n, Dh/2) of tokens at integer positions (n, 3), from the model's tables."""
    pe = model.pos_embed
    tables = torch.cat([pe.neg_freqs, pe.pos_freqs]).to(pos.device, non_blocking=True)  # row p + 4096 = position p
    axes = tables.split([a // 2 for a in pe.axes_dim], dim=1)
    return torch.cat([t.index_select(0, pos[:, i] + TABLE) for i, t in enumerate(axes)], dim=1)


def prepare_qwenimage(model) -> None:
    """Install the packed processor and the modulation hooks on this model instance only
    (checked every call: a module whose processor was replaced since gets it again)."""
    seam.require_diffusers()
    seam.install([b.attn for b in model.transformer_blocks], PackedQwenAttnProcessor)
    for block in model.transformer_blocks:
        if not getattr(block, "_knapformer_hooked", False):
            block.register_forward_pre_hook(_note, with_kwargs=True)
            block.img_mod.register_forward_hook(seam.expand_rows)
            block.txt_mod.register_forward_hook(seam.expand_rows)
            block._knapformer_hooked = True
