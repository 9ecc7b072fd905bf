"""pytest plugin: ASE 3.29's own tests with this package's classes swapped in.

Load it with ``-p tests.ase_suite.plugin`` on a run of ASE's bundled tests
(``site-packages/ase/test/...``). At import, before any test module is
collected:

* the ASE dynamics classes that have a counterpart here (``VelocityVerlet``,
  ``Langevin``, ``FIRE``, ``BFGS``...; :data:`DYNAMICS`) are replaced, in their
  defining module and in ``ase.md``/``ase.optimize``, by this package's class;
* when one of them is constructed, the ASE calculator attached to each
  structure (EMT, LennardJones, MorsePotential, IdealGas, TIP3P... whatever
  the test built) is replaced by an ``NVAlchemiCalculator`` over
  :class:`~tests.ase_suite.ase_model.AseCalculatorModel` of it: the same
  numbers (the test's own calculator object computes them), through this
  package's calculator, batch and engines.

ASE modules that subclass or import these classes at import time are imported
first, so ASE's own other classes (``CellAwareBFGS``, ``LBFGSLineSearch``,
``SwitchLangevin``, ``Bussi``'s base...) keep their ASE bases.

Scope rule: a test is *in scope* when it constructs at least one of this
package's classes; tests that never do (ASE's loggers, velocity
distributions, filters, ASE-only optimizers) test ASE alone and are counted
apart. With ``NVALCHEMI_ASE_SUITE_REPORT=path``
the outcome of every test, and which swapped names it used, are written there
as JSON.
"""

from __future__ import annotations

import importlib
import json
import os
import warnings
from typing import Any

import pytest

#: ASE module:class -> nvalchemi_ase module:class.
DYNAMICS = {
    "ase.md.verlet:VelocityVerlet": "nvalchemi_ase.md:VelocityVerlet",
    "ase.md.langevin:Langevin": "nvalchemi_ase.md:Langevin",
    "ase.md.langevinbaoab:LangevinBAOAB": "nvalchemi_ase.md:LangevinBAOAB",
    "ase.md.nose_hoover_chain:NoseHooverChainNVT": (
        "nvalchemi_ase.md:NoseHooverChainNVT"
    ),
    "ase.md.nose_hoover_chain:IsotropicMTKNPT": "nvalchemi_ase.md:IsotropicMTKNPT",
    "ase.md.nose_hoover_chain:MTKNPT": "nvalchemi_ase.md:MTKNPT",
    "ase.md.bussi:Bussi": "nvalchemi_ase.md:Bussi",
    "ase.md.nvtberendsen:NVTBerendsen": "nvalchemi_ase.md:NVTBerendsen",
    "ase.md.andersen:Andersen": "nvalchemi_ase.md:Andersen",
    "ase.optimize.fire:FIRE": "nvalchemi_ase.optimize:FIRE",
    "ase.optimize.fire2:FIRE2": "nvalchemi_ase.optimize:FIRE2",
    "ase.optimize.bfgs:BFGS": "nvalchemi_ase.optimize:BFGS",
    "ase.optimize.lbfgs:LBFGS": "nvalchemi_ase.optimize:LBFGS",
    "ase.optimize.mdmin:MDMin": "nvalchemi_ase.optimize:MDMin",
}

#: Packages re-exporting the swapped classes (``from ase.md import Langevin``).
REEXPORTS = ("ase.md", "ase.optimize")

#: ASE modules that bind a swapped class at import (subclasses, defaults):
#: imported before the swap so they keep ASE's own.
KEEP_ASE = (
    "ase.md.switch_langevin",
    "ase.md.contour_exploration",
    "ase.optimize.cellawarebfgs",
    "ase.optimize.climbfixinternals",
    "ase.optimize.minimahopping",
    "ase.optimize.basin",
    "ase.optimize.rfo",
    "ase.optimize.precon",
    "ase.mep.neb",
    "ase.mep.autoneb",
    "ase.vibrations.vibrations",
)

_used: set[str] = set()
_report: dict[str, dict[str, Any]] = {}


def _split(path: str) -> tuple[Any, str]:
    module_name, name = path.split(":")
    return importlib.import_module(module_name), name


def _replace(module_name: str, name: str, original: Any, replacement: Any) -> None:
    for holder in (module_name, *REEXPORTS):
        module = importlib.import_module(holder)
        if getattr(module, name, None) is original:
            setattr(module, name, replacement)


def _recording_class(ours: type, original: type, name: str) -> type:
    def new(cls: type, *args: Any, **kwargs: Any) -> Any:
        if not _structures(_images(args, kwargs)):
            # not a structure (test_pure's Booth function): ASE's own class
            return original(*args, **kwargs)
        return ours.__new__(cls)

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        _used.add(name)
        _calculators_through_the_plugin(_images(args, kwargs))
        ours.__init__(self, *args, **kwargs)

    namespace = {
        "__new__": new,
        "__init__": init,
        "__module__": ours.__module__,
    }
    return _standing_for(original)(name, (ours,), namespace)


def _standing_for(original: type) -> type:
    """A metaclass whose classes also count ASE's ``original`` as their own.

    ASE's code that names the swapped class at run time (``BFGS.load`` imports
    ``ase.optimize.BFGS`` and asks ``isinstance(self, BFGS)``) still sees its
    own subclasses (``CellAwareBFGS``), kept on ASE's base, as instances.
    """

    class StandsFor(type):
        def __instancecheck__(cls, instance: Any) -> bool:
            return type.__instancecheck__(cls, instance) or isinstance(
                instance, original
            )

        def __subclasscheck__(cls, subclass: type) -> bool:
            return type.__subclasscheck__(cls, subclass) or issubclass(
                subclass, original
            )

    return StandsFor


def _images(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return args[0] if args else kwargs.get("images", kwargs.get("atoms"))


def _structures(images: Any) -> list[Any] | None:
    """The ``Atoms`` of ``images`` (Atoms, filters, lists); None if not structures."""
    from ase import Atoms

    items = list(images) if isinstance(images, (list, tuple)) else [images]
    structures = [
        item if isinstance(item, Atoms) else getattr(item, "atoms", None)
        for item in items
    ]
    if not items or any(not isinstance(atoms, Atoms) for atoms in structures):
        return None
    return structures


def _calculators_through_the_plugin(images: Any) -> None:
    """Put every structure's ASE calculator behind one NVAlchemiCalculator."""
    from nvalchemi_ase import NVAlchemiCalculator
    from tests.ase_suite.ase_model import AseCalculatorModel

    structures = _structures(images) or []
    calculators = [atoms.calc for atoms in structures]
    if not calculators or any(
        calc is None or isinstance(calc, NVAlchemiCalculator) for calc in calculators
    ):
        return
    model = AseCalculatorModel(calculators)
    shared = NVAlchemiCalculator(model, device="cpu", dtype="float64")
    for atoms in structures:
        atoms.calc = shared


def _swap() -> None:
    for module_name in KEEP_ASE:
        importlib.import_module(module_name)
    for source, target in DYNAMICS.items():
        module, name = _split(source)
        ours_module, ours_name = _split(target)
        original = getattr(module, name)
        replacement = _recording_class(getattr(ours_module, ours_name), original, name)
        _replace(module.__name__, name, original, replacement)


with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    _swap()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: Any, nextitem: Any) -> Any:
    _used.clear()
    yield


def pytest_runtest_logreport(report: Any) -> None:
    entry = _report.setdefault(
        report.nodeid, {"outcome": "passed", "used": [], "message": ""}
    )
    entry["used"] = sorted(set(entry["used"]) | _used)
    if report.failed:
        entry["outcome"] = "failed" if report.when == "call" else "error"
        entry["message"] = _first_line(report)
    elif report.skipped and entry["outcome"] == "passed":
        entry["outcome"] = "xfailed" if hasattr(report, "wasxfail") else "skipped"
    elif report.when == "call" and hasattr(report, "wasxfail") and report.passed:
        entry["outcome"] = "xpassed"


def _first_line(report: Any) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr)
    return text.strip().splitlines()[0][:300] if text.strip() else ""


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    path = os.environ.get("NVALCHEMI_ASE_SUITE_REPORT")
    if path:
        with open(path, "w") as handle:
            json.dump(_report, handle, indent=1, sort_keys=True)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    counts: dict[str, int] = {}
    for entry in _report.values():
        scope = "in scope" if entry["used"] else "ASE only"
        key = f"{scope} {entry['outcome']}"
        counts[key] = counts.get(key, 0) + 1
    terminalreporter.write_sep("=", "nvalchemi_ase on ASE's suite")
    for key in sorted(counts):
        terminalreporter.write_line(f"{key}: {counts[key]}")
