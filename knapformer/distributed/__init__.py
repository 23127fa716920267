"""Execution over torch.distributed: route specs, differentiable exchanges, the balancer.

Main API: :class:`SequenceBalancer`; lower level: :func:`build_route_spec` + ``ops``.
"""

from knapformer.distributed.balancer import SequenceBalancer
from knapformer.distributed.errors import BalancerConfigError, BalancerInputError, PlanMismatchError
from knapformer.distributed.spec import RouteSpec, build_route_spec

__all__ = [
    "BalancerConfigError",
    "BalancerInputError",
    "PlanMismatchError",
    "RouteSpec",
    "SequenceBalancer",
    "build_route_spec",
]
