"""Data codes: compact descriptions of heterogeneous per-rank batches (pure numpy).

A code ``g{G}b{B}i{R}f{F}s{S}`` means G ranks, each with B samples of R×R pixels and F frames.
Visual tokens per frame are ⌊R/16⌋² (an 8× VAE and 2×2 patches); a sample has F latent frames
when S=0 and max(⌊F/3.4⌋, 1) when S=1 (temporal compression). Each sample adds U{0..392}
text tokens, and visual lengths are jittered by one U(0.96, 1.04) factor per rank. Codes join
with commas; the ranks they describe are laid out in order.

``scale`` (a resolution divisor, CPU demos) divides R by ``scale`` and text lengths by
``scale²`` so that visual/text proportions keep their shape at 1/scale² of the tokens.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

__all__ = ["DataCode", "MIXES", "parse_codes", "resolve_mix", "sample_seq_lens"]

_CODE = re.compile(r"^g(\d+)b(\d+)i(\d+)f(\d+)s([01])$")
TEXT_MAX = 392

MIXES: dict[str, str] = {
    "paper-lowres": "g32b32i256f1s0",
    "paper-mixres": "g16b4i256f1s0,g4b5i512f1s0,g4b5i1024f1s0,g8b1i2048f1s0",
    "paper-joint": (
        "g8b4i256f1s0,g2b5i512f1s0,g2b5i1024f1s0,g4b1i2048f1s0,g1b10i256f4s0,g3b1i512f4s0,g8b2i256f85s1,g4b1i512f85s1"
    ),
}
"""The paper's three data mixes (32 ranks each)."""


@dataclass(frozen=True)
class DataCode:
    """One ``g{G}b{B}i{R}f{F}s{S}`` term."""

    ranks: int
    samples: int
    resolution: int
    frames: int
    temporal: int

    def visual_tokens(self, scale: int = 1) -> int:
        """Visual tokens of one sample before jitter."""
        per_frame = (self.resolution // scale // 16) ** 2
        frames = self.frames if self.temporal == 0 else max(int(self.frames / 3.4), 1)
        return max(per_frame * frames, 1)


def parse_codes(text: str) -> list[DataCode]:
    """Parse comma-joined codes; errors name the malformed term."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError("data code is empty; expected e.g. 'g8b4i256f1s0'")
    out = []
    for raw in text.replace(" ", "").split(","):
        m = _CODE.match(raw)
        if m is None:
            raise ValueError(f"malformed data code {raw!r}; expected g<ranks>b<samples>i<res>f<frames>s<0|1>")
        g, b, r, f, s = (int(x) for x in m.groups())
        if min(g, b, r, f) <= 0:
            raise ValueError(f"data code {raw!r}: ranks, samples, resolution and frames must be >= 1")
        out.append(DataCode(g, b, r, f, s))
    return out


def resolve_mix(name_or_codes: str) -> list[DataCode]:
    """A mix name from :data:`MIXES` or literal codes."""
    return parse_codes(MIXES.get(name_or_codes, name_or_codes))


def mix_num_ranks(codes: list[DataCode]) -> int:
    """The number of ranks a mix describes (the sum of its codes' rank counts)."""
    return sum(c.ranks for c in codes)


def sample_batches(
    codes: list[DataCode], *, seed: int = 0, step: int = 0, scale: int = 1, num_ranks: int | None = None
) -> list[list[tuple[int, int]]]:
    """Per rank, per sample: ``(visual tokens, text tokens)``. Deterministic per (seed, rank, step).

    ``num_ranks`` may be a multiple of the mix's rank count: the mix is tiled (each tile
    drawing its own random numbers)."""
    if not isinstance(scale, int) or scale < 1:
        raise ValueError(f"scale must be an int >= 1, got {scale!r}")
    base = mix_num_ranks(codes)
    num_ranks = base if num_ranks is None else num_ranks
    if num_ranks <= 0 or num_ranks % base:
        raise ValueError(f"the mix describes {base} ranks; {num_ranks} ranks is not a multiple of it")
    rank_code = [c for c in codes for _ in range(c.ranks)] * (num_ranks // base)
    out = []
    for rank, code in enumerate(rank_code):
        rng = np.random.default_rng([seed, rank, step])
        jitter = rng.uniform(0.96, 1.04)
        vis = max(int(code.visual_tokens(scale) * jitter), 1)
        text = rng.integers(0, TEXT_MAX // (scale * scale) + 1, size=code.samples)
        out.append([(vis, int(t)) for t in text])
    return out


def sample_seq_lens(
    mix: str, *, seed: int = 0, step: int = 0, scale: int = 1, num_ranks: int | None = None
) -> list[list[int]]:
    """Total sequence lengths per rank for a named mix or literal codes."""
    batches = sample_batches(resolve_mix(mix), seed=seed, step=step, scale=scale, num_ranks=num_ranks)
    return [[v + t for v, t in rank] for rank in batches]
