"""Every named model the tools can run: the reference presets plus the integrations' presets
(torch-free: an integration's module is imported only when one of its presets is asked for)."""

from __future__ import annotations

import importlib
from typing import Any

from knapformer.model_configs import PRESETS as REFERENCE_PRESETS

__all__ = ["preset", "preset_names"]

_INTEGRATION_PRESETS: dict[str, tuple[str, str]] = {
    "diffusers-flux-tiny": ("knapformer.integrations.diffusers", "DiffusersFluxConfig"),
    "diffusers-wan-tiny": ("knapformer.integrations.wan", "DiffusersWanConfig"),
}
"""name -> (module, config class); the class's defaults are the preset."""


def preset_names() -> list[str]:
    return sorted([*REFERENCE_PRESETS, *_INTEGRATION_PRESETS])


def preset(name: str) -> Any:
    """The config of a named model; unknown names list the known ones."""
    if name in REFERENCE_PRESETS:
        return REFERENCE_PRESETS[name]
    if name in _INTEGRATION_PRESETS:
        module, cls = _INTEGRATION_PRESETS[name]
        return getattr(importlib.import_module(module), cls)()
    raise ValueError(f"unknown model preset {name!r}; choose one of {preset_names()}")
