"""One calculator shared by structures of different sizes: each keeps its own results.

The reference for every number is a fresh calculator evaluating a copy of that
structure alone.
"""

from __future__ import annotations

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


@pytest.fixture(params=["batched run", "one by one"])
def evaluated(request):
    """Structures sharing one calculator, after a batched run or ASE-style calls."""
    calc = NVAlchemiCalculator("lj", device="cpu", dtype="float64")
    images = _mixed()
    for atoms in images:
        atoms.calc = calc
    if request.param == "batched run":
        FIRE(images, logfile=None).run(fmax=0.05, steps=5)
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
