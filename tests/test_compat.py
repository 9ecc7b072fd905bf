"""Contract test: every private nvalchemi member the package uses still exists.

An upstream change to one of them fails here, by name, instead of somewhere
in a physics test. The package reaches those members through
``nvalchemi_ase/_compat.py`` only: imports and attribute names are scanned
(``tests/_nvalchemi_private.py`` holds the attribute rule).
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
from pathlib import Path

import numpy as np
import pytest

import nvalchemi_ase
from nvalchemi_ase._compat import (
    PRIVATE_ATTRIBUTES,
    PRIVATE_MEMBERS,
    SUBCLASS_HOOKS,
    engine_seed,
    set_engine_seed,
)
from nvalchemi_ase._quiet import import_quietly
from tests._nvalchemi_private import PackageScan, ambiguous_names

PACKAGE = Path(nvalchemi_ase.__file__).parent
LISTED = {member.name for member in PRIVATE_MEMBERS} | {
    name for names in PRIVATE_ATTRIBUTES.values() for name in names
}


def _owner(member):
    module = import_quietly(member.module)
    return getattr(module, member.owner) if member.owner else module


@pytest.mark.parametrize(
    "member", PRIVATE_MEMBERS, ids=lambda m: f"{m.owner or m.module}.{m.name}"
)
def test_private_member_exists_with_the_parameters_used(member):
    owner = _owner(member)
    assert hasattr(owner, member.name), f"{member.module}: {member.name} is gone"
    function = getattr(owner, member.name)
    parameters = [
        name
        for name, parameter in inspect.signature(function).parameters.items()
        if name != "self"
        and parameter.kind
        in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD)
    ]
    assert tuple(parameters[: len(member.parameters)]) == member.parameters


def test_private_attributes_exist_on_live_objects():
    from ase.build import bulk

    from nvalchemi_ase import NVAlchemiCalculator
    from nvalchemi_ase.dynamics.neighbors import is_neighbor_hook
    from nvalchemi_ase.md import Bussi

    atoms = bulk("Ar", "fcc", a=5.26, cubic=True)
    atoms.set_momenta(np.random.default_rng(0).normal(0.0, 1.0, (len(atoms), 3)))
    atoms.calc = NVAlchemiCalculator("lj", device="cpu", dtype="float64")
    dyn = Bussi(atoms, 1.0, temperature_K=50.0, taut=100.0, seed=0)
    dyn.run(1)
    from nvalchemi_ase.models import load_model

    composed = load_model("lj", cutoff=4.0) + load_model("lj", cutoff=8.5)
    from nvalchemi_ase.md import VelocityVerlet

    # a composed model's run: its pipeline hook leaves its sources on the batch
    composed_run = VelocityVerlet(
        atoms.copy(), 1.0, model=composed, device="cpu", dtype="float64"
    )
    composed_run.run(1)
    live = {
        "BaseDynamics": dyn.engine,
        "NeighborListHook": next(h for h in dyn.engine.hooks if is_neighbor_hook(h)),
        "PipelineModelWrapper": composed,
        "_PipelineNeighborListHook": composed.make_neighbor_hooks()[0],
        "Batch": composed_run.batch,
    }
    missing = [
        f"{owner}.{name}"
        for owner, names in PRIVATE_ATTRIBUTES.items()
        for name in names
        if not hasattr(live[owner], name)
    ]
    assert missing == []


def test_private_nvalchemi_names_appear_only_in_the_compat_module():
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "_compat.py":
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                parts = node.module.split(".")
                if parts[0] == "nvalchemi" and any(p.startswith("_") for p in parts):
                    offenders.append(f"{path.name}: from {node.module}")
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == (
                "import_quietly"
            ):
                target = node.args[0]
                if (
                    isinstance(target, ast.Constant)
                    and any(
                        part.startswith("_") for part in str(target.value).split(".")
                    )
                    and str(target.value).startswith("nvalchemi.")
                ):
                    offenders.append(f"{path.name}: {target.value}")
    assert offenders == []


def test_compat_module_imports_nothing_heavy_at_import_time():
    module = importlib.import_module("nvalchemi_ase._compat")
    assert "import torch" not in inspect.getsource(module).split("if TYPE_CHECKING")[0]


def test_npt_state_holds_the_chain_velocities_the_workaround_pads():
    from ase.build import bulk

    from nvalchemi_ase import NVAlchemiCalculator
    from nvalchemi_ase.engines.mtk import _CHAIN_VELOCITIES
    from nvalchemi_ase.md import IsotropicMTKNPT

    atoms = bulk("Ar", "fcc", a=5.26, cubic=True)
    atoms.set_momenta(np.random.default_rng(1).normal(0.0, 1.0, (len(atoms), 3)))
    atoms.calc = NVAlchemiCalculator("lj", device="cpu", dtype="float64")
    dyn = IsotropicMTKNPT(
        atoms, 1.0, temperature_K=50.0, pressure_au=0.0, tdamp=100.0, pdamp=1000.0
    )
    dyn.run(1)
    state = dyn.engine._state
    assert [key for key in _CHAIN_VELOCITIES if getattr(state, key, None) is None] == []


@functools.cache
def _scan() -> tuple[PackageScan, tuple]:
    """The package's scan and its accesses, once per process."""
    scan = PackageScan(PACKAGE)
    return scan, tuple(scan.accesses())


# module-scoped: the tests that use the scan then share one pytest-xdist worker
# (tests/conftest.py), so the package is scanned once, not once per worker
@pytest.fixture(scope="module")
def package_scan():
    return _scan()[0]


@pytest.fixture(scope="module")
def accesses():
    """Every use of a private nvalchemi name in the package (one scan)."""
    return _scan()[1]


def _is_subclass_hook_use(access):
    """A documented ``BaseDynamics`` hook, on ``self`` in a class deriving from it."""
    on_self = access.receiver in ("self", "super()", "class body")
    return access.name in SUBCLASS_HOOKS and on_self and access.owner is not None


def test_private_nvalchemi_attributes_are_used_only_in_the_compat_module(
    accesses,
):
    offenders = [
        str(access)
        for access in accesses
        if access.path.name != "_compat.py" and not _is_subclass_hook_use(access)
    ]
    assert offenders == [], "wrap these in nvalchemi_ase/_compat.py"


def test_compat_lists_every_private_nvalchemi_attribute_it_uses(accesses):
    used = {access.name for access in accesses if access.path.name == "_compat.py"}
    assert sorted(used - LISTED) == [], "add them to PRIVATE_MEMBERS/ATTRIBUTES"
    assert set(SUBCLASS_HOOKS) <= LISTED


def test_documented_subclass_hooks_are_nvalchemis(package_scan, accesses):
    """The allowance covers real nvalchemi names, and the engines do use them."""
    from tests._nvalchemi_private import class_names

    base_dynamics = import_quietly("nvalchemi.dynamics.base").BaseDynamics
    assert set(SUBCLASS_HOOKS) <= class_names(base_dynamics)
    used = {a.name for a in accesses if _is_subclass_hook_use(a)}
    assert used == set(SUBCLASS_HOOKS)
    # a name both libraries define is not judged on other objects: none of
    # the names _compat wraps may become one
    assert sorted(ambiguous_names(package_scan) & LISTED) == []


SCANNED_EXAMPLE = """
from nvalchemi.dynamics.base import BaseDynamics
from nvalchemi_ase._quiet import import_quietly
from nvalchemi_ase.example import helper_module

Hook = import_quietly("nvalchemi.hooks").NeighborListHook


class Engine(BaseDynamics):
    _post_update_is_noop = True  # flagged: BaseDynamics' class attribute

    def _init_state(self, batch):  # flagged, as a documented subclass hook
        self._state = None  # flagged, as a documented subclass hook
        self._random_seed = 1  # flagged: BaseDynamics reads it
        self._own_counter = 0  # ours: no nvalchemi class defines it


class Engine2(Engine):
    def step(self, batch):
        super()._sync_state_to_batch(None, 0, batch)  # flagged (subclass hook)


class Skipping(Hook):
    def __call__(self, ctx, stage):
        return self._ref_positions  # flagged: NeighborListHook's


class Recorder:
    def __init__(self):
        self._cache = {}  # ours: a class of the package that is not nvalchemi's
        self._state = None  # ours too

    def read(self, engine, batch, network):
        helper_module._ensure_bookkeeping_fields(batch)  # ours: a package module
        network._modules  # torch's
        getattr(batch, "_neighbor_list_cutoff", None)  # flagged
        batch.__dict__.get("_pipeline_neighbor_sources")  # flagged: instance dict
        vars(engine)["_forces_primed"]  # flagged
        self.__dict__.get("_cache")  # ours
        return engine._admission_initialized  # flagged
"""


# with the scan's tests on one worker: nvalchemi's names (read from its whole
# installed source, cached per process) are then read once, not on both workers
@pytest.mark.xdist_group("tests/test_compat.py")
def test_attribute_scan_flags_nvalchemi_names_and_spares_the_packages(tmp_path):
    package = tmp_path / "nvalchemi_ase"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "example.py").write_text(SCANNED_EXAMPLE)
    found = {(access.name, access.owner) for access in PackageScan(package).accesses()}
    assert found == {
        ("_post_update_is_noop", "Engine"),
        ("_init_state", "Engine"),
        ("_state", "Engine"),
        ("_random_seed", "Engine"),
        ("_sync_state_to_batch", "Engine2"),
        ("_ref_positions", "Skipping"),
        ("_neighbor_list_cutoff", "Recorder"),
        ("_pipeline_neighbor_sources", "Recorder"),
        ("_forces_primed", "Recorder"),
        ("_admission_initialized", "Recorder"),
    }


def test_engine_seed_is_the_seed_nvalchemi_saves_and_restores():
    from nvalchemi_ase import NVAlchemiCalculator
    from nvalchemi_ase.engines import NVTBussi

    model = NVAlchemiCalculator("lj", device="cpu", dtype="float64").model
    engine = NVTBussi(model, dt=1.0, temperature=50.0, taut=100.0, random_seed=3)
    assert engine_seed(engine) == engine.random_seed == 3
    set_engine_seed(engine, 7)
    assert engine.state_dict()["random_seed"] == 7
    engine.load_state_dict({"step_count": 0, "random_seed": 11})
    assert engine_seed(engine) == engine.random_seed == 11


def test_engines_whose_post_update_does_nothing_say_so():
    from nvalchemi_ase.engines import ASEBFGS, ASEFIRE, ASEMDMin, NVTBussi

    assert [e._post_update_is_noop for e in (ASEFIRE, ASEBFGS, ASEMDMin)] == [True] * 3
    assert NVTBussi._post_update_is_noop is False  # its post_update works
