"""Packaging and hygiene: silent lazy import, dependency direction, metadata."""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

import pytest

import nvalchemi_ase

PACKAGE = Path(nvalchemi_ase.__file__).parent
ROOT = PACKAGE.parent


def run_python(code: str) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    return result


@pytest.mark.slow  # a fresh interpreter imports torch and nvalchemi (~10 s of CPU)
def test_import_is_lazy_silent_and_leaves_warning_filters_alone():
    code = """
import sys, warnings
warnings.simplefilter("error", UserWarning)
before = list(warnings.filters)
hook = sys.excepthook
import nvalchemi_ase
assert "nvalchemi" not in sys.modules and "torch" not in sys.modules, "not lazy"
from ase.build import bulk
atoms = bulk("Ar", "fcc", a=5.26, cubic=True)
atoms.calc = nvalchemi_ase.NVAlchemiCalculator("lj", device="cpu")
atoms.get_potential_energy()
from nvalchemi_ase._quiet import import_quietly
import_quietly("nvalchemi.dynamics")
# torch and scipy append narrow 'ignore' entries for their own messages when
# imported; the caller's filters must all survive, and still be in charge.
after = list(warnings.filters)
assert [f for f in after if f in before] == before, "caller's filters changed"
try:
    warnings.warn("still an error", UserWarning)
except UserWarning:
    pass
else:
    raise AssertionError("a broad filter now overrides the caller's")
assert sys.excepthook is hook, "excepthook changed"
"""
    result = run_python(code)
    assert result.stdout == ""


def _imports(path: Path, *, lazy: bool = True, type_checking: bool = True) -> set[str]:
    """Package modules ``path`` imports, in every form.

    ``import a.b``, ``from a.b import c`` (``c`` itself when it is a module,
    ``from nvalchemi_ase import plotting``; the module defining it when it is
    one of the package's lazy re-exports, ``from nvalchemi_ase import
    relax``), and ``import_quietly("...")`` / ``importlib.import_module("...")``
    strings. With ``lazy=False`` only module-level imports count (not those
    inside functions or ``if TYPE_CHECKING`` blocks); with
    ``type_checking=False`` those run at some point (at import or inside a
    function) count, not those for annotations only (``if TYPE_CHECKING``).
    """
    tree = ast.parse(path.read_text())
    if not lazy:
        nodes = _module_level(tree)
    elif not type_checking:
        nodes = _module_level(tree, functions=True)
    else:
        nodes = ast.walk(tree)
    names = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module:
            names.update(_imported_from(node.module, a.name) for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif (
            isinstance(node, ast.Call)
            and _called_name(node.func) in ("import_quietly", "import_module")
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            names.add(str(node.args[0].value))
    return {n for n in names if n.split(".")[0] == "nvalchemi_ase"}


def _called_name(func: ast.expr) -> str | None:
    """``f`` of ``f(...)`` and of ``module.f(...)``."""
    if isinstance(func, ast.Attribute):
        return func.attr
    return getattr(func, "id", None)


def _imported_from(module: str, name: str) -> str:
    """The package module ``from module import name`` depends on."""
    if f"{module}.{name}" in _package_modules():
        return f"{module}.{name}"
    if module == "nvalchemi_ase" and name in nvalchemi_ase._EXPORTS:
        return nvalchemi_ase._EXPORTS[name]
    return module


def _module_level(tree: ast.Module, *, functions: bool = False):
    """Nodes run at import time: not inside functions or TYPE_CHECKING blocks.

    With ``functions=True`` the bodies of functions too (nodes run at some
    point), still not ``if TYPE_CHECKING`` blocks.
    """
    pending: list[ast.AST] = list(tree.body)
    while pending:
        node = pending.pop()
        function = isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        if function and not functions:
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        yield node
        pending.extend(ast.iter_child_nodes(node))


# Layers, bottom up; a module may import its own layer's modules and lower ones.
LAYERS = [
    (
        "nvalchemi_ase.units",
        "nvalchemi_ase.devices",
        "nvalchemi_ase._quiet",
        "nvalchemi_ase._compat",
        "nvalchemi_ase.typing",
        "nvalchemi_ase.plotting",  # numpy and matplotlib only
        "nvalchemi_ase.io_safe",  # numpy and ase only
    ),
    ("nvalchemi_ase.convert",),
    ("nvalchemi_ase.models", "nvalchemi_ase.calculator", "nvalchemi_ase.identity"),
    ("nvalchemi_ase.dynamics", "nvalchemi_ase.engines"),
    # optimizer + md, optimizer | md: over the parts' engine protocol, below both
    ("nvalchemi_ase.compose", "nvalchemi_ase.pipeline"),
    ("nvalchemi_ase.md", "nvalchemi_ase.optimize", "nvalchemi_ase.wrap"),
    (
        "nvalchemi_ase.mep",
        "nvalchemi_ase.properties",
        "nvalchemi_ase.runners",
        "nvalchemi_ase.testing",
        "nvalchemi_ase.tables",
        "nvalchemi_ase.analysis",
    ),
    ("nvalchemi_ase.cli", "nvalchemi_ase._ase_plugin", "nvalchemi_ase.__main__"),
]
# Siblings in one layer that must not import each other (as in ASE).
SEPARATE = [("nvalchemi_ase.md", "nvalchemi_ase.optimize")]


def _layer_of(module: str) -> int | None:
    for level, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return level
    return None


@functools.cache
def _package_modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        modules[module.removesuffix(".__init__")] = path
    return modules


def test_no_upward_import_between_layers():
    violations = []
    for module, path in _package_modules().items():
        level = _layer_of(module)
        if level is None:
            continue  # the package __init__ re-exports lazily
        for name in sorted(_imports(path)):
            target = _layer_of(name)
            if target is None or target <= level:
                continue
            violations.append(f"{module} imports {name} (a higher layer)")
    assert violations == []


def _module_of(name: str) -> str | None:
    """The package module ``name`` is, or the one it is an attribute of."""
    modules = _package_modules()
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _import_graph() -> dict[str, set[str]]:
    """Each package module's imports that run (eager or inside functions).

    ``if TYPE_CHECKING`` imports (annotations only) are left out, and so are
    the package root's: it imports nothing when it runs (its names resolve
    lazily), and ``from nvalchemi_ase import X`` already counts as an import of
    the module defining ``X``.
    """
    graph: dict[str, set[str]] = {}
    for module, path in _package_modules().items():
        if module == "nvalchemi_ase":
            graph[module] = set()
            continue
        targets = {_module_of(n) for n in _imports(path, type_checking=False)}
        graph[module] = {t for t in targets if t is not None and t != module}
    return graph


def _import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each import circle once: a shortest path from a module back to itself."""
    circles, seen = [], set()
    for start in sorted(graph):
        parents: dict[str, str] = {}
        frontier = [start]
        while frontier and start not in parents:
            following = []
            for module in frontier:
                for target in sorted(graph.get(module, ())):
                    if target not in parents:
                        parents[target] = module
                        following.append(target)
            frontier = following
        if start not in parents:
            continue
        circle, module = [start], parents[start]
        while module != start:
            circle.append(module)
            module = parents[module]
        circle.reverse()
        if frozenset(circle) not in seen:
            seen.add(frozenset(circle))
            circles.append([start, *circle])
    return circles


def test_no_import_circle_at_all():
    """No module reaches itself through imports, lazy ones inside functions too."""
    circles = _import_circles(_import_graph())
    assert [" -> ".join(c) for c in circles] == []


def test_the_circle_test_sees_a_lazy_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _import_circles(graph) == [["a", "b", "c", "a"]]
    assert _import_circles({"a": {"b"}, "b": set()}) == []


def test_the_layer_test_sees_every_import_form(tmp_path):
    source = tmp_path / "example.py"
    source.write_text(
        "import importlib\n"
        "import nvalchemi_ase.units\n"
        "from nvalchemi_ase.dynamics import images\n"
        "from nvalchemi_ase.dynamics.base import BatchedDynamics\n"
        "def later():\n"
        "    from nvalchemi_ase import plotting, relax\n"
        "    importlib.import_module('nvalchemi_ase.md')\n"
        "    import_quietly('nvalchemi_ase.engines.mtk')\n"
        "if TYPE_CHECKING:\n"
        "    from nvalchemi_ase.compose import RelaxThenMD\n"
    )
    assert _imports(source) == {
        "nvalchemi_ase.units",
        "nvalchemi_ase.dynamics.images",
        "nvalchemi_ase.dynamics.base",
        "nvalchemi_ase.plotting",  # a module imported from the package
        "nvalchemi_ase.runners",  # a lazy re-export: its defining module
        "nvalchemi_ase.md",
        "nvalchemi_ase.engines.mtk",
        "nvalchemi_ase.compose",  # for annotations only
    }
    assert _imports(source, type_checking=False) == _imports(source) - {
        "nvalchemi_ase.compose"
    }
    assert _imports(source, lazy=False) == {
        "nvalchemi_ase.units",
        "nvalchemi_ase.dynamics.images",
        "nvalchemi_ase.dynamics.base",
    }


def test_md_and_optimize_never_import_each_other():
    violations = []
    for module, path in _package_modules().items():
        for first, second in SEPARATE:
            for owner, other in ((first, second), (second, first)):
                if module == owner or module.startswith(owner + "."):
                    violations.extend(
                        f"{module} imports {name}"
                        for name in sorted(_imports(path))
                        if name == other or name.startswith(other + ".")
                    )
    assert violations == []


def test_every_package_module_has_a_layer():
    unplaced = [
        module
        for module in _package_modules()
        if module != "nvalchemi_ase" and _layer_of(module) is None
    ]
    assert unplaced == []


def test_only_the_plugin_module_touches_ase_private_api():
    offenders = [
        str(path.relative_to(ROOT))
        for path in PACKAGE.rglob("*.py")
        if "ase._4" in path.read_text() and path.name != "_ase_plugin.py"
    ]
    assert offenders == []


def test_version_is_a_literal_and_metadata_is_installed():
    from importlib.metadata import metadata, version

    assert version("nvalchemi-ase") == nvalchemi_ase.__version__
    requires = metadata("nvalchemi-ase").get_all("Requires-Dist")
    assert any(r.startswith("nvalchemi-toolkit") and "<0.4" in r for r in requires)
    assert (PACKAGE / "py.typed").exists()


def test_calculator_is_registered_with_ases_plugin_system():
    from importlib.metadata import entry_points

    (entry,) = [
        e for e in entry_points(group="ase.plugins") if e.name == "nvalchemi_ase"
    ]
    module = entry.load()
    try:
        from ase._4.plugins.plugin_collection import PluginCollection
    except ImportError:  # pragma: no cover - ASE without the v4 plugin API
        assert module.__ase_plugins__ == set()
        return
    calculators = {p.name: p for p in PluginCollection.from_entry_points().calculators}
    from nvalchemi_ase.calculator import NVAlchemiCalculator

    assert calculators["nvalchemi"].implementation is NVAlchemiCalculator


def test_plugin_module_survives_a_missing_ase_4_api():
    code = """
import sys
sys.modules["ase._4.plugins.plugin"] = None  # makes the import fail
import nvalchemi_ase._ase_plugin as plugin
assert plugin.__ase_plugins__ == set()
assert "torch" not in sys.modules
"""
    run_python(code)


def test_type_aliases_import_neither_torch_nor_nvalchemi():
    code = """
import sys
from nvalchemi_ase.typing import ImagesLike, ModelLike, DeviceLike, TrajectoryLike
assert "torch" not in sys.modules and "nvalchemi" not in sys.modules
"""
    run_python(code)


def test_code_is_ruff_clean():
    import pytest

    pytest.importorskip("ruff")
    paths = ["nvalchemi_ase", "tests", "tutorials", "benchmarks"]
    check = subprocess.run(
        [sys.executable, "-m", "ruff", "check", *paths],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert check.returncode == 0, check.stdout[-3000:]
    formatted = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", *paths],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert formatted.returncode == 0, formatted.stdout[-3000:]


# Drivers that use the run core and the dynamics classes only through their
# public members (and the engine protocol).
THIN_CLIENTS = ("runners", "compose.py", "pipeline")


def _private_reaches(path: Path) -> list[str]:
    """``x._name`` (and ``getattr(x, "_name")``) on anything but ``self``/``cls``.

    ``super()._name`` is the object itself too; dunders are not private.
    """
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute):
            name, owner = node.attr, node.value
        elif (
            isinstance(node, ast.Call)
            and _called_name(node.func) in ("getattr", "setattr", "hasattr")
            and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            name, owner = node.args[1].value, node.args[0]
        else:
            continue
        if not name.startswith("_") or (name.startswith("__") and name.endswith("__")):
            continue
        if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
            continue
        if isinstance(owner, ast.Call) and _called_name(owner.func) == "super":
            continue
        found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_thin_clients_reach_into_no_private_member():
    """Runners, ``optimizer + md`` and ``optimizer | md`` use public members only.

    They drive ``BatchRun``, ``BatchedDynamics`` and ``BatchedOptimizer``
    through their public methods; nvalchemi's private members go through
    ``_compat`` functions.
    """
    paths = [PACKAGE / entry for entry in THIN_CLIENTS if entry.endswith(".py")]
    paths += [
        path
        for entry in THIN_CLIENTS
        if not entry.endswith(".py")
        for path in sorted((PACKAGE / entry).rglob("*.py"))
    ]
    assert len(paths) > len(THIN_CLIENTS)
    found = [reach for path in paths for reach in _private_reaches(path)]
    assert found == []


def test_the_private_scan_sees_every_form(tmp_path):
    source = tmp_path / "client.py"
    source.write_text(
        "def drive(run, self):\n"
        "    run._engine.step()\n"
        "    getattr(run, '_state')\n"
        "    self._mine, super()._hook(), run.__class__, run.public\n"
    )
    found = _private_reaches(source)
    assert sorted(line.split(": ", 1)[1] for line in found) == [
        "getattr(run, '_state')",
        "run._engine",
    ]
