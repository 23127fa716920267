"""The executor contract every model and integration is written against.

Main API: :class:`TokenExecutor` (the protocol: route, reverse_route, attention,
pre_attn/post_attn, gather_sequences, routed_positions, route_context/cross_attention,
report_error/raise_everywhere), :class:`LocalExecutor` (one process, no balancing),
:class:`RoutedContext`, :class:`VarlenArgs` (``pre_attn``'s kernel arguments) and
:func:`local_positions`, :func:`present_sequences` (the samples with tokens here).
``knapformer.distributed.SequenceBalancer`` implements the protocol over torch.distributed;
models and integrations use only this package.
"""

from knapformer.executor.local import LocalExecutor, local_positions
from knapformer.executor.protocol import RoutedContext, TokenExecutor, VarlenArgs, present_sequences, routed_context

__all__ = [
    "LocalExecutor",
    "RoutedContext",
    "TokenExecutor",
    "VarlenArgs",
    "local_positions",
    "present_sequences",
    "routed_context",
]
