"""The defaults a new family inherits from ``PackedFamily`` (docs/extending.md)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from knapformer.integrations.family import PackedFamily


def test_target_rows_reads_token_rows_and_refuses_video_latents():
    """``(rows, channels)`` latents give their rows; a video's ``(C, F, H, W)`` latents used to
    give C (the channel count) silently — now a clear error naming the override (issue 59, item 13)."""
    family = SimpleNamespace(name="ltx-like")
    images = [SimpleNamespace(latents=torch.zeros(256, 64)), SimpleNamespace(latents=torch.zeros(1024, 64))]
    assert PackedFamily.target_rows(family, images) == [256, 1024]
    video = [SimpleNamespace(latents=torch.zeros(16, 5, 8, 8))]
    with pytest.raises(TypeError, match=r"ltx-like.*\(16, 5, 8, 8\).*override target_rows"):
        PackedFamily.target_rows(family, video)
