"""Execution over torch.distributed: route specs, differentiable exchanges, the balancer.

Main API: :class:`SequenceBalancer`; lower level: :func:`build_route_spec` + ``ops``.
"""

from knapformer.dist.balancer import BalancerInputError, SequenceBalancer
from knapformer.dist.spec import RouteSpec, build_route_spec

__all__ = ["BalancerInputError", "RouteSpec", "SequenceBalancer", "build_route_spec"]
