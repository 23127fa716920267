"""Reference models: packing is exact in one process, and balanced training equals the
unbalanced computation (outputs and every parameter gradient) on 2 and 4 gloo ranks."""

import torch

from knapformer.models import LocalExecutor, MMDiT, Transformer, preset
from knapformer.testing import run_distributed
from tests import model_workers as W


def test_packed_mmdit_equals_per_sample_forward():
    torch.manual_seed(0)
    cfg = preset("mmdit-tiny")
    m = MMDiT(cfg).double()
    lens, txt = [12, 30, 7], torch.tensor([5, 0, 7])
    x = torch.randn(sum(lens), cfg.in_dim, dtype=torch.float64)
    t, vec = torch.rand(3, dtype=torch.float64), torch.randn(3, cfg.vec_dim, dtype=torch.float64)
    out = m(x, lens, txt, t, vec)
    singles, s = [], 0
    for i, n in enumerate(lens):
        singles.append(m(x[s : s + n], [n], txt[i : i + 1], t[i : i + 1], vec[i : i + 1]))
        s += n
    assert (out - torch.cat(singles)).abs().max().item() < 1e-12
    out.sum().backward()
    assert all(p.grad is not None for p in m.parameters())


def test_text_weights_touch_only_text_tokens():
    """The text stream's weights act on text tokens only: an image-only sequence ignores them."""
    torch.manual_seed(0)
    cfg = preset("mmdit-tiny")
    m = MMDiT(cfg).double()
    lens, txt = [10, 10], torch.tensor([4, 0])
    x = torch.randn(20, cfg.in_dim, dtype=torch.float64)
    t, vec = torch.rand(2, dtype=torch.float64), torch.randn(2, cfg.vec_dim, dtype=torch.float64)
    before = m(x, lens, txt, t, vec)
    with torch.no_grad():
        for mod in (m.txt_in, m.double_blocks[0].txt.qkv):
            mod.weight.add_(0.5)
    after = m(x, lens, txt, t, vec)
    assert torch.equal(before[10:], after[10:])  # image-only sequence untouched
    assert (before[:10] - after[:10]).abs().max() > 1e-3


def test_transformer_causal_and_local_executor():
    torch.manual_seed(0)
    cfg = preset("transformer-tiny")
    m = Transformer(cfg)
    x = torch.randn(20, cfg.in_dim)
    assert torch.equal(m(x, [5, 15]), m(x, [5, 15], executor=LocalExecutor([5, 15])))


# rank 0 of the g2n1 case holds only text after routing (its chunk is tokens 0-19 of a
# sequence with 30 text tokens); in the g4n1 case ranks 0-1 get only text, rank 3 only image
CASES_2 = [
    ("mmdit", "g2n1", [[40], []], [[30], []], "none"),
    ("mmdit", "g1n2", [[3, 50, 9], [8]], [[3, 10, 0], [0]], "none"),
    ("transformer", "g2n1", [[1, 33], [5]], [[0, 0], [0]], "none"),
    ("mmdit", "g2n1", [[40, 6], [12]], [[30, 2], [4]], "ckpt+fsdp"),
    ("transformer-mqa", "g2n1", [[31, 4], [9]], [[0, 0], [0]], "none"),  # one kv head, 2-rank groups
]
CASES_4 = [
    ("mmdit", "g4n1", [[64], [], [3], []], [[40], [], [1], []], "none"),
    ("mmdit", "g1n2+g2n1", [[30, 2], [44], [], [7, 7]], [[25, 1], [4], [], [0, 7]], "ckpt"),
    ("transformer", "g1n4", [[60, 2], [1], [], [9]], [[0, 0], [0], [], [0]], "none"),
    ("mmdit", "g2n2", [[50], [3, 3], [20], []], [[10], [3, 0], [5], []], "ckpt+fsdp"),
    ("transformer-gqa", "g4n1", [[60, 2], [1], [], [9]], [[0, 0], [0], [], [0]], "none"),  # kv heads replicated
    ("transformer-gqa", "g1n2+g2n1", [[20], [7, 3], [], [40]], [[0], [0, 0], [], [0]], "ckpt"),
]


def test_balanced_models_equal_unbalanced_on_2_ranks():
    res = run_distributed(W.check_many, 2, CASES_2, timeout=240)
    assert res[0][0]["image"] == 0 and res[0][0]["text"] > 0  # a rank with text tokens only


def test_balanced_models_equal_unbalanced_on_4_ranks():
    res = run_distributed(W.check_many, 4, CASES_4, timeout=300)
    assert res[0][0]["image"] == 0 and res[3][0]["text"] == 0  # text-only and image-only ranks
