"""torch.compile as a supported path, on 2 gloo ranks (aot_eager backend: Dynamo and
AOTAutograd run the custom operators' fake and autograd kernels; the inductor backend is timed in
benchmarks/compile_speed.py)."""

from knapformer.testing import run_distributed
from tests import compile_workers as W


def test_a_block_calling_attention_compiles_fullgraph_dynamic_without_recompiles():
    res = run_distributed(W.compiled_block, 2, timeout=300)
    for r in res:
        assert r["out_err"] == 0.0 and r["grad_err"] == 0.0, r
        assert r["frames"][0] >= 1 and r["frames"][-1] == r["frames"][0], f"recompiled: {r['frames']}"


def test_a_block_whose_long_sequences_run_as_a_ring_compiles_and_equals_eager():
    """One head: auto runs the long sequences as a ring of 2 (K/V blocks exchanged inside the
    opaque attention operator, dK/dV in its backward); compiled == eager, no recompile."""
    res = run_distributed(W.compiled_block, 2, 1, timeout=300)
    for r in res:
        assert 2 in r["rings"], r["rings"]
        assert r["out_err"] <= 1e-12 and r["grad_err"] <= 1e-12, r
        assert r["frames"][-1] == r["frames"][0], f"recompiled: {r['frames']}"


def test_a_block_with_cross_attention_compiles_fullgraph_dynamic_without_recompiles():
    res = run_distributed(W.compiled_cross_block, 2, timeout=300)
    for r in res:
        assert r["out_err"] == 0.0 and r["grad_err"] == 0.0, r
        assert r["frames"][-1] == r["frames"][0], f"recompiled: {r['frames']}"


def test_a_whole_model_breaks_only_at_route_and_reverse():
    res = run_distributed(W.compiled_model, 2, timeout=300)
    for r in res:
        assert r["out_err"] == 0.0 and r["grad_err"] == 0.0, r
        assert len(r["reasons"]) == 2, r["reasons"]
        assert "SequenceBalancer.route " in r["reasons"][0] and "SequenceBalancer.reverse_route " in r["reasons"][1]


def test_the_opaque_operator_keeps_no_graph_without_gradients():
    """Inference (no_grad) through the operator: nothing is kept for a backward."""
    import torch

    from knapformer.executor import LocalExecutor, opaque

    ex = LocalExecutor([3, 5])
    q = torch.randn(8, 2, 4)

    @torch.compile(fullgraph=True, dynamic=True, backend="aot_eager")
    def f(q, ex):
        return ex.attention(q, q, q)

    with torch.no_grad():
        f(q, ex)
    assert len(opaque._GRAPHS) == 0
    qg = q.clone().requires_grad_()
    f(qg, ex).sum().backward()
    assert len(opaque._GRAPHS) == 0 and qg.grad is not None
    want = torch.autograd.grad(ex.attention(q.requires_grad_(), q, q).sum(), q)[0]
    assert torch.allclose(qg.grad, want, atol=1e-6)


def test_the_opaque_operator_keeps_a_graph_edge_not_the_output_and_is_cudagraph_unsafe():
    """What waits for the backward is the graph's edge, not a copy of the layer's output (the
    returned output is the computed one), and the operator tells reduce-overhead it cannot be
    captured in a CUDA graph."""
    import torch

    from knapformer.executor import LocalExecutor, opaque

    ex = LocalExecutor([3, 5])
    q = torch.randn(8, 2, 4, requires_grad=True)
    o, key = torch.ops.knapformer.attend(q, q, q, [], "local", ex._opaque, False, "auto", True)
    edge, inputs = opaque._GRAPHS[int(key)]
    assert isinstance(edge, torch.autograd.graph.GradientEdge) and not any(t is o for t in inputs)
    opaque._GRAPHS.pop(int(key))
    for op in (torch.ops.knapformer.attend.default, torch.ops.knapformer.attend_backward.default):
        assert torch.Tag.cudagraph_unsafe in op.tags


def test_compile_with_activation_checkpointing_keeps_no_graph_across_steps():
    """torchtitan's default: compiled blocks under non-reentrant checkpointing. The recompute
    in the backward runs the operator again under a new key, and the first forward's graph was
    kept until 4,096 of them piled up (3 per step here: 60 after 20 steps, each holding its
    layer's q, k, v and the attention's saved tensors). Now a graph lives as long as its key;
    none is left after each backward, both for a compiled model that checkpoints and for
    checkpointed compiled blocks, and the gradients equal the eager checkpointed ones (fp64)."""
    import torch
    from torch.utils.checkpoint import checkpoint

    from knapformer.executor import LocalExecutor, opaque

    ex = LocalExecutor([3, 5])
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4).double()

    def block(x):
        q = lin(x)
        return ex.attention(q, q, q) + x

    compiled_block = torch.compile(block, fullgraph=True, dynamic=True, backend="aot_eager")

    def stack(fn):
        def run(x):
            for _ in range(3):
                x = checkpoint(fn, x, use_reentrant=False)
            return x

        return run

    runs = {
        "eager": stack(block),
        "compiled model": torch.compile(stack(block), fullgraph=True, dynamic=True, backend="aot_eager"),
        "checkpointed compiled blocks": stack(compiled_block),
    }
    x0 = torch.randn(8, 2, 4, dtype=torch.float64)
    grads = {}
    for name, run in runs.items():
        opaque._GRAPHS.clear()
        for _ in range(20):
            lin.zero_grad()
            x = x0.clone().requires_grad_()
            run(x).sum().backward()
            assert len(opaque._GRAPHS) == 0, (name, len(opaque._GRAPHS))
        grads[name] = (x.grad, lin.weight.grad.clone())
    for name in ("compiled model", "checkpointed compiled blocks"):
        err = max((a - b).abs().max().item() for a, b in zip(grads[name], grads["eager"]))
        assert err < 1e-12, (name, err)
