"""The family seam: what every packed model family shares, imported from one place.

A family file (``integrations/<name>.py``) says only what is its own — how a sample becomes
tokens and positions, which blocks attend how, its sizes — and takes the rest from here
(docs/extending.md walks through adding one). The seam gathers five modules:

- :mod:`~knapformer.integrations.packing`: samples as segments and streams, routed with their
  side features, attention in joint order, outputs home;
- :mod:`~knapformer.integrations.modulation`: AdaLN conditioning once per sample, expanded;
- :mod:`~knapformer.integrations.processors`: a packed processor on one model instance;
- :mod:`~knapformer.integrations.checks`: every sample checked, the problem raised on every rank;
- :mod:`~knapformer.integrations._diffusers` (outputs, block calls, small helpers) and
  :mod:`~knapformer.integrations.family` (the tools' adapter, :class:`PackedFamily`).

What every family built on it gets: the model's own modules and weights do all the math and
nothing is patched globally (processors and hooks are set on one model instance; stock calls
keep their behaviour); activations are "batch = tokens" (one token per batch row, so a
per-token modulation row is the stock per-sample broadcast); the packed metadata travels in
the blocks' own arguments, so blocks run as their own ``forward`` (FSDP2 per block) and
activation-checkpoint recompute sees it. Importing this module never imports diffusers.
"""

from knapformer.integrations import _diffusers, checks, family, modulation, packing, processors
from knapformer.integrations._diffusers import *  # noqa: F403 (the seam re-exports its modules' __all__)
from knapformer.integrations.checks import *  # noqa: F403
from knapformer.integrations.family import *  # noqa: F403
from knapformer.integrations.modulation import *  # noqa: F403
from knapformer.integrations.packing import *  # noqa: F403
from knapformer.integrations.processors import *  # noqa: F403

__all__ = sorted(
    {
        *_diffusers.__all__,
        *checks.__all__,
        *family.__all__,
        *modulation.__all__,
        *packing.__all__,
        *processors.__all__,
    }
)
