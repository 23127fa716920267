"""Execution over torch.distributed: route specs, differentiable exchanges, the balancer.

Main API: :class:`SequenceBalancer`; lower level: :func:`build_route_spec` + ``ops``.
"""

from knapformer.distributed.balancer import SequenceBalancer
from knapformer.distributed.spec import RouteSpec, build_route_spec
from knapformer.errors import BalancerConfigError, BalancerInputError, DivergentCallError, PlanMismatchError

__all__ = [
    "BalancerConfigError",
    "BalancerInputError",
    "DivergentCallError",
    "PlanMismatchError",
    "RouteSpec",
    "SequenceBalancer",
    "build_route_spec",
]
