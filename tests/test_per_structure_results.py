"""One calculator shared by structures of different sizes: each keeps its own results.

The reference for every number is a fresh calculator evaluating a copy of that
structure alone.
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import pytest
from ase import Atoms
from ase.build import bulk, molecule
from ase.db import connect
from ase.io import read, write
from ase.io.trajectory import Trajectory

from nvalchemi_ase import NVAlchemiCalculator
from nvalchemi_ase.optimize import FIRE

# Same float64 model, same structure, evaluated alone or in a batch.
SAME_MODEL_RTOL = 1e-12
# extxyz writes per-atom floats with 8 decimals.
EXTXYZ_ATOL = 1e-8


def _mixed() -> list[Atoms]:
    """Argon cells of 4, 8 and 12 atoms and a 3-atom cluster, rattled."""
    images = [bulk("Ar", "fcc", a=5.3, cubic=True) * (1, 1, n) for n in (1, 2, 3)]
    cluster = Atoms("Ar3", positions=[[0, 0, 0], [3.8, 0, 0], [1.9, 3.3, 0]])
    cluster.center(vacuum=6.0)
    images.append(cluster)
    for index, atoms in enumerate(images):
        atoms.rattle(0.05, seed=index)
    return images


def _alone(atoms: Atoms) -> dict[str, np.ndarray | float]:
    calc = NVAlchemiCalculator("lj", device="cpu", dtype="float64")
    copy = atoms.copy()
    copy.calc = calc
    return {"energy": copy.get_potential_energy(), "forces": copy.get_forces()}


def _assert_own(
    energy: float, forces: np.ndarray, atoms: Atoms, atol: float = 1e-14
) -> None:
    expected = _alone(atoms)
    assert energy == pytest.approx(expected["energy"], rel=SAME_MODEL_RTOL)
    np.testing.assert_allclose(
        forces, expected["forces"], rtol=SAME_MODEL_RTOL, atol=atol
    )


@pytest.fixture(params=["batched run", "calculate_batch", "one by one"])
def evaluated(request):
    """Structures sharing one calculator, after batched or ASE-style evaluations."""
    calc = NVAlchemiCalculator("lj", device="cpu", dtype="float64")
    images = _mixed()
    for atoms in images:
        atoms.calc = calc
    if request.param == "batched run":
        FIRE(images, logfile=None).run(fmax=0.05, steps=5)
    elif request.param == "calculate_batch":
        calc.calculate_batch(images)
    else:
        for atoms in images:
            atoms.get_potential_energy()
    return images, calc


def test_every_path_gives_each_structure_its_own_numbers(evaluated, tmp_path):
    images, calc = evaluated
    for atoms in images:
        _assert_own(atoms.get_potential_energy(), atoms.get_forces(), atoms)
        _assert_own(atoms.calc.results["energy"], atoms.calc.results["forces"], atoms)
        assert isinstance(atoms.calc, NVAlchemiCalculator)
        assert atoms.calc.model is calc.model
    write(tmp_path / "out.extxyz", images)
    for atoms, back in zip(images, read(tmp_path / "out.extxyz", ":"), strict=True):
        _assert_own(back.get_potential_energy(), back.get_forces(), atoms, EXTXYZ_ATOL)
    with Trajectory(tmp_path / "out.traj", "w") as traj:
        for atoms in images:
            traj.write(atoms)
    for atoms, back in zip(images, read(tmp_path / "out.traj", ":"), strict=True):
        _assert_own(back.get_potential_energy(), back.get_forces(), atoms)
    with connect(tmp_path / "out.db") as db:
        ids = [db.write(atoms) for atoms in images]
    with connect(tmp_path / "out.db") as db:
        for atoms, row_id in zip(images, ids, strict=True):
            row = db.get(id=row_id)
            _assert_own(row.energy, row.forces, atoms)


def test_copies_carry_no_stale_results(evaluated):
    images, _ = evaluated
    for atoms in images:
        assert atoms.copy().calc is None  # ASE's rule: a copy has no calculator


def test_views_share_the_model_and_a_later_batched_run(evaluated):
    images, _ = evaluated
    # the views are accepted as one model by a new batched run
    FIRE(images, logfile=None).run(fmax=0.05, steps=2)
    for atoms in images:
        _assert_own(atoms.get_potential_energy(), atoms.get_forces(), atoms)
    # a moved structure is evaluated again, not answered from a stale cache
    images[1].positions[0] += 0.05
    _assert_own(images[1].get_potential_energy(), images[1].get_forces(), images[1])


def test_structure_of_other_atoms_count_after_sharing(evaluated):
    images, calc = evaluated
    extra = molecule("H2O")
    extra.center(vacuum=5.0)
    extra.numbers[:] = 18  # LJ is one species; any element would do
    extra.calc = calc
    _assert_own(extra.get_potential_energy(), extra.get_forces(), extra)
    for atoms in images:
        _assert_own(atoms.calc.results["energy"], atoms.calc.results["forces"], atoms)


@contextmanager
def _model_calls(model):
    """Count forward calls of ``model`` inside the block."""
    calls = []
    handle = model.register_forward_hook(lambda *_: calls.append(1))
    try:
        yield calls
    finally:
        handle.remove()


def test_calculate_batch_results_reach_every_ase_path_without_a_model_call(tmp_path):
    calc = NVAlchemiCalculator("lj", device="cpu", dtype="float64")
    images = _mixed()
    for atoms in images:
        atoms.calc = calc
    with _model_calls(calc.model) as calls:
        returned = calc.calculate_batch(images, ["energy", "forces", "stress"])
    assert len(calls) == 1
    with _model_calls(calc.model) as calls:
        for atoms, result in zip(images, returned, strict=True):
            assert atoms.get_potential_energy() == result["energy"]
            np.testing.assert_array_equal(atoms.get_forces(), result["forces"])
            np.testing.assert_array_equal(atoms.get_stress(), result["stress"])
            assert atoms.calc.results["energy"] == result["energy"]
        assert calc.results["energy"] == returned[0]["energy"]  # calc: images[0]
        write(tmp_path / "out.extxyz", images)
        write(tmp_path / "out.traj", images)
        with connect(tmp_path / "out.db") as db:
            ids = [db.write(atoms) for atoms in images]
    assert not calls
    extxyz = read(tmp_path / "out.extxyz", ":")
    traj = read(tmp_path / "out.traj", ":")
    with connect(tmp_path / "out.db") as db:
        rows = [db.get(id=row_id) for row_id in ids]
    for k, atoms in enumerate(images):
        _assert_own(
            extxyz[k].get_potential_energy(), extxyz[k].get_forces(), atoms, EXTXYZ_ATOL
        )
        _assert_own(traj[k].get_potential_energy(), traj[k].get_forces(), atoms)
        _assert_own(rows[k].energy, rows[k].forces, atoms)
        np.testing.assert_allclose(
            traj[k].get_stress(),
            returned[k]["stress"],
            rtol=SAME_MODEL_RTOL,
            atol=1e-14,
        )


def test_moving_one_structure_invalidates_only_its_results():
    calc = NVAlchemiCalculator("lj", device="cpu", dtype="float64")
    images = _mixed()
    for atoms in images:
        atoms.calc = calc
    calc.calculate_batch(images)
    images[2].positions[0] += 0.05
    with _model_calls(calc.model) as calls:
        answers = [(a.get_potential_energy(), a.get_forces()) for a in images]
    assert len(calls) == 1  # images[2] only
    for atoms, (energy, forces) in zip(images, answers, strict=True):
        _assert_own(energy, forces, atoms)


def test_calculate_batch_leaves_other_calculators_alone():
    calc = NVAlchemiCalculator("lj", device="cpu", dtype="float64")
    other = NVAlchemiCalculator(calc.model, device="cpu", dtype="float64")
    images = _mixed()
    images[0].calc = other
    images[1].calc = calc
    calc.calculate_batch(images)
    assert images[0].calc is other
    assert not other.results
    assert images[1].calc is calc
    assert all(atoms.calc is None for atoms in images[2:])


def test_returned_arrays_are_the_callers_own():
    calc = NVAlchemiCalculator("lj", device="cpu", dtype="float64")
    images = _mixed()
    for atoms in images:
        atoms.calc = calc
    returned = calc.calculate_batch(images)
    returned[1]["forces"][:] = 0.0
    _assert_own(images[1].get_potential_energy(), images[1].get_forces(), images[1])
