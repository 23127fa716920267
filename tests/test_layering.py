"""Layers import one way: planning never imports torch; importing knapformer touches no device;
no import circles; the core never reaches up into tools, integrations or the cluster model.

Imports are read from the source (every ``import`` statement, top level, inside a function or
under ``if TYPE_CHECKING:``), so a lazy or typing-only import counts as much as an eager one;
``from pkg import sub`` depends on the package (its ``__init__`` runs and hands the name on) as
well as on the submodule.
"""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "knapformer"

PURE = [
    "knapformer",
    "knapformer.workload",
    "knapformer.layout",
    "knapformer.plan",
    "knapformer.config",
    "knapformer.data",
    "knapformer.cli",
    "knapformer.model_configs",
    "knapformer.cluster",
    "knapformer.workload_fit",
    "knapformer.tools.cluster_cli",
    "knapformer.tools.plan_cli",
    "knapformer.tools.sim_config",
    "knapformer.tools.calibrate_args",
]
CORE = ("workload", "layout", "plan", "config", "distributed", "attention", "models", "model_configs")
UPPER = ("tools", "integrations", "cluster")


def _module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, root: Path = ROOT) -> set[str]:
    """Every knapformer module (or package) this file imports, at any depth; for
    ``from pkg import name`` both ``pkg.name`` (if that is a submodule) and ``pkg``, written
    ``pkg.name|pkg``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    me = _module_name(path, root)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("knapformer"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.startswith("knapformer"):
                out.update(f"{mod}.{a.name}|{mod}" for a in node.names)
    return out


def _graph(root: Path = ROOT) -> dict[str, set[str]]:
    files = {_module_name(p, root): p for p in root.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        deps = set()
        for imported in _imports(path, root):
            # `from knapformer.plan import X`: on the package, and on the submodule X if there is one
            for mod in dict.fromkeys(imported.split("|")):
                while mod and mod not in files:
                    mod = mod.rpartition(".")[0]
                if mod and mod != name:
                    deps.add(mod)
        graph[name] = deps
    return graph


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_no_import_circles():
    """Depth-first search over the module graph (package __init__ -> submodule edges included)."""
    graph = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                cycles.append(stack[stack.index(d) :] + [d])
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert cycles == [], "import circles: " + "; ".join(" -> ".join(c) for c in cycles[:5])


def test_core_never_imports_tools_integrations_or_cluster():
    graph = _graph()
    bad = [f"{m} imports {d}" for m, deps in graph.items() if _layer(m) in CORE for d in deps if _layer(d) in UPPER]
    assert bad == [], bad


def test_layering_check_sees_lazy_and_relative_imports(tmp_path):
    """The graph reader counts imports inside functions and relative ones (a mutation check of
    the test itself, on a throw-away package tree)."""
    root = tmp_path / "knapformer"
    for d in ("plan", "tools"):
        (root / d).mkdir(parents=True)
        (root / d / "__init__.py").write_text("")
    (root / "__init__.py").write_text("")
    (root / "tools" / "cli_support.py").write_text("from ..plan import lazy\n")
    (root / "plan" / "lazy.py").write_text("def f():\n    from knapformer.tools import cli_support\n")
    graph = _graph(root)
    assert "knapformer.tools.cli_support" in graph["knapformer.plan.lazy"]
    assert "knapformer.plan.lazy" in graph["knapformer.tools.cli_support"]


def test_layering_check_sees_a_circle_through_a_package_and_typing_imports(tmp_path):
    """Mutation check: ``from pkg import a`` in a module the package's ``__init__`` imports is a
    circle (pkg.b -> pkg -> pkg.b), and so is one closed by an ``if TYPE_CHECKING:`` import."""
    root = tmp_path / "knapformer"
    (root / "pkg").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "pkg" / "__init__.py").write_text("from knapformer.pkg.b import f\n")
    (root / "pkg" / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from knapformer.pkg.b import f\n"
    )
    (root / "pkg" / "b.py").write_text("from knapformer.pkg import a\ndef f(): pass\n")
    graph = _graph(root)
    assert "knapformer.pkg" in graph["knapformer.pkg.b"]  # the package's __init__ runs
    assert "knapformer.pkg.b" in graph["knapformer.pkg.a"]  # typing-only imports count


def test_pure_layers_do_not_import_torch():
    code = (
        "import sys\n"
        f"for m in {PURE!r}: __import__(m)\n"
        "bad = [m for m in ('torch', 'torch.distributed', 'flash_attn', 'matplotlib', 'scipy') if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"pure layers imported: {out.stdout.strip()}"


def test_cli_help_imports_no_torch():
    """Every subcommand's --help is torch-free: parsers are built from the tools' add_args."""
    code = "import sys\nfrom knapformer.cli import build_parser\nbuild_parser()\nprint('torch' in sys.modules)\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_importing_the_balancer_does_not_load_the_compiler():
    """``torch._dynamo`` costs ~1.2 s of every rank's start; the balancer's compile guards
    (:func:`knapformer.distributed.compiled.eager_only`) load it only when a caller has."""
    code = "import sys\nimport knapformer.distributed, knapformer.training\nprint('torch._dynamo' in sys.modules)\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_models_and_attention_do_not_use_torch_distributed():
    """Models are single-device user code; attention backends are local; planning and the
    cluster model are numpy. Only distributed/, tools/, integrations/ and testing/ import
    torch.distributed."""
    import re

    dist_import = re.compile(r"^\s*(import|from)\s+torch\.distributed", re.M)
    torch_import = re.compile(r"^\s*(import|from)\s+torch\b", re.M)
    offenders = [
        str(p.relative_to(ROOT))
        for sub in ("models", "attention")
        for p in (ROOT / sub).rglob("*.py")
        if dist_import.search(p.read_text())
    ]
    pure = [*(ROOT / "plan").rglob("*.py"), *(ROOT / "cluster").rglob("*.py")]
    pure += [ROOT / f for f in ("workload.py", "layout.py", "model_configs.py", "workload_fit.py", "config.py")]
    offenders += [str(p.relative_to(ROOT)) for p in pure if torch_import.search(p.read_text())]
    assert offenders == [], offenders


def _private_imports(path: Path, root: Path = ROOT) -> list[str]:
    """``from knapformer.X... import _name`` (or of a ``_module``) where X is another package
    than the importing file's."""
    tree = ast.parse(path.read_text(), filename=str(path))
    mine = _layer(_module_name(path, root))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith("knapformer"):
            other = _layer(node.module)
            if other == mine:
                continue
            parts = node.module.split(".")
            private = [n.name for n in node.names if n.name.startswith("_") and not n.name.endswith("__")]
            if any(p.startswith("_") for p in parts[1:]) or private:
                out.append(f"{_module_name(path, root)} imports {node.module}:{private or '(private module)'}")
    return out


def test_no_module_imports_another_packages_private_names():
    bad = [line for p in sorted(ROOT.rglob("*.py")) for line in _private_imports(p)]
    assert bad == [], bad


def test_private_import_check_sees_a_private_name(tmp_path):
    """Mutation check of the test above, on a throw-away tree."""
    root = tmp_path / "knapformer"
    for d in ("plan", "tools"):
        (root / d).mkdir(parents=True)
        (root / d / "__init__.py").write_text("")
    (root / "__init__.py").write_text("")
    (root / "tools" / "t.py").write_text("from knapformer.plan.problem import _is_int\n")
    assert _private_imports(root / "tools" / "t.py", root) == [
        "knapformer.tools.t imports knapformer.plan.problem:['_is_int']"
    ]


def test_models_never_import_the_distributed_layer():
    """The reference DiTs are user code: they see only the executor contract."""
    graph = _graph()
    bad = [
        f"{m} imports {d}"
        for m, deps in graph.items()
        if _layer(m) == "models"
        for d in deps
        if _layer(d) in ("distributed", "integrations", "tools")
    ]
    assert bad == [], bad


def test_tools_reach_integrations_only_through_the_registry():
    graph = _graph()
    bad = [
        f"{m} imports {d}"
        for m, deps in graph.items()
        if _layer(m) == "tools"
        for d in deps
        if _layer(d) == "integrations" and d != "knapformer.integrations.registry"
    ]
    assert bad == [], bad
