"""Contract test: every private nvalchemi member the package uses still exists.

An upstream change to one of them fails here, by name, instead of somewhere
in a physics test.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import numpy as np
import pytest

import nvalchemi_ase
from nvalchemi_ase._compat import PRIVATE_ATTRIBUTES, PRIVATE_MEMBERS
from nvalchemi_ase._quiet import import_quietly

PACKAGE = Path(nvalchemi_ase.__file__).parent


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
    live = {
        "BaseDynamics": dyn.engine,
        "NeighborListHook": next(h for h in dyn.engine.hooks if is_neighbor_hook(h)),
        "PipelineModelWrapper": composed,
        "_PipelineNeighborListHook": composed.make_neighbor_hooks()[0],
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
