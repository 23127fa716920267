"""Backend and device detection (what an NCCL job sees), with the backend strings and the
errors monkeypatched on CPU: per-device backends, where control tensors live, ranks sharing
a GPU, and NCCL errors that are (not) a lost peer."""

import pytest
import torch
import torch.distributed as dist

import knapformer.distributed.backends as B
import knapformer.distributed.lifetime as lifetime
from knapformer.errors import PeerLostError
from knapformer.testing import run_distributed


@pytest.mark.parametrize(
    "config, backends, nccl, host",
    [
        ("cpu:gloo,cuda:nccl", {"cpu": "gloo", "cuda": "nccl"}, True, True),  # init_process_group() on GPUs
        ("cuda:nccl", {"cuda": "nccl"}, True, False),
        ("nccl", {"cuda": "nccl"}, True, False),
        ("cpu:gloo,cuda:gloo", {"cpu": "gloo", "cuda": "gloo"}, False, True),
        ("gloo", {"cpu": "gloo", "cuda": "gloo"}, False, True),
        ("cpu:gloo", {"cpu": "gloo"}, False, True),  # init_process_group() on a CPU-only torch
    ],
)
def test_backends_are_read_per_device_not_from_the_backend_name(monkeypatch, config, backends, nccl, host):
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: config)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "undefined")  # what torch >= 2.6 answers
    assert B.device_backends() == backends
    assert B.uses_nccl() is nccl and B.host_collectives() is host
    if host:
        assert B.control_device() == torch.device("cpu")


def test_an_nccl_only_group_keeps_control_tensors_on_its_bound_device(monkeypatch):
    class Group:
        bound_device_id = torch.device("cuda", 3)

    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cuda:nccl")
    assert B.control_device(Group()) == torch.device("cuda", 3)


def test_ranks_sharing_a_gpu_or_mixing_device_kinds_are_named():
    assert B.device_problem(["a/cuda:0", "a/cuda:1", "b/cuda:0"], nccl=True) == ""
    shared = B.device_problem(["a/cuda:0", "a/cuda:1", "a/cuda:0"], nccl=True)
    assert "ranks 0 and 2 both run on cuda:0 of host a" in shared and "set_device" in shared
    assert B.device_problem(["a/cuda:0", "a/cuda:0"], nccl=False) == ""  # gloo ranks may share a GPU
    assert "different kinds of device" in B.device_problem(["a/cpu", "a/cuda:0"], nccl=False)


class DistBackendError(RuntimeError):
    """Named like torch's: the old rule took every error of this type for a lost peer."""


@pytest.mark.parametrize(
    "text, lost",
    [
        ("NCCL error in: ProcessGroupNCCL.cpp:1984, unhandled cuda error, NCCL version 2.21.5", False),
        ("NCCL error in: ..., invalid usage (run with NCCL_DEBUG=WARN for details)", False),
        ("CUDA error: an illegal memory access was encountered", False),
        ("NCCL error: remote process exited or there was a network error", True),
        ("Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLTOALL) ran for 300000 ms", True),
        ("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:5912", True),
    ],
)
def test_only_a_lost_peer_is_reported_as_one(text, lost):
    out = lifetime._classified(DistBackendError(text), "pre_attn", None)
    assert isinstance(out, PeerLostError) is lost, (text, out)
    if not lost:
        assert str(out) == text  # the error as it is: no "restart from the last checkpoint"


def _shared_gpu(rank: int, world: int) -> str:
    """Both ranks claim cuda:0 of one host under NCCL: every rank raises, naming both."""
    import knapformer.distributed.balancer as balancer
    from knapformer import BalancerInputError, SequenceBalancer, WorkloadModel

    balancer.uses_nccl = lambda group: True
    bal = SequenceBalancer("g1n2", WorkloadModel(d_model=8))
    try:
        bal._check_devices(torch.device("cuda", 0))
    except BalancerInputError as exc:
        return str(exc)
    return "no error"


def test_ranks_on_one_gpu_raise_on_every_rank_before_any_exchange():
    msgs = run_distributed(_shared_gpu, 2, timeout=60)
    assert all("ranks 0 and 1 both run on cuda:0" in m for m in msgs), msgs
