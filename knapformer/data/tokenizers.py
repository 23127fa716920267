"""Latent tokens of a sample from its pixels: the tokenizer presets (pure numpy).

A diffusion transformer sees a sample as the patches of its VAE latent (plus, for joint
attention, its text tokens). A :class:`Tokenizer` names how one family makes them:

- **VAE**: ``spatial`` pixels per latent pixel along each side; ``temporal`` frames per
  latent frame of a *causal* video VAE, which keeps the first frame alone: ``f`` frames become
  ``(f - 1) // temporal + 1`` latent frames (an image, f = 1, is one latent frame);
- **patches** ``(t, h, w)`` of latent frames × rows × columns per token (a side that does not
  divide is cut down: pipelines crop or resize to a multiple of ``spatial × patch``);
- **frame rate**: with ``fps`` set, a clip recorded at another rate is resampled to it first
  (``1 + (f - 1) · fps / source_fps`` frames, rounded down), as trainers do;
- **text**: ``"joint"`` — the text tokens join the sequence (Flux: one packed sequence of text
  and image tokens); ``"cross"`` — the text is cross-attention context (Wan), priced through
  :class:`~knapformer.workload.WorkloadModel`'s ``context_len`` (the manifest's mean text
  length, :meth:`Tokenizer.context_len`), not in the sequence length.

:data:`TOKENIZERS` holds one preset per integrated model family (the keys are the names in
:mod:`knapformer.integrations.registry`, so ``--model diffusers-wan-14b`` finds ``diffusers-wan``)
plus short aliases. Adding a family's tokenizer is one entry there.

Legend: ``n`` samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["TOKENIZERS", "Tokenizer", "tokenizer", "tokenizer_for_model"]


@dataclass(frozen=True, kw_only=True)
class Tokenizer:
    """How one model family turns pixels into sequence tokens (module docstring)."""

    name: str
    spatial: int
    """Pixels per latent pixel along each side (8 for the Flux and Wan VAEs)."""
    temporal: int
    """Frames per latent frame of the (causal) video VAE; 1 = every frame its own latent frame."""
    patch: tuple[int, int, int]
    """(latent frames, rows, columns) per token."""
    text: str
    """``"joint"`` (text tokens are part of the sequence) or ``"cross"`` (cross-attention context)."""
    fps: int | None = None
    """Frame rate clips are resampled to before encoding; None = as recorded."""

    def __post_init__(self) -> None:
        for name in ("spatial", "temporal"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"Tokenizer {self.name!r}: {name} must be an int >= 1, got {v!r}")
        if len(self.patch) != 3 or any(not isinstance(p, int) or isinstance(p, bool) or p < 1 for p in self.patch):
            raise ValueError(f"Tokenizer {self.name!r}: patch must be three ints >= 1, got {self.patch!r}")
        if self.text not in ("joint", "cross"):
            raise ValueError(f"Tokenizer {self.name!r}: text must be 'joint' or 'cross', got {self.text!r}")
        if self.fps is not None and (not isinstance(self.fps, int) or isinstance(self.fps, bool) or self.fps < 1):
            raise ValueError(f"Tokenizer {self.name!r}: fps must be an int >= 1 or None, got {self.fps!r}")

    def frames_used(self, frames, fps=None) -> np.ndarray:
        """(n,) frames each sample keeps after resampling to :attr:`fps` (a source rate of 0 or
        missing, or at or below the target, keeps them all)."""
        f = np.asarray(frames, dtype=np.int64)
        if self.fps is None or fps is None:
            return f
        src = np.asarray(fps, dtype=np.float64)
        faster = src > self.fps
        kept = 1 + np.floor((f - 1) * self.fps / np.where(faster, src, 1.0)).astype(np.int64)
        return np.where(faster & (f > 1), kept, f)

    def latent_grid(self, width, height, frames, fps=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(n,) each ×3: tokens along time, rows and columns (the bucket a trainer groups by)."""
        f = self.frames_used(frames, fps)
        pt, ph, pw = self.patch
        t = ((f - 1) // self.temporal + 1) // pt
        h = np.asarray(height, dtype=np.int64) // self.spatial // ph
        w = np.asarray(width, dtype=np.int64) // self.spatial // pw
        return t, h, w

    def visual_tokens(self, width, height, frames, fps=None) -> np.ndarray:
        """(n,) latent patches per sample (at least one: a sample below one patch is padded to it)."""
        t, h, w = self.latent_grid(width, height, frames, fps)
        return np.maximum(t * h * w, 1)

    def seq_lens(self, width, height, frames, text_tokens, fps=None) -> np.ndarray:
        """(n,) sequence lengths: the visual tokens, plus the text tokens when text is joint."""
        vis = self.visual_tokens(width, height, frames, fps)
        return vis + np.asarray(text_tokens, dtype=np.int64) if self.text == "joint" else vis

    def context_len(self, text_tokens) -> int:
        """Context tokens per sequence for the cost model: the mean text length (rounded) when
        the text is cross-attention context, else 0 (joint text is in the sequence)."""
        t = np.asarray(text_tokens, dtype=np.float64)
        return int(round(float(t.mean()))) if self.text == "cross" and t.size else 0


_FLUX = dict(spatial=8, temporal=4, patch=(1, 2, 2), text="joint")
"""Flux-style MMDiTs: an 8× VAE, 2×2 patches (16×16 pixels per token), text in the sequence.
Their own VAE is an image VAE; a clip (frames > 1) is taken as encoded by a causal 4× video
VAE, as the joint image + video MMDiT training of the KnapFormer paper does."""

TOKENIZERS: dict[str, Tokenizer] = {
    "diffusers-flux": Tokenizer(name="diffusers-flux", **_FLUX),
    "diffusers-flux2": Tokenizer(name="diffusers-flux2", **_FLUX),
    "torchtitan-flux": Tokenizer(name="torchtitan-flux", **_FLUX),
    "diffusers-wan": Tokenizer(name="diffusers-wan", spatial=8, temporal=4, patch=(1, 2, 2), text="cross", fps=16),
    "diffusers-qwenimage": Tokenizer(name="diffusers-qwenimage", **_FLUX),
    "diffusers-sd3": Tokenizer(name="diffusers-sd3", **_FLUX),
    "diffusers-hunyuanvideo15": Tokenizer(
        name="diffusers-hunyuanvideo15", spatial=16, temporal=4, patch=(1, 1, 1), text="joint"
    ),
}
"""One preset per integrated model family (registry names), see the module docstring. Wan's VAE
compresses 4×8×8 with 1×2×2 patches, trains at 16 fps and cross-attends to its text.
Qwen-Image and SD3: an 8× VAE and 2×2 patches, their text in the sequence (as Flux). HunyuanVideo 1.5:
a causal VAE of 4× in time and 16× in space, 1×1×1 patches, its text in the sequence (the
model's byT5 and image tokens are left out of the count)."""

_ALIASES = {"flux": "diffusers-flux", "flux2": "diffusers-flux2", "wan": "diffusers-wan"}


def tokenizer(name: str) -> Tokenizer:
    """A preset of :data:`TOKENIZERS` (or an alias: ``flux``, ``flux2``, ``wan``); the error
    lists them."""
    key = _ALIASES.get(name, name)
    if key not in TOKENIZERS:
        raise ValueError(f"unknown tokenizer {name!r}; choose one of {sorted(TOKENIZERS) + sorted(_ALIASES)}")
    return TOKENIZERS[key]


def tokenizer_for_model(model: str) -> Tokenizer | None:
    """The preset of a ``--model`` name: its family's (``diffusers-wan-14b`` → ``diffusers-wan``,
    the longest matching family name), the reference ``flux`` preset's Flux tokens, else None."""
    if model in TOKENIZERS:
        return TOKENIZERS[model]
    if model in _ALIASES:
        return tokenizer(model)
    for family in sorted(TOKENIZERS, key=len, reverse=True):
        if model.startswith(family + "-"):
            return TOKENIZERS[family]
    if model.startswith(("flux", "mmdit")):  # the reference MMDiT presets: Flux-style joint text
        return TOKENIZERS["diffusers-flux"]
    return None
