"""Flags of ``knapformer calibrate`` (torch-free, so the CLI can list them without torch)."""

from __future__ import annotations

import argparse

from knapformer.tools.cli_support import positive_int

__all__ = ["add_args"]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="model preset (mmdit-tiny, mmdit-small, transformer-tiny, flux)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--mode", default="fwd+bwd", choices=["fwd", "fwd+bwd"], help="what to time")
    p.add_argument("--causal", action="store_true", help="causal attention (transformer presets)")
    p.add_argument("--lengths", type=int, nargs="+", default=None, help="fit lengths (single sequences)")
    p.add_argument("--holdout", type=int, nargs="+", default=None, help="held-out lengths (never fitted)")
    p.add_argument("--repeats", type=positive_int, default=7, help="timed rounds over all batches (median per batch)")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls of each batch before timing")
    p.add_argument("--output", required=True, help="profile JSON to write")
    p.add_argument("--plot", default=None, help="PNG of measured vs predicted")
    p.add_argument("--report", default=None, help="JSON with every timing and error")
    p.add_argument("--no-progress", "--quiet", action="store_true", help="no progress bar")
