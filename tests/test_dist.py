"""Multi-rank tests on real gloo processes (CPU): exactness and robustness of the balancer."""

import os

import pytest

from knapformer.testing import run_distributed
from tests import dist_workers as W


@pytest.mark.parametrize(
    "world, layout, seed",
    [
        (2, "g1n2", 0),
        (2, "g2n1", 1),
        (4, "g1n2+g2n1", 2),
        (4, "g4n1", 3),
        (4, "g1n4", 4),
        (4, "g2n1", 5),  # two replicas of a 2-rank bag
    ],
)
def test_balanced_math_equals_unbalanced(world, layout, seed):
    """Round trips are bit-exact for every dtype; attention and gradients match one process."""
    results = run_distributed(W.check_exactness, world, layout, seed, timeout=180)
    assert len(results) == world


@pytest.mark.parametrize("world", [2, 4])
def test_bad_input_raises_on_every_rank(world):
    """Every robustness case raises a clear error on all ranks; none hangs."""
    msgs = run_distributed(W.check_robustness, world, timeout=120)
    assert all(len(m) == 5 for m in msgs)


def test_non_contiguous_groups_changing_every_step():
    """Bags like (2, 0) and (3, 1), different each step, run over the one group communicator."""
    res = run_distributed(W.check_arbitrary_groups, 4, 11, timeout=180)
    assert res[0][0] == ((2, 0), (3, 1))


def test_permute_rows_forward_and_gradient():
    """The packed-buffer permutation gathers in both directions; its gradient must equal
    autograd's index_select gradient (a wrong inverse would scramble rows)."""
    import torch

    from knapformer.distributed.ops import permute_rows

    g = torch.Generator().manual_seed(0)
    index = torch.randperm(7, generator=g)
    inverse = torch.argsort(index)
    x = torch.randn(7, 3, dtype=torch.float64, requires_grad=True, generator=g)
    w = torch.randn(7, 3, dtype=torch.float64, generator=g)
    (permute_rows(x, index, inverse) * w).sum().backward()
    ours = x.grad.clone()
    x.grad = None
    (x.index_select(0, index) * w).sum().backward()
    assert torch.equal(permute_rows(x, index, inverse), x[index])
    assert torch.equal(ours, x.grad)
    assert torch.autograd.gradcheck(lambda t: permute_rows(t, index, inverse), (x,))


@pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2, reason="needs CPU affinity and 2 cores"
)
def test_pin_to_core_pins_every_thread_of_each_rank():
    out = run_distributed(W.check_pinning, 2, timeout=60)
    cores = [o["core"] for o in out]
    assert len(set(cores)) == 2
    for o in out:
        assert len(o["threads"]) > 1  # gloo's threads exist and were pinned too
        assert all(t == [o["core"]] for t in o["threads"])
