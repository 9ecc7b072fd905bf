"""Batched phonons vs phonopy driven one supercell at a time by the calculator."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
from ase import Atoms
from ase.build import bulk

from nvalchemi_ase.properties import phonons
from tests.helpers import assert_same_snapshot, snapshot
from tests.structures import A_AR

pytest.importorskip("phonopy")

THZ_TOLERANCE = 1e-4  # acceptance tolerance, THz
MESH = (4, 4, 4)


def _materials():
    return [
        bulk("Ar", "fcc", a=A_AR),  # one atom, 27-atom supercell
        bulk("Ar", "hcp", a=3.72, c=3.72 * np.sqrt(8.0 / 3.0)),  # two atoms
    ]


def _sequential(calc, atoms, supercell, path_qpoints):
    """phonopy's own workflow, forces from ``atoms.get_forces()`` one by one."""
    from phonopy import Phonopy
    from phonopy.structure.atoms import PhonopyAtoms
    from phonopy.structure.cells import guess_primitive_matrix

    unitcell = PhonopyAtoms(
        symbols=atoms.get_chemical_symbols(),
        cell=atoms.cell.array,
        scaled_positions=atoms.get_scaled_positions(),
        masses=atoms.get_masses(),
    )
    phonon = Phonopy(
        unitcell,
        supercell_matrix=np.diag(supercell),
        primitive_matrix=guess_primitive_matrix(unitcell, symprec=1e-5),
    )
    phonon.generate_displacements(distance=0.01)
    forces = []
    for cell in phonon.supercells_with_displacements:
        displaced = Atoms(
            cell.symbols,
            cell=cell.cell,
            scaled_positions=cell.scaled_positions,
            pbc=True,
        )
        displaced.calc = calc
        forces.append(displaced.get_forces())
    phonon.forces = np.array(forces)
    phonon.produce_force_constants()
    phonon.run_qpoints(path_qpoints)
    band = np.array(phonon.qpoints.frequencies)
    phonon.run_mesh(MESH, is_gamma_center=True)
    return phonon, band, np.array(phonon.mesh.frequencies)


def test_frequencies_match_sequential_phonopy(lj_calc64):
    materials = _materials()
    before = [snapshot(atoms) for atoms in materials]
    supercells = [(3, 3, 3), (2, 2, 2)]
    results = [
        phonons(atoms, lj_calc64, supercell=cell, mesh=MESH, band_npoints=40)[0]
        for atoms, cell in zip(materials, supercells, strict=True)
    ]
    for atoms, cell, result, seen in zip(
        materials, supercells, results, before, strict=True
    ):
        assert result.ok, result.error
        phonon, band, mesh = _sequential(lj_calc64, atoms, cell, result.band_qpoints)
        assert result.n_displacements == len(phonon.supercells_with_displacements)
        np.testing.assert_allclose(
            result.force_constants, phonon.force_constants, atol=1e-10
        )
        np.testing.assert_allclose(result.band_frequencies, band, atol=THZ_TOLERANCE)
        np.testing.assert_allclose(result.mesh_frequencies, mesh, atol=THZ_TOLERANCE)
        assert_same_snapshot(seen, atoms)
        # acoustic sum rule: three (near) zero frequencies at Γ, the rest finite
        gamma = np.sort(np.abs(result.gamma_frequencies))
        assert (gamma[:3] < 1e-3).all(), gamma
        assert (gamma[3:] > 0.1).all(), gamma
    fcc, hcp = results
    assert fcc.band_path.startswith("GX")
    assert fcc.band_labels[0] == "G"
    assert fcc.band_frequencies.shape == (40, 3)
    assert hcp.band_frequencies.shape[1] == 6
    assert fcc.dos.shape == fcc.dos_frequencies.shape
    # DOS integrates to 3 modes per atom of the primitive cell
    integral = np.trapezoid(fcc.dos, fcc.dos_frequencies)
    assert integral == pytest.approx(3.0, rel=0.05)


def test_all_displaced_supercells_of_all_materials_in_one_call(lj_calc64, monkeypatch):
    calls = []
    original = lj_calc64.calculate_batch

    def counting(images, properties=("energy", "forces")):
        calls.append(len(images))
        return original(images, properties)

    monkeypatch.setattr(lj_calc64, "calculate_batch", counting)
    results = phonons(_materials(), lj_calc64, mesh=None, band_path=None)
    assert calls == [sum(r.n_displacements for r in results)]
    assert results[0].band_frequencies is None
    assert results[0].dos is None
    assert results[0].gamma_frequencies.shape == (3,)


def test_a_small_memory_budget_chunks_without_changing_results(lj_calc64, monkeypatch):
    calls = []
    original = lj_calc64.calculate_batch

    def counting(images, properties=("energy", "forces")):
        calls.append(len(images))
        return original(images, properties)

    (whole,) = phonons(_materials()[1], lj_calc64, mesh=None, band_npoints=10)
    monkeypatch.setattr(lj_calc64, "calculate_batch", counting)
    (chunked,) = phonons(
        _materials()[1], lj_calc64, mesh=None, band_npoints=10, memory_budget=1.0
    )
    assert calls == [1] * whole.n_displacements  # one structure per batch
    np.testing.assert_allclose(
        chunked.band_frequencies, whole.band_frequencies, atol=1e-12
    )


def test_a_failing_material_is_reported_and_the_others_finish(lj_calc64):
    broken = bulk("Ar", "fcc", a=A_AR)
    broken.positions[0, 0] = np.inf
    slab = bulk("Ar", "fcc", a=A_AR)
    slab.pbc = (True, True, False)
    good = bulk("Ar", "fcc", a=A_AR)
    results = phonons([broken, good, slab], lj_calc64, mesh=None, band_path=None)
    assert [r.ok for r in results] == [False, True, False]
    assert "periodic" in results[2].error
    assert results[1].gamma_frequencies is not None


def test_results_serialise_to_strict_json_with_units(lj_calc64):
    (result,) = phonons(
        bulk("Ar", "fcc", a=A_AR), lj_calc64, mesh=(2, 2, 2), band_npoints=5
    )
    data = json.loads(json.dumps(result.to_dict(), allow_nan=False))
    assert data["units"]["band_frequencies"] == "THz"
    assert "phonopy" not in data
    assert result.phonopy.force_constants is not None  # kept for analysis


def test_missing_phonopy_names_the_extra(lj_calc64, monkeypatch):
    real = importlib.util.find_spec

    def without_phonopy(name, *args, **kwargs):
        return None if name == "phonopy" else real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", without_phonopy)
    with pytest.raises(ImportError, match=r"nvalchemi-ase\[properties\]"):
        phonons(bulk("Ar", "fcc", a=A_AR), lj_calc64)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"supercell": (2, 2)}, "supercell"),
        ({"supercell": 0}, "singular"),
        ({"displacement": 0.0}, "displacement"),
        ({"mesh": (4, 4)}, "mesh"),
        ({"primitive_matrix": "X"}, "primitive_matrix"),
    ],
)
def test_invalid_arguments_are_refused(lj_calc64, kwargs, match):
    with pytest.raises(ValueError, match=match):
        phonons(bulk("Ar", "fcc", a=A_AR), lj_calc64, **kwargs)
