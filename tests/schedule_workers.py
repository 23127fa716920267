"""Workers for the calls without a rendezvous: from the second step of a kind on, every call
after ``route`` (``attention``/``pre_attn``/``post_attn``, ``reverse_route``) makes only the
plan's data exchanges, and a bad or divergent call on one rank still ends with a clear error on
every rank — the step finishes (its exchanges on zeros where a rank's call was bad) and every
rank raises at the next ``plan`` — with no hang."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.utils.checkpoint as ckpt

from knapformer import BalancerInputError, DivergentCallError, SequenceBalancer, WorkloadModel
from knapformer.attention import varlen_attention_qk
from knapformer.plan import plan_from_groups
from knapformer.testing.flash_rules import fake_flash_attn

H, D, LAYERS = 4, 8, 4
MODEL = WorkloadModel(d_model=H * D, num_heads=H)
DTYPE = [torch.float64]
BACKEND = ["auto"]
"""The dtype and attention backend of every case (:func:`steady_state` sets them)."""
RENDEZVOUS = ("all_reduce", "all_gather", "all_gather_into_tensor", "barrier", "broadcast", "reduce_scatter_tensor")


class Counter:
    """Counts the whole-group collectives (not the data exchanges) this process makes."""

    def __init__(self) -> None:
        self.n = 0
        for name in RENDEZVOUS:
            orig = getattr(dist, name)

            def counted(*args, _orig=orig, **kwargs):
                self.n += 1
                return _orig(*args, **kwargs)

            setattr(dist, name, counted)


def _lens(rank: int) -> list[int]:
    return [40, 7, 90] if rank == 0 else [5 + rank, 13]


def _layer(bal, h, path: str, bad=None):
    """One attention layer through ``path`` (``attention`` or ``pre_attn``); ``bad(q, o)``
    corrupts q (before) or the kernel output (after) on the rank that passes it."""
    q = bad("q", h) if bad else h
    if path == "attention":
        o = bal.attention(q, q, q)
    else:
        args = bal.pre_attn(q, q, q)
        if BACKEND[0] == "flash2_rules":  # flash-attn's own call on exactly these arguments
            o = fake_flash_attn.flash_attn_varlen_func(*args)
        else:
            o = varlen_attention_qk(*args)
        o = bal.post_attn(bad("o", o) if bad else o)
    return h + (o if o.shape == h.shape else 0 * o.sum())


def _step(bal, counter, rank, path, layers=LAYERS, bad=None, skip=None, seed=0):
    """A training step; returns (output rows, whole-group collectives per layer, in the backward)."""
    bal.plan(_lens(rank))
    g = torch.Generator().manual_seed(seed * 10 + rank)
    x = torch.randn(sum(_lens(rank)), H, D, generator=g, dtype=DTYPE[0], requires_grad=True)
    h = bal.route(x)
    per_layer = []
    for i in range(layers):
        if skip is not None and skip(i):
            continue
        before = counter.n
        h = _layer(bal, h, path, bad[1] if bad is not None and bad[0] == i else None)
        per_layer.append(counter.n - before)
    out = bal.reverse_route(h)
    before = counter.n
    out.square().sum().backward()
    return out.detach(), per_layer, counter.n - before, x.grad


def _outcome(fn):
    try:
        fn()
    except BalancerInputError as exc:
        return type(exc).__name__, str(exc)
    return "ok", ""


def _raised_next(bal, rank: int, fn, warm_up=None):
    """``fn`` (a step with a bad call on one rank) must finish on every rank; the next ``plan``
    raises: (the step's outcome, the plan's). ``warm_up`` runs first: an error makes every rank
    forget the schedules it learned, so the step after one learns again (agreeing call by
    call), and the case must run in a later, scheduled step."""
    if warm_up is not None:
        warm_up()
    return _outcome(fn), _outcome(lambda: bal.plan(_lens(rank)))


def steady_state(rank: int, world: int, backend: str = "auto", dtype: torch.dtype = torch.float64) -> dict:
    BACKEND[0], DTYPE[0] = backend, dtype
    counter = Counter()
    out: dict = {}
    for path in ("attention", "pre_attn"):
        bal = SequenceBalancer(f"g{world}n1", MODEL, attn_backend=BACKEND[0])  # Ulysses over all ranks
        out.update(_path_cases(bal, counter, rank, world, path))
    out["recompute"] = _recompute(rank, world, counter)
    out["ring"] = _ring(rank, world, counter)
    return out


def _path_cases(bal, counter: Counter, rank: int, world: int, path: str) -> dict:
    out: dict = {}
    first = _step(bal, counter, rank, path)
    later = [_step(bal, counter, rank, path) for _ in range(2)]
    out[f"{path} counts"] = [first[1], first[2]] + [[s[1], s[2]] for s in later]
    out[f"{path} same"] = all(torch.equal(s[0], first[0]) and torch.equal(s[3], first[3]) for s in later)

    def bad_rows(what, t):
        return torch.cat([t, t[:1]]) if rank == world - 1 and what == "q" else t

    clean = lambda: _step(bal, counter, rank, path)  # noqa: E731
    out[f"{path} bad rows"] = _raised_next(bal, rank, lambda: _step(bal, counter, rank, path, bad=(2, bad_rows)))
    out[f"{path} after"] = torch.equal(_step(bal, counter, rank, path)[0], first[0])  # the job goes on, exactly
    if path == "pre_attn":

        def bad_out(what, t):
            return t[:-1] if rank == 0 and what == "o" else t

        def bad_heads(what, t):
            return torch.zeros(t.shape[0], 2 * H, D, dtype=t.dtype) if rank == 1 and what == "q" else t

        bad_output = lambda: _step(bal, counter, rank, path, bad=(3, bad_out))  # noqa: E731
        out["post_attn bad output"] = _raised_next(bal, rank, bad_output, clean)
        bad_head_count = lambda: _step(bal, counter, rank, path, bad=(1, bad_heads))  # noqa: E731
        out["pre_attn bad heads"] = _raised_next(bal, rank, bad_head_count, clean)
    skip = lambda i: i == 2 and rank == 1  # noqa: E731
    out[f"{path} skipped layer"] = _raised_next(bal, rank, lambda: _step(bal, counter, rank, path, skip=skip), clean)
    extra = lambda: _step(bal, counter, rank, path, layers=LAYERS + (rank == 0))  # noqa: E731
    out[f"{path} extra layer"] = _raised_next(bal, rank, extra, clean)
    # an evaluation step (no gradients) is another kind of step: no error, its own schedule
    with torch.no_grad():
        bal.plan(_lens(rank))
        h = bal.route(torch.ones(sum(_lens(rank)), H, D, dtype=DTYPE[0]))
        for _ in range(2):
            h = _layer(bal, h, path)
        bal.reverse_route(h)
    out[f"{path} after eval"] = torch.equal(_step(bal, counter, rank, path)[0], first[0])
    return out


def _recompute(rank: int, world: int, counter: Counter):
    """Activation checkpointing recomputes layers inside the backward; a bad recomputation on
    one rank finishes the backward (its exchanges run on zeros) and every rank raises at the
    next ``plan``."""
    bal = SequenceBalancer(f"g{world}n1", MODEL, attn_backend=BACKEND[0])
    bad = {"now": False}

    def block(h):
        q = torch.cat([h, h[:1]]) if bad["now"] and rank == 1 else h  # set for the recomputation only
        o = bal.attention(q, q, q)
        return h + (o if o.shape == h.shape else 0 * o.sum())

    def step(bad_recompute=False):
        bal.plan(_lens(rank))
        x = torch.ones(sum(_lens(rank)), H, D, dtype=DTYPE[0], requires_grad=True)
        h = bal.route(x)
        for _ in range(2):
            h = ckpt.checkpoint(block, h, use_reentrant=False)
        out = bal.reverse_route(h)
        before = counter.n
        bad["now"] = bad_recompute
        try:
            out.sum().backward()
        finally:
            bad["now"] = False
        return counter.n - before

    first = step()  # learning: the recomputed layers agree too
    steady = step()
    backward = _outcome(lambda: step(bad_recompute=True))
    raised = _outcome(lambda: bal.plan(_lens(rank)))
    return first, steady, backward, raised


def _ring(rank: int, world: int, counter: Counter):
    """A pure ring over every rank (one head: no Ulysses split): later layers make only the
    ring's exchanges; another head dim on one rank in a later step raises on every rank."""
    bal = SequenceBalancer(f"g{world}n1", MODEL, attn_backend=BACKEND[0])
    lens = [[97, 5]] + [[6]] * (world - 1)
    plan = plan_from_groups(lens, [tuple(range(world))], [0, 0] + [0] * (world - 1), MODEL, ring=[world])

    def step(bad=False):
        bal.use_plan(plan)
        h = bal.route(torch.ones(sum(lens[rank]), 1, D, dtype=DTYPE[0], requires_grad=True))
        per = []
        for i in range(3):
            before = counter.n
            q = h[:, :, : D // 2] if bad and i == 2 and rank == 1 else h
            o = bal.attention(q, q, q)
            h = h + (o if o.shape == h.shape else 0 * o.sum())
            per.append(counter.n - before)
        bal.reverse_route(h).sum().backward()
        return per

    counts = [step(), step()]
    return counts, _outcome(lambda: step(bad=True)), _outcome(lambda: bal.use_plan(plan)), [step(), step()]


def expected_errors() -> dict:
    """Case -> (error type the next ``plan`` raises, texts every rank's message contains)."""
    return {
        "attention bad rows": (BalancerInputError, ["plan: bad input on rank(s) [{last}]", "attention on"]),
        "pre_attn bad rows": (BalancerInputError, ["plan: bad input on rank(s) [{last}]", "pre_attn on"]),
        "post_attn bad output": (BalancerInputError, ["plan: bad input on rank(s) [0]", "post_attn got"]),
        "pre_attn bad heads": (BalancerInputError, ["bad input on rank(s) [1]", "where every rank made pre_attn"]),
        "attention skipped layer": (
            DivergentCallError,
            ["ranks made different calls on rank(s) [1]", "a layer skipped"],
        ),
        "pre_attn skipped layer": (
            DivergentCallError,
            ["ranks made different calls on rank(s) [1]", "a layer skipped"],
        ),
        "attention extra layer": (
            DivergentCallError,
            ["different calls on rank(s) [0]", "where every rank made reverse_route"],
        ),
        "pre_attn extra layer": (
            DivergentCallError,
            ["different calls on rank(s) [0]", "where every rank made reverse_route"],
        ),
    }


def _attn(bal, h):
    return h + bal.attention(h, h, h)


def _pre_post(bal, h):
    o = bal.post_attn(varlen_attention_qk(*bal.pre_attn(h, h, h)))
    return h + (o if o.shape == h.shape else 0 * o.sum())


def divergent_calls(rank: int, world: int) -> dict:
    """Calls that differ on one rank from the schedule in a later step — a whole layer skipped, a
    layer through the other attention path, a skipped ``gather_sequences`` — finish the step on
    every rank and raise at the next ``plan``; a module unfrozen after the schedule was learned,
    and an empty rank routing two floating dtypes, just work. Case -> outcomes of (two steps, the
    step that differs, the next plan)."""
    cases = {}
    for name in ("skip_all_layers", "mixed_skip_attention", "missing_gather", "pre_instead_of_attention"):
        bal = SequenceBalancer(f"g{world}n1", MODEL, collective_timeout_s=60.0)

        def step(bad=False, name=name, bal=bal):
            bal.plan(_lens(rank))
            x = torch.randn(sum(_lens(rank)), H, D, dtype=torch.float64, requires_grad=True)
            h = bal.route(x)
            odd = bad and rank == 1
            if name == "skip_all_layers":
                if not odd:
                    h = _attn(bal, _attn(bal, h))
            elif name == "mixed_skip_attention":
                h = _pre_post(bal, h if odd else _attn(bal, h))
            elif name == "missing_gather":
                c = torch.randn(len(_lens(rank)), 3, dtype=torch.float64, requires_grad=True)
                h = _attn(bal, h)
                if not odd:
                    h = h + bal.gather_sequences(c)[0].sum()
            else:
                h = _attn(bal, _pre_post(bal, h) if odd else _attn(bal, h))
            bal.reverse_route(h).square().sum().backward()

        cases[name] = [_outcome(step), _outcome(step), _outcome(lambda: step(bad=True))]
        cases[name].append(_outcome_any(lambda bal=bal: bal.plan(_lens(rank))))
    bal = SequenceBalancer(f"g{world}n1", MODEL, collective_timeout_s=60.0)

    def unfrozen(late=False):  # a conditioning that needed no gradient when the schedule was learned
        lens = _lens(rank) if not (late and rank == 1) else []
        bal.plan(lens)
        h = bal.route(torch.randn(sum(lens), H, D, dtype=torch.float64, requires_grad=True))
        c = torch.randn(len(lens), 3, dtype=torch.float64, requires_grad=late and rank == 0)
        h = _attn(bal, h) + bal.gather_sequences(c)[0].sum()
        bal.reverse_route(h).square().sum().backward()

    cases["unfrozen"] = [_outcome(unfrozen), _outcome(unfrozen), _outcome(lambda: unfrozen(late=True))]
    cases["unfrozen"].append(_outcome_any(lambda: bal.plan(_lens(rank))))
    bal = SequenceBalancer(f"g{world}n1", MODEL, collective_timeout_s=60.0)
    lens = [40, 7, 90] if rank == 0 else []

    def two_dtypes():  # an empty rank: one leaf per dtype, each exchange's backward reached
        bal.plan(lens)
        x = torch.randn(sum(lens), H, D, dtype=torch.float64, requires_grad=rank == 0)
        c = torch.randn(sum(lens), 3, dtype=torch.float32, requires_grad=rank == 0)
        h, cc = bal.route(x, c)
        bal.reverse_route(_attn(bal, h) + cc.double().sum()).square().sum().backward()

    cases["two_dtypes"] = [_outcome(two_dtypes), _outcome(two_dtypes), _outcome(two_dtypes)]
    return cases


def _outcome_any(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the type is the verdict
        return type(exc).__name__, str(exc)[:300]
    return "ok", ""
