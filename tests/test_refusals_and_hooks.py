"""Refused calls leave the user's objects alone; nvalchemi's hooks cost one structure.

* Every entry point given a list with an empty ``Atoms`` (or a structure the
  model refuses) raises or reports it, and every ``Atoms`` passed in is, field
  by field, what it was (``calc`` included).
* ``NaNDetectorHook`` attached to a batched run, with one structure whose
  forces turn NaN (in the first evaluation or later), no longer stops the
  batch: that structure is reported in ``dyn.failures`` and the others end
  where a run without it ends.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import numpy as np
import pytest
import torch
from ase import Atoms
from ase.build import bulk

from nvalchemi_ase import NVAlchemiCalculator
from nvalchemi_ase.models import load_model

#: The same float64 LJ numbers for a structure, whatever shares its batch.
POSITION_TOL = 1e-10  # Å


def _state(atoms: Atoms) -> dict:
    return {
        "arrays": {k: v.copy() for k, v in atoms.arrays.items()},
        "cell": atoms.cell.array.copy(),
        "pbc": atoms.pbc.copy(),
        "info": copy.deepcopy(atoms.info),
        "calc": atoms.calc,
        "constraints": list(atoms.constraints),
    }


def _assert_untouched(atoms: Atoms, state: dict) -> None:
    assert atoms.calc is state["calc"]
    assert set(atoms.arrays) == set(state["arrays"])
    for key, value in state["arrays"].items():
        np.testing.assert_array_equal(atoms.arrays[key], value)
    np.testing.assert_array_equal(atoms.cell.array, state["cell"])
    np.testing.assert_array_equal(atoms.pbc, state["pbc"])
    assert atoms.info == state["info"]
    assert atoms.constraints == state["constraints"]


def _argon() -> Atoms:
    atoms = bulk("Ar", "fcc", a=5.26, cubic=True)
    atoms.rattle(0.02, seed=3)
    atoms.info["tag"] = "mine"
    return atoms


def _shared_calc_call(images: list[Atoms]) -> None:
    calc = NVAlchemiCalculator("lj", device="cpu")
    for atoms in images:
        atoms.calc = calc
    images[0].get_potential_energy()  # the calculator now belongs to images[0]
    images[1].get_potential_energy()  # refused: must not leave a view on it


def _entry_points() -> dict[str, Callable[[list[Atoms]], object]]:
    from nvalchemi_ase.md import VelocityVerlet
    from nvalchemi_ase.optimize import FIRE
    from nvalchemi_ase.runners import relax, single_points

    calc = NVAlchemiCalculator("lj", device="cpu")
    return {
        "calculate_batch": calc.calculate_batch,
        "calc.get_potential_energy": lambda im: calc.get_potential_energy(im[1]),
        "shared calculator": _shared_calc_call,
        "FIRE": lambda im: FIRE(im, model="lj").run(fmax=0.1, steps=2),
        "VelocityVerlet": lambda im: VelocityVerlet(im, 1.0, model="lj").run(2),
        "single_points": lambda im: single_points(im, "lj"),
        "relax": lambda im: relax(im, "lj", steps=2),
    }


@pytest.mark.parametrize("name", list(_entry_points()))
def test_a_refused_call_touches_no_user_object(name):
    call = _entry_points()[name]
    images = [_argon(), Atoms()]
    if name == "shared calculator":
        states = None  # the test itself attaches the calculator
    else:
        states = [_state(atoms) for atoms in images]
    message = None
    try:
        call(images)
    except ValueError as error:  # StructureError is one
        message = str(error)
    assert message is None or "no atoms" in message
    if name == "shared calculator":
        assert images[1].calc is images[0].calc  # still the one the user set
        return
    for atoms, state in zip(images, states, strict=True):
        _assert_untouched(atoms, state)


# -- nvalchemi's NaNDetectorHook ---------------------------------------------------


def _nan_model(bad_size: int, after_calls: int) -> torch.nn.Module:
    """LJ with NaN forces after ``after_calls`` calls in ``bad_size``-atom cells."""
    model = load_model("lj")
    base = type(model)

    class NaNForcesLJ(base):  # type: ignore[misc, valid-type]
        calls = 0

        def forward(self, data, **kwargs):
            out = super().forward(data, **kwargs)
            type(self).calls += 1
            forces = out.get("forces")
            if type(self).calls > after_calls and forces is not None:
                counts = torch.bincount(data.batch_idx.long())
                bad = (counts == bad_size)[data.batch_idx.long()]
                out["forces"] = torch.where(
                    bad[:, None], torch.full_like(forces, float("nan")), forces
                )
            return out

    model.__class__ = NaNForcesLJ
    return model


def _images() -> list[Atoms]:
    cell = bulk("Ar", "fcc", a=5.26, cubic=True)
    images = [cell.copy(), cell[:2], cell.repeat((1, 1, 2))]  # 4, 2 (bad), 8 atoms
    for k, atoms in enumerate(images):
        atoms.rattle(0.05, seed=k)
    return images


def _run(kind: str, images: list[Atoms], model: torch.nn.Module, hook: bool) -> object:
    from nvalchemi.dynamics.hooks import NaNDetectorHook

    from nvalchemi_ase.md import VelocityVerlet
    from nvalchemi_ase.optimize import FIRE

    if kind == "md":
        dyn = VelocityVerlet(images, 1.0, model=model)
    else:
        dyn = FIRE(images, model=model, logfile=None)
    if hook:
        dyn.attach(NaNDetectorHook())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if kind == "md":
            dyn.run(8)
        else:
            dyn.run(fmax=1e-6, steps=8)
    return dyn


@pytest.mark.parametrize("kind", ["md", "optimizer"])
@pytest.mark.parametrize("after_calls", [0, 3], ids=["at priming", "later"])
@pytest.mark.parametrize("reads_free", [True, False], ids=["cpu", "gpu-like"])
def test_nan_detector_costs_one_structure(kind, after_calls, reads_free, monkeypatch):
    from nvalchemi_ase import devices

    if not reads_free:  # an accelerator's path: flags stay on the device
        monkeypatch.setattr(devices, "host_reads_are_free", lambda device: False)
    images = _images()
    dyn = _run(kind, images, _nan_model(2, after_calls), hook=True)
    assert [f.index for f in dyn.failures] == [1]
    assert "non-finite" in dyn.failures[0].reason
    alone = [images_k.copy() for images_k in _images()]
    reference = [alone[0], alone[2]]
    _run(kind, reference, load_model("lj"), hook=False)
    for atoms, expected in zip([images[0], images[2]], reference, strict=True):
        np.testing.assert_allclose(
            atoms.positions, expected.positions, rtol=0, atol=POSITION_TOL
        )
    assert np.isfinite(images[1].positions).all()  # kept its last finite state
