"""Batched equations of state vs ASE's EquationOfState on one-by-one evaluations."""

from __future__ import annotations

import json

import numpy as np
import pytest
from ase import units
from ase.build import bulk
from ase.eos import EquationOfState
from ase.filters import FrechetCellFilter
from ase.optimize import BFGS

from nvalchemi_ase.properties import _common, equation_of_state
from tests.helpers import assert_same_snapshot, snapshot
from tests.structures import A_AR

# Relaxations to FMAX leave energies off by ~ FMAX² / k: far below these.
FMAX = 1e-4
RELAXED_RTOL = 1e-6


def _materials():
    rattled = bulk("Ar", "fcc", a=A_AR, cubic=True).repeat((2, 1, 1))
    rattled.rattle(0.04, seed=3)
    return [
        bulk("Ar", "fcc", a=A_AR, cubic=True),
        bulk("Ar", "fcc", a=5.3),  # primitive cell
        rattled,
    ]


def _sequential(calc, atoms, factors, *, relax=False):
    """(V, E) one structure at a time with ASE's own optimizer; fitted V0, B (GPa)."""
    volumes, energies = [], []
    for factor in factors:
        scaled = atoms.copy()
        scaled.set_cell(atoms.cell.array * factor, scale_atoms=True)
        scaled.calc = calc
        if relax:
            BFGS(scaled, logfile=None).run(fmax=FMAX, steps=1000)
        volumes.append(scaled.get_volume())
        energies.append(scaled.get_potential_energy())
    fit = EquationOfState(volumes, energies, eos="birchmurnaghan")
    v0, _, bulk_modulus = fit.fit(warn=False)
    return np.array(volumes), np.array(energies), v0, bulk_modulus / units.GPa


def test_static_eos_matches_ase_one_by_one(lj_calc64):
    materials = _materials()
    before = [snapshot(atoms) for atoms in materials]
    results = equation_of_state(materials, lj_calc64)
    factors = np.linspace(0.95, 1.05, 7)
    for atoms, result, seen in zip(materials, results, before, strict=True):
        assert result.ok, result.error
        volumes, energies, v0, bulk_modulus = _sequential(lj_calc64, atoms, factors)
        np.testing.assert_allclose(result.volumes, volumes, rtol=1e-12)
        np.testing.assert_allclose(result.energies, energies, rtol=1e-10)
        assert result.v0 == pytest.approx(v0, rel=1e-6)
        assert pytest.approx(bulk_modulus, rel=1e-6) == result.B
        assert result.natoms == len(atoms)
        assert_same_snapshot(seen, atoms)
    # cell0 is the cell scaled to V0: its volume is V0
    first = results[0]
    assert abs(np.linalg.det(first.cell0)) == pytest.approx(first.v0, rel=1e-12)


def test_static_eos_is_one_batched_call(lj_calc64, monkeypatch):
    calls = []
    original = lj_calc64.calculate_batch

    def counting(images, properties=("energy", "forces")):
        calls.append(len(images))
        return original(images, properties)

    monkeypatch.setattr(lj_calc64, "calculate_batch", counting)
    equation_of_state(_materials(), lj_calc64, n_volumes=5)
    assert calls == [15]


def test_ion_relaxed_eos_matches_ase_relaxations_and_is_one_run(lj_calc64, monkeypatch):
    runs = []
    original = _common._run_in_flight

    def counting(optimizer_class, calc, derived, selected, **kwargs):
        runs.append(len(selected))
        return original(optimizer_class, calc, derived, selected, **kwargs)

    monkeypatch.setattr(_common, "_run_in_flight", counting)
    materials = _materials()
    results = equation_of_state(
        materials, lj_calc64, n_volumes=5, relax="ions", fmax=FMAX, optimizer="LBFGS"
    )
    # one in-flight run; the fcc cells have no forces and stay out of it
    assert runs == [5]
    factors = np.linspace(0.95, 1.05, 5)
    for atoms, result in zip(materials, results, strict=True):
        assert result.ok, result.error
        _, energies, v0, bulk_modulus = _sequential(
            lj_calc64, atoms, factors, relax=True
        )
        np.testing.assert_allclose(result.energies, energies, rtol=RELAXED_RTOL)
        assert result.v0 == pytest.approx(v0, rel=RELAXED_RTOL)
        assert pytest.approx(bulk_modulus, rel=1e-4) == result.B
        assert (result.relax_steps >= 0).all()
    assert (results[0].relax_steps == 0).all()
    assert (results[2].relax_steps > 0).all()
    # the rattled crystal relaxes back to fcc: twice the 4-atom cell's energy
    np.testing.assert_allclose(
        results[2].energies, 2 * results[0].energies, rtol=RELAXED_RTOL
    )


@pytest.mark.parametrize("cell_optimizer", ["FIRE2", "BFGS"])
def test_relax_first_starts_from_the_relaxed_cell(cell_optimizer, lj_calc64):
    start = bulk("Ar", "fcc", a=5.45, cubic=True)  # under tension
    (result,) = equation_of_state(
        start, lj_calc64, relax_first=True, fmax=FMAX, cell_optimizer=cell_optimizer
    )
    assert result.ok, result.error
    reference = start.copy()
    reference.calc = lj_calc64
    BFGS(FrechetCellFilter(reference), logfile=None).run(fmax=FMAX, steps=1000)
    np.testing.assert_allclose(
        result.reference_cell, reference.cell.array, rtol=1e-4, atol=1e-4
    )
    _, _, v0, bulk_modulus = _sequential(
        lj_calc64, reference, np.linspace(0.95, 1.05, 7)
    )
    assert result.v0 == pytest.approx(v0, rel=1e-4)
    assert pytest.approx(bulk_modulus, rel=1e-3) == result.B
    # the relaxed cell is near the LJ minimum, so V0 is close to its volume
    assert result.v0 == pytest.approx(reference.get_volume(), rel=2e-2)


def test_shape_relaxed_eos_matches_ases_constant_volume_relaxations(lj_calc64):
    # hcp argon with c/a far from ideal: at each volume the shape relaxes
    start = bulk("Ar", "hcp", a=3.65, c=3.65 * 1.75)  # near V0, c/a not ideal
    factors = np.linspace(0.97, 1.03, 5)
    (shape,) = equation_of_state(
        start,
        lj_calc64,
        n_volumes=5,
        strain=0.03,
        relax="shape",
        fmax=FMAX,
        cell_optimizer="LBFGS",
    )
    (fixed,) = equation_of_state(start, lj_calc64, n_volumes=5, strain=0.03)
    assert shape.ok, shape.error
    np.testing.assert_allclose(shape.volumes, fixed.volumes, rtol=1e-12)
    assert (shape.energies < fixed.energies - 1e-4).all()  # the shape did relax
    for factor, volume, energy in zip(
        factors, shape.volumes, shape.energies, strict=True
    ):
        reference = start.copy()
        reference.set_cell(start.cell * factor, scale_atoms=True)
        reference.calc = lj_calc64
        BFGS(FrechetCellFilter(reference, constant_volume=True), logfile=None).run(
            fmax=FMAX, steps=1000
        )
        assert reference.get_volume() == pytest.approx(volume, rel=1e-9)
        assert energy == pytest.approx(reference.get_potential_energy(), abs=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"n_volumes": 3}, "n_volumes"),
        ({"strain": 0.7}, "strain"),
        ({"eos": "nonsense"}, "eos"),
        ({"relax": "cell"}, "relax"),
        ({"optimizer": "MDMin"}, "optimizer"),
        ({"cell_optimizer": "MDMin"}, "cell_optimizer"),
    ],
)
def test_invalid_arguments_are_refused(lj_calc64, kwargs, match):
    with pytest.raises(ValueError, match=match):
        equation_of_state(bulk("Ar", "fcc", a=A_AR), lj_calc64, **kwargs)


def test_a_failing_material_is_reported_and_the_others_finish(lj_calc64):
    good = bulk("Ar", "fcc", a=A_AR, cubic=True)
    overlapping = good.copy()
    overlapping.positions[1] = overlapping.positions[0] + [0.01, 0.0, 0.0]
    molecule = good.copy()
    molecule.pbc = False
    results = equation_of_state([good, overlapping, molecule, good], lj_calc64)
    assert [r.ok for r in results] == [True, False, False, True]
    assert "StructureError" in results[1].error
    assert "periodic" in results[2].error
    assert results[1].v0 is None
    assert results[1].B is None
    (alone,) = equation_of_state(good, lj_calc64)
    for index in (0, 3):
        assert results[index].v0 == pytest.approx(alone.v0, rel=1e-12)


def test_a_fit_without_a_minimum_fails_that_material_only(lj_calc64):
    compressed = bulk("Ar", "fcc", a=4.6, cubic=True)  # far below the minimum
    results = equation_of_state(
        [compressed, bulk("Ar", "fcc", a=A_AR)], lj_calc64, strain=0.02
    )
    assert not results[0].ok
    assert "EOS failed" in results[0].error
    assert results[1].ok


def test_results_serialise_to_strict_json_with_units(lj_calc64):
    (result,) = equation_of_state(bulk("Ar", "fcc", a=A_AR), lj_calc64)
    data = json.loads(json.dumps(result.to_dict(), allow_nan=False))
    assert data["units"]["B"] == "GPa"
    assert data["units"]["v0"] == "Å^3"
    assert len(data["volumes"]) == 7
    assert "fit" not in data


@pytest.mark.parametrize("relax", [None, "ions"])
def test_eos_scan_file_gives_ase_gui_the_same_fit(lj_calc64, tmp_path, relax):
    """The multi-frame scan, read as ``ase gui`` reads it, fits the same E(V)."""
    from ase.gui.images import Images
    from ase.io import read

    materials = _materials()
    results = equation_of_state(materials, lj_calc64, relax=relax, fmax=FMAX)
    for k, result in enumerate(results):
        path = tmp_path / f"material-{k}-eos.extxyz"
        result.write(path)
        frames = read(path, ":")
        assert len(frames) == len(result.volumes)
        # what Tools -> Bulk modulus does (ase/gui/gui.py::bulk_modulus)
        images = Images()
        images.initialize(frames)
        volumes = [abs(np.linalg.det(atoms.cell)) for atoms in images]
        energies = [images.get_energy(atoms) for atoms in images]
        np.testing.assert_allclose(volumes, result.volumes, rtol=1e-10)
        np.testing.assert_allclose(energies, result.energies, rtol=1e-10)
        fit = EquationOfState(volumes, energies, eos=result.eos)
        v0, _, bulk_modulus = fit.fit(warn=False)
        assert v0 == pytest.approx(result.v0, rel=1e-8)
        assert bulk_modulus / units.GPa == pytest.approx(result.B, rel=1e-6)
        # the GUI fits its own default form (Stabilized Jellium) to the same points
        gui_v0 = EquationOfState(volumes, energies).fit(warn=False)[0]
        assert gui_v0 == pytest.approx(result.v0, rel=1e-3)
        # each frame's positions are those its energy belongs to
        for frame, energy in zip(frames, result.energies, strict=True):
            frame.calc = lj_calc64
            assert frame.get_potential_energy() == pytest.approx(energy, abs=1e-8)


def test_failed_material_has_no_scan_to_write(lj_calc64, tmp_path):
    from ase import Atoms

    (result,) = equation_of_state(Atoms("Ar", pbc=False), lj_calc64)
    assert not result.ok
    with pytest.raises(ValueError, match="no EOS frames"):
        result.write(tmp_path / "x.extxyz")
