"""knapformer's flash-attn paths on a CPU stand-in that enforces flash-attn 2's argument rules
(``flash2_rules``): the rules themselves, flash-attn ≥ 2.7's custom-op backward, empty ranks,
and the group, GQA, ring and failure suites run through it (fp32 standing for the cast)."""

import pytest
import torch

from knapformer.attention import lse
from knapformer.executor import LocalExecutor
from knapformer.testing import reference_attention, run_distributed
from knapformer.testing.flash_rules import check_varlen, fake_flash_attn
from tests import group_workers as G
from tests import schedule_workers as S


def _args(lens=(3, 5), h=4, h_kv=2, d=8, dtype=torch.float32):
    n = sum(lens)
    q, k, v = (torch.randn(n, x, d, dtype=dtype) for x in (h, h_kv, h_kv))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu, cu, max(lens, default=0), max(lens, default=0)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: (*a[:3], a[3][:1], a[3][:1], 0, 0), "batch size must be positive"),
        (lambda a: (*a[:3], a[3].long(), a[4], *a[5:]), "must have dtype int32"),
        (lambda a: (*a[:5], 4, a[6]), "max_seqlen 4 < a sequence of 5"),
        (lambda a: tuple(t.double() if i < 3 else t for i, t in enumerate(a)), "must be fp16 or bf16"),
        (lambda a: (a[0], a[1], a[2][:, :, :4], *a[3:]), "one head dim"),
        (lambda a: (a[0].transpose(1, 2).contiguous().transpose(1, 2), *a[1:]), "contiguous last dimension"),
    ],
)
def test_the_stand_in_refuses_what_flash_attn_2_refuses(change, message):
    with pytest.raises(RuntimeError, match=message):
        check_varlen(*change(_args()))


def test_one_empty_segment_is_a_legal_call_and_gives_zeros():
    q, k, v, *_ = _args(lens=())
    cu = torch.zeros(2, dtype=torch.int32)
    assert fake_flash_attn.flash_attn_varlen_func(q, k, v, cu, cu, 0, 0).shape == (0, 4, 8)


def test_flash_attn_2_7_custom_op_backward_is_called_by_its_real_parameters():
    """flash-attn ≥ 2.7's ``_flash_attn_backward`` is a torch.library custom op whose Python
    signature reads (*args, **kwargs): the block kernel's probe must still pass on it."""
    bw = fake_flash_attn.flash_attn_interface._flash_attn_backward
    assert lse.parameter_names(bw)[:6] == ["dout", "q", "k", "v", "out", "softmax_lse"]
    for gqa in (False, True):
        assert lse._compare("flash2_rules", "cpu", torch.float32, 16, 16, gqa) is None


def test_the_local_executor_runs_flash_on_empty_and_full_batches():
    for lens in ([], [3, 1, 6]):
        ex = LocalExecutor(lens, attn_backend="flash2_rules")
        q, k, v, *_ = _args(lens=tuple(lens))
        q.requires_grad_()
        out = ex.attention(q, k, v, causal=True)
        ref = reference_attention(q.double(), k.double(), v.double(), lens, causal=True)
        assert torch.allclose(out.double(), ref, atol=2e-6)
        args = ex.pre_attn(q, k, v)
        assert ex.post_attn(fake_flash_attn.flash_attn_varlen_func(*args, causal=True)).shape == out.shape
        out.sum().backward()


@pytest.mark.parametrize("world", [2, 4])
def test_group_gqa_ring_and_empty_rank_suites_through_flash_rules(world):
    seen = run_distributed(G.check_flash_rules, world, 5, timeout=300)
    assert any(s["idle_rank"] for s in seen) and all(s["rings"] == 2 for s in seen), seen


def test_failure_suite_through_flash_rules():
    res = run_distributed(S.steady_state, 2, "flash2_rules", torch.float32, timeout=240)
    for case, (kind, texts) in S.expected_errors().items():
        for r in res:
            step, (name, msg) = r[case]
            assert step == ("ok", ""), (case, step)  # the step finishes; the next plan raises
            assert name == kind.__name__, (case, msg)
            assert all(t.format(last=1) in msg for t in texts), (case, msg)
    assert all(r["attention after"] and r["pre_attn after"] for r in res)
