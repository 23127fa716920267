import os

from hypothesis import HealthCheck, settings

# CI runs the property tests harder (HYPOTHESIS_PROFILE=ci from .ci/run).
settings.register_profile("ci", max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

# the forkserver the multi-rank tests fork from also imports diffusers once, if installed
import importlib.util  # noqa: E402

from knapformer.testing import dist as _dist  # noqa: E402

if importlib.util.find_spec("diffusers") is not None:
    _dist.PRELOAD.append("diffusers")
