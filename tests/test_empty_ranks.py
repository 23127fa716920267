"""A rank with no samples and inputs without autograd history (``torch.zeros(0, d)``, the
natural empty input) joins every backward exchange: attention, pre_attn, route_context and
gather_sequences, on 2 gloo ranks; a rank under no_grad raises everywhere.

No clock is read: a rank that skipped an exchange would leave the other waiting until the
process group's 45 s timeout raised there (the case fails), or the spawn's 120 s."""

import torch

from knapformer.testing import run_distributed
from tests import empty_rank_workers as W


def test_an_empty_rank_without_history_joins_every_backward_exchange():
    res = run_distributed(W.run, 2, timeout=120)
    for case in [k for k in res[0] if " " in k and not k.startswith(("reference", "no_grad"))]:
        assert res[0][case]["grads"] == res[1][case]["grads"]  # all-reduced: the same on both
    assert torch.allclose(torch.tensor(res[0]["attention "]["y"]), torch.tensor(res[0]["reference y"]), atol=1e-12)
    assert res[1]["attention "]["y"] == []
    for case in ("attention ", "pre_attn "):  # the qkv projection's gradients equal one process's
        for got, want in zip(res[0][case]["grads"][:2], res[0]["reference qkv grads"]):
            assert torch.allclose(torch.tensor(got), torch.tensor(want), atol=1e-10), case
    for r in res:
        assert "some ranks run it under torch.no_grad()" in r["no_grad"], r["no_grad"]
