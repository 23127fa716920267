"""What every command-line tool shares (torch-free): the one-line error contract, argument
types that name the flag and value, JSON input files, and the balancer's flags.

Each tool module has ``add_args(parser)`` and ``run(args) -> int``; :func:`run_tool` is its
``main`` when run on its own (``python -m knapformer.tools.X``) and ``knapformer X`` dispatches
to the same two functions. Bad input anywhere exits with status 2 and one line on stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from knapformer.config import ATTN_BACKENDS, ATTN_PATHS
from knapformer.plan import DEFAULT_SOLVER, SOLVERS
from knapformer.workload import WorkloadModel

__all__ = [
    "CliError",
    "Parser",
    "BALANCER_FLAGS",
    "add_balancer_args",
    "balancer_settings",
    "cost_model_from_args",
    "finite_float",
    "load_seq_lens",
    "nonneg_float",
    "positive_float",
    "positive_int",
    "progress",
    "rank_speed_list",
    "read_json",
    "run_command",
    "run_tool",
]


class CliError(ValueError):
    """A user-facing error: printed as one line, exit status 2."""


class Parser(argparse.ArgumentParser):
    """argparse with the one-line error contract: ``prog: error: message`` and exit 2 (no
    usage block: the message names the flag and the value); every ``--help`` shows each
    flag's default."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def run_command(name: str, run: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Run a tool, turning user errors into one line on stderr and exit status 2."""
    try:
        return run(args)
    except (ValueError, TypeError, OSError, ImportError) as exc:  # user input, files, missing extras
        text = " ".join(str(exc).split()) or type(exc).__name__
        print(f"knapformer {name}: error: {text}", file=sys.stderr)
        return 2


def run_tool(
    name: str,
    add_args: Callable[[argparse.ArgumentParser], None],
    run: Callable[[argparse.Namespace], int],
    argv: Sequence[str] | None = None,
    description: str | None = None,
) -> int:
    """``main`` of a tool module run on its own: same flags, same error contract as the CLI."""
    p = Parser(prog=f"knapformer {name}", description=description)
    add_args(p)
    return run_command(name, run, p.parse_args(argv))


# -- argument types (argparse reports "argument --flag: <message>") ----------------------------
def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 1")
    return v


def finite_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return v


def nonneg_float(text: str) -> float:
    v = finite_float(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 0")
    return v


def positive_float(text: str) -> float:
    v = finite_float(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be > 0")
    return v


def rank_speed_list(text: str) -> tuple[float, ...]:
    """``1,1,0.5,1``: one relative speed per rank of the group."""
    out = []
    for i, part in enumerate(text.split(",")):
        try:
            v = float(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"entry {i} {part.strip()!r} of {text!r} is not a number") from None
        if not (math.isfinite(v) and v > 0):
            raise argparse.ArgumentTypeError(f"entry {i} {part.strip()!r} of {text!r} must be finite and > 0")
        out.append(v)
    return tuple(out)


# -- input files ------------------------------------------------------------------------------
def read_json(path: str, what: str) -> Any:
    """Parse a JSON file; every failure names the file (missing, not UTF-8, not JSON)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise CliError(f"cannot read {what} {path!r}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise CliError(f"{what} {path!r} is not UTF-8 text (expected JSON)") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise CliError(f"{what} {path!r} is not valid JSON: {exc.msg} (line {exc.lineno})") from None


def load_seq_lens(path: str) -> list:
    """``{"seq_lens": [[...rank 0...], ...]}`` from a file (validated later, with the layout)."""
    data = read_json(path, "input file")
    if not isinstance(data, dict) or "seq_lens" not in data:
        raise CliError(f"input file {path!r} must be a JSON object with key 'seq_lens'")
    if not isinstance(data["seq_lens"], list):
        raise CliError(f"input file {path!r}: 'seq_lens' must be a list of per-rank lists")
    return data["seq_lens"]


# -- the balancer's settings, one spelling everywhere -----------------------------------------
def add_balancer_args(
    p: argparse.ArgumentParser,
    *,
    bags_default: str | None,
    bags_help: str,
    bags_required: bool = False,
    execution: bool = True,
) -> None:
    """Flags of :class:`~knapformer.config.BalancerConfig` (plus the cost model's γ/profile);
    ``execution=False`` leaves out the settings only a running balancer reads."""
    g = p.add_argument_group("balancer")
    g.add_argument("--bags", "--layout", dest="bags", default=bags_default, required=bags_required, help=bags_help)
    g.add_argument(
        "--solver",
        default=None,
        choices=sorted(SOLVERS),
        help=f"planner (default: {DEFAULT_SOLVER} for bag layouts, moldable for --bags auto)",
    )
    g.add_argument("--max-tokens", type=positive_int, default=None, help="memory cap: routed tokens per rank")
    g.add_argument(
        "--time-budget",
        type=positive_float,
        default=None,
        help="planning seconds per step for solvers that take a budget (auto: more candidates)",
    )
    g.add_argument(
        "--rank-speed",
        type=rank_speed_list,
        default=None,
        help="relative speed of each rank of the group, comma-separated (e.g. 1,1,0.5,1)",
    )
    g.add_argument(
        "--attn-path",
        default="auto",
        choices=list(ATTN_PATHS),
        help="how ring groups attend, as the planner prices it: attention (bal.attention's ring rounds) or "
        "pre_attn (your own kernel through pre_attn/post_attn: K/V all-gathered over the ring, counted "
        "against --max-tokens); auto: attention until the first pre_attn call",
    )
    if execution:
        g.add_argument("--attn-backend", default="auto", choices=list(ATTN_BACKENDS), help="varlen attention kernel")
    g.add_argument("--gamma", type=nonneg_float, default=1.0, help="γ of the paper cost form used for planning")
    g.add_argument(
        "--profile",
        default=None,
        help="calibrated workload profile JSON the planner uses instead of the paper form (overrides --gamma)",
    )
    if execution:
        g.add_argument("--debug", action="store_true", help="per-layer cross-rank shape checks (a host sync per layer)")
        g.add_argument("--measure", action="store_true", help="time each rank's balanced region every step")
        g.add_argument("--recalibrate", action="store_true", help="refit the cost model online from the timings")
        g.add_argument("--estimate-speed", action="store_true", help="with --recalibrate: estimate per-rank speeds")
        g.add_argument(
            "--recalibrate-warmup",
            type=int,
            default=1,
            metavar="N",
            help="with --recalibrate: timed steps not fitted at the start (one-time costs; default 1)",
        )


def cost_model_from_args(
    args: argparse.Namespace, *, d_model: int, num_layers: int = 1, causal: bool = False, check_dim: bool = True
) -> WorkloadModel:
    """The planning cost model: ``--profile`` if given (its ``d_model`` must be the model's
    when ``check_dim``), else the paper form at ``--gamma``."""
    if getattr(args, "profile", None):
        prof = WorkloadModel.from_profile(args.profile)
        if check_dim and prof.d_model != d_model:
            raise CliError(f"--profile {args.profile!r} has d_model {prof.d_model}, the model has {d_model}")
        return prof
    return WorkloadModel(d_model=d_model, gamma=args.gamma, causal=causal, num_layers=num_layers)


BALANCER_FLAGS: dict[str, str] = {
    "solver": "solver",
    "max_tokens_per_rank": "max_tokens",
    "rank_speed": "rank_speed",
    "time_budget_s": "time_budget",
    "attn_path": "attn_path",
    "attn_backend": "attn_backend",
    "debug": "debug",
    "measure": "measure",
    "recalibrate": "recalibrate",
    "estimate_speed": "estimate_speed",
    "recalibrate_warmup": "recalibrate_warmup",
}
"""``BalancerConfig`` field -> the ``args`` attribute of its flag (from :func:`add_balancer_args`;
the layout and the cost model have their own flags)."""


def balancer_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The :class:`BalancerConfig` settings the flags of :func:`add_balancer_args` gave (only
    those the parser defined: ``execution=False`` leaves some out)."""
    return {field: getattr(args, flag) for field, flag in BALANCER_FLAGS.items() if hasattr(args, flag)}


def progress(iterable, *, total: int | None = None, desc: str = "", enabled: bool = True):
    """A tqdm progress bar on stderr, quiet when ``enabled`` is off or stderr is not a TTY.

    The size is given explicitly: a terminal that reports 0 × 0 (some IDE consoles,
    ``script``, terminals of containers started without a size) makes tqdm draw nothing at
    all (it hides bars below the last of 0 rows), so the bar falls back to ``COLUMNS`` /
    ``LINES`` or 100 × 20 there."""
    import shutil

    from tqdm.auto import tqdm

    size = shutil.get_terminal_size((100, 20))
    return tqdm(
        iterable,
        total=total,
        desc=desc,
        disable=(not enabled) or None,
        leave=False,
        file=sys.stderr,
        ncols=size.columns,
        nrows=size.lines,
    )
