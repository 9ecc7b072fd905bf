"""``to_dataframe``: one row per structure, each its own numbers, nothing evaluated."""

from __future__ import annotations

import numpy as np
import pytest
from ase import units
from ase.build import bulk, molecule
from ase.calculators.lj import LennardJones
from ase.io import read, write

from nvalchemi_ase import NVAlchemiCalculator, to_dataframe
from nvalchemi_ase.md import VelocityVerlet
from nvalchemi_ase.optimize import FIRE
from nvalchemi_ase.runners import relax
from tests.structures import A_AR

pandas = pytest.importorskip("pandas")


@pytest.fixture(scope="module")
def lj64():
    return NVAlchemiCalculator("lj", device="cpu", dtype="float64")


def _argon_cells():
    cells = []
    for seed, repeat in enumerate([(1, 1, 1), (2, 1, 1), (2, 2, 2)]):
        atoms = bulk("Ar", "fcc", a=A_AR, cubic=True) * repeat
        atoms.rattle(0.05, seed=seed)
        cells.append(atoms)
    return cells


def _count_calls(model):
    calls = []
    handle = model.register_forward_hook(lambda *args: calls.append(1))
    return calls, handle


def test_optimizer_table_has_each_structures_own_numbers(lj64):
    images = _argon_cells()
    for atoms in images:
        atoms.calc = lj64
    opt = FIRE(images, logfile=None)
    opt.run(fmax=0.01, steps=200)
    calls, handle = _count_calls(lj64.model)
    table = to_dataframe(opt)
    handle.remove()
    assert calls == []  # read, never evaluated
    assert list(table.index) == [0, 1, 2]
    assert list(table["natoms"]) == [4, 8, 32]
    assert list(table["formula"]) == ["Ar4", "Ar8", "Ar32"]
    for k, atoms in enumerate(images):
        reference = atoms.copy()
        reference.calc = NVAlchemiCalculator(lj64.model, device="cpu", dtype="float64")
        assert table["energy"][k] == pytest.approx(
            reference.get_potential_energy(), abs=1e-10
        )
        fmax = np.linalg.norm(reference.get_forces(), axis=1).max()
        assert table["fmax"][k] == pytest.approx(fmax, abs=1e-10)
    assert table["converged"].all()
    assert list(table["converged_at_step"]) == list(opt.converged_at_step)
    assert not table["failed"].any()
    assert table.attrs["units"]["energy"] == "eV"


def test_md_table_temperatures_match_ase(lj64):
    images = _argon_cells()
    rng = np.random.default_rng(0)
    for atoms in images:
        atoms.calc = lj64
        atoms.set_momenta(rng.normal(0.0, 0.5, (len(atoms), 3)))
    dyn = VelocityVerlet(images, 2 * units.fs)
    dyn.run(5)
    table = to_dataframe(dyn)
    for k, atoms in enumerate(images):
        assert table["temperature"][k] == pytest.approx(atoms.get_temperature())
        assert table["ekin"][k] == pytest.approx(atoms.get_kinetic_energy())
        assert table["volume"][k] == pytest.approx(atoms.get_volume())


def test_runner_results_and_files_give_the_same_table(lj64, tmp_path):
    results = relax(_argon_cells(), lj64, fmax=0.01)
    table = to_dataframe(results)
    assert list(table["index"]) == [0, 1, 2]
    assert table["converged"].all()
    for k, atoms in enumerate(results):
        assert table["energy"][k] == atoms.get_potential_energy()
        assert table["steps"][k] == atoms.info["steps"]
    write(tmp_path / "relaxed.extxyz", results)
    again = to_dataframe(read(tmp_path / "relaxed.extxyz", ":"))
    np.testing.assert_allclose(again["energy"], table["energy"], rtol=1e-12)
    # extxyz stores forces with 8 decimals
    np.testing.assert_allclose(again["fmax"], table["fmax"], atol=1e-7)


def test_any_calculator_and_missing_results():
    argon = bulk("Ar", "fcc", a=A_AR, cubic=True)
    argon.calc = LennardJones(sigma=3.4, epsilon=0.0104, rc=8.5)
    argon.get_forces()
    water = molecule("H2O")  # no calculator: nothing is evaluated
    table = to_dataframe([argon, water])
    assert table["energy"][0] == pytest.approx(argon.get_potential_energy())
    assert np.isnan(table["energy"][1])
    assert np.isnan(table["volume"][1])
    with pytest.raises(TypeError, match="list of Atoms"):
        to_dataframe("relaxed.extxyz")
