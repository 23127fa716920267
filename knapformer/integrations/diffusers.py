"""Old name of :mod:`knapformer.integrations.flux` (the diffusers Flux integration), kept so
that code written against it keeps working; new code imports ``knapformer.integrations.flux``."""

from knapformer.integrations.flux import *  # noqa: F403
from knapformer.integrations.flux import __all__  # noqa: F401
