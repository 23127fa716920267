"""Every model family the tools can run, by name: one line each (torch-free table).

Adding a model is one file — ``integrations/<name>.py`` with the packed forward and a
:class:`~knapformer.integrations.family.ModelFamily` adapter whose ``presets`` give its sizes —
and one line in :data:`FAMILIES` below. The tools (``simulate``, ``calibrate``) resolve a
``--model`` through :func:`resolve_model` only:

- a reference preset by its name (``mmdit-small``, ``flux``, ...);
- ``<family>-<size>`` for an integration's preset (``diffusers-wan-tiny``: family
  ``diffusers-wan``, size ``tiny``);
- ``package.module:callable``: your own factory, called with no arguments, returning a
  ``ModelFamily`` bound to its config.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from knapformer.model_configs import PRESETS as REFERENCE_PRESETS

if TYPE_CHECKING:
    from knapformer.integrations.family import ModelFamily

__all__ = ["CONFIGS", "FAMILIES", "family_class", "family_sizes", "model_config", "preset_names", "resolve_model"]

FAMILIES: dict[str, str] = {
    "reference": "knapformer.integrations.reference:ReferenceFamily",
    "diffusers-flux": "knapformer.integrations.flux:FluxFamily",
    "diffusers-flux2": "knapformer.integrations.flux2:Flux2Family",
    "diffusers-wan": "knapformer.integrations.wan:WanFamily",
    "diffusers-qwenimage": "knapformer.integrations.qwenimage:QwenImageFamily",
    "diffusers-hunyuanvideo15": "knapformer.integrations.hunyuanvideo15:HunyuanVideo15Family",
    "diffusers-sd3": "knapformer.integrations.sd3:SD3Family",
    "torchtitan-flux": "knapformer.integrations.torchtitan_flux:TitanFluxFamily",
}
"""Family name -> ``module:class`` of its adapter (imported when the family is asked for)."""

CONFIGS: dict[str, str] = {
    "diffusers-flux": "knapformer.integrations.configs:FLUX_PRESETS",
    "diffusers-flux2": "knapformer.integrations.configs:FLUX2_PRESETS",
    "diffusers-wan": "knapformer.integrations.configs:WAN_PRESETS",
    "diffusers-qwenimage": "knapformer.integrations.configs_dit:QWENIMAGE_PRESETS",
    "diffusers-hunyuanvideo15": "knapformer.integrations.configs_dit:HUNYUANVIDEO15_PRESETS",
    "diffusers-sd3": "knapformer.integrations.configs_dit:SD3_PRESETS",
    "torchtitan-flux": "knapformer.integrations.configs:TITAN_FLUX_PRESETS",
}
"""Optional, per family: ``module:name`` of a torch-free table of its sizes (the adapter's
``presets``), so that :func:`model_config` and :func:`family_sizes` need not import torch or
the model's library. A family without an entry is read from its adapter (importing it)."""


def _load(target: str, what: str) -> Any:
    module, sep, attr = target.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"{what} {target!r} must look like 'package.module:name'")
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        raise ValueError(f"{what} {target!r}: cannot import {module!r} ({exc})") from exc
    try:
        return getattr(mod, attr)
    except AttributeError:
        raise ValueError(f"{what} {target!r}: module {module!r} has no {attr!r}") from None


def family_class(name: str) -> type[ModelFamily]:
    """The adapter class of the family registered as ``name``."""
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r}; choose one of {sorted(FAMILIES)}")
    return _load(FAMILIES[name], "model family")


def resolve_model(spec: str) -> ModelFamily:
    """The family adapter, bound to its config, of a ``--model`` value (module docstring)."""
    from knapformer.integrations.family import ModelFamily

    if not isinstance(spec, str) or not spec:
        raise ValueError(f"a model must be named by a string, got {spec!r}")
    if ":" in spec:
        factory = _load(spec, "model factory")
        family = factory() if callable(factory) else factory
        if not isinstance(family, ModelFamily):
            raise ValueError(
                f"model factory {spec!r} returned {type(family).__name__}; it must return a "
                "knapformer.integrations.family.ModelFamily bound to its config"
            )
        return family
    if spec in REFERENCE_PRESETS:
        return family_class("reference")(REFERENCE_PRESETS[spec])
    for name in sorted(FAMILIES, key=len, reverse=True):
        if name != "reference" and spec.startswith(name + "-"):
            cls, size = family_class(name), spec[len(name) + 1 :]
            if size in cls.presets:
                return cls(cls.presets[size]())
    raise ValueError(f"unknown model preset {spec!r}; choose one of {preset_names()} or a 'module:callable' factory")


def family_sizes(name: str) -> dict[str, Any]:
    """The size table (size name -> config factory) of the family registered as ``name``:
    torch-free where :data:`CONFIGS` names one, else the adapter's ``presets``."""
    if name == "reference":
        return {size: (lambda cfg=cfg: cfg) for size, cfg in REFERENCE_PRESETS.items()}
    if name in CONFIGS:
        return _load(CONFIGS[name], "size table")
    return family_class(name).presets


def model_config(spec: str) -> Any:
    """The config of a ``--model`` value: torch-free for the reference presets and the families
    with a size table in :data:`CONFIGS`; a factory or another family's preset through its
    adapter."""
    if spec in REFERENCE_PRESETS:
        return REFERENCE_PRESETS[spec]
    if isinstance(spec, str) and ":" not in spec:
        for name in sorted(CONFIGS, key=len, reverse=True):
            if spec.startswith(name + "-"):
                table, size = family_sizes(name), spec[len(name) + 1 :]
                if size in table:
                    return table[size]()
    return resolve_model(spec).config


def preset_names() -> list[str]:
    """Every preset name (imports each family's module: for listings and error messages)."""
    names = list(REFERENCE_PRESETS)
    for name in FAMILIES:
        if name != "reference":
            try:
                names += [f"{name}-{size}" for size in family_sizes(name)]
            except ValueError:  # a family whose module cannot be imported here
                continue
    return sorted(names)
