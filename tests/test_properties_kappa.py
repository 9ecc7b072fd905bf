"""Batched thermal conductivity vs phono3py driven one supercell at a time.

The reference is phono3py's own workflow on the same (relaxed) structure,
every displaced supercell's forces from ``atoms.get_forces()`` through the
same calculator, one structure at a time. Argon fcc (conventional cell,
32-atom supercell) and hcp (16-atom supercell) go through one batched call.
"""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
from ase import Atoms
from ase.build import bulk

from tests.helpers import assert_same_snapshot, snapshot
from tests.structures import A_AR

pytest.importorskip("phono3py")

from nvalchemi_ase.properties import thermal_conductivity
from nvalchemi_ase.properties.kappa import (
    ACOUSTIC_TOLERANCE,
    FORCE_SUM_TOLERANCE,
)

# κ of the batched and the sequential workflow: same model, same float64
# forces to ~1e-13 eV/Å, so κ agrees to round-off through phono3py.
KAPPA_RTOL = 1e-7
KAPPA_ATOL = 1e-9  # W/(m K), for the zero off-diagonal components
MESH = (4, 4, 4)
TEMPERATURES = (20.0, 40.0)
HCP_A = 3.72


def _materials() -> list[Atoms]:
    return [
        bulk("Ar", "fcc", a=A_AR, cubic=True),  # 4 atoms, 32-atom supercell
        bulk("Ar", "hcp", a=HCP_A, c=HCP_A * np.sqrt(8.0 / 3.0)),  # 16-atom
    ]


def _sequential(calc, atoms, *, fc2_supercell=None, method="rta"):
    """phono3py's workflow, forces from ``Atoms.get_forces`` one by one."""
    from phono3py import Phono3py
    from phonopy.structure.atoms import PhonopyAtoms
    from phonopy.structure.cells import guess_primitive_matrix

    unitcell = PhonopyAtoms(
        symbols=atoms.get_chemical_symbols(),
        cell=atoms.cell.array,
        scaled_positions=atoms.get_scaled_positions(),
        masses=atoms.get_masses(),
    )
    ph3 = Phono3py(
        unitcell,
        supercell_matrix=np.diag([2, 2, 2]),
        phonon_supercell_matrix=None
        if fc2_supercell is None
        else np.diag(fc2_supercell),
        primitive_matrix=guess_primitive_matrix(unitcell, symprec=1e-5),
    )
    ph3.generate_displacements(distance=0.03)

    def forces(cells):
        out = []
        for cell in cells:
            displaced = Atoms(
                cell.symbols,
                cell=cell.cell,
                scaled_positions=cell.scaled_positions,
                pbc=True,
            )
            displaced.calc = calc
            out.append(displaced.get_forces())
        return np.array(out)

    ph3.forces = forces(ph3.supercells_with_displacements)
    ph3.produce_fc3()
    if fc2_supercell is not None:
        ph3.generate_fc2_displacements(distance=0.03)
        ph3.phonon_forces = forces(ph3.phonon_supercells_with_displacements)
        ph3.produce_fc2()
    ph3.mesh_numbers = MESH
    ph3.init_phph_interaction()
    ph3.run_thermal_conductivity(is_LBTE=method == "lbte", temperatures=TEMPERATURES)
    return ph3, np.asarray(ph3.thermal_conductivity.kappa)[0]


def _voigt(tensor):
    return np.stack(
        [
            tensor[..., i, j]
            for i, j in ((0, 0), (1, 1), (2, 2), (1, 2), (0, 2), (0, 1))
        ],
        axis=-1,
    )


@pytest.fixture(scope="module")
def batched(lj_calc64):
    materials = _materials()
    before = [snapshot(atoms) for atoms in materials]
    results = thermal_conductivity(
        materials, lj_calc64, mesh=MESH, temperatures=TEMPERATURES
    )
    return materials, before, results


def test_kappa_matches_sequential_phono3py(batched, lj_calc64):
    materials, before, results = batched
    for atoms, seen, result in zip(materials, before, results, strict=True):
        assert result.ok, result.error
        assert_same_snapshot(seen, atoms)  # inputs untouched
        ph3, kappa = _sequential(lj_calc64, result.atoms)
        assert result.n_fc3_displacements == len(ph3.supercells_with_displacements)
        np.testing.assert_allclose(
            _voigt(result.kappa), kappa, rtol=KAPPA_RTOL, atol=KAPPA_ATOL
        )
        assert result.kappa.shape == (len(TEMPERATURES), 3, 3)
        np.testing.assert_allclose(
            result.kappa_mean, np.trace(result.kappa, axis1=1, axis2=2) / 3
        )
        # physics: positive, isotropic in-plane, falls with temperature
        assert (result.kappa_mean > 0).all()
        assert result.kappa_mean[1] < result.kappa_mean[0]
        # the checks pass with room to spare on a translation-invariant model
        assert result.max_force_sum < 1e-10 < FORCE_SUM_TOLERANCE
        assert result.acoustic_gamma < 1e-4 < ACOUSTIC_TOLERANCE
        assert result.fc2_sum_rule < 1e-10
        assert result.force_sums.shape == (result.n_fc3_displacements,)


def test_relaxation_keeps_the_space_group(batched, lj_calc64):
    materials, _, results = batched
    for atoms, result in zip(materials, results, strict=True):
        relaxed = result.atoms.copy()
        relaxed.calc = lj_calc64
        # FrechetCellFilter's criterion: virial per atom below fmax (1e-3 eV)
        virial = np.abs(relaxed.get_stress()).max() * relaxed.get_volume()
        assert virial / len(relaxed) < 1e-3
        # as many displacements as the unrelaxed (exactly symmetric) input needs
        count, _ = _sequential_count(atoms)
        assert result.n_fc3_displacements == count
        assert result.residual_force < 1e-3


def _sequential_count(atoms):
    from phono3py import Phono3py
    from phonopy.structure.atoms import PhonopyAtoms
    from phonopy.structure.cells import guess_primitive_matrix

    unitcell = PhonopyAtoms(
        symbols=atoms.get_chemical_symbols(),
        cell=atoms.cell.array,
        scaled_positions=atoms.get_scaled_positions(),
    )
    ph3 = Phono3py(
        unitcell,
        supercell_matrix=np.diag([2, 2, 2]),
        primitive_matrix=guess_primitive_matrix(unitcell, symprec=1e-5),
    )
    ph3.generate_displacements(distance=0.03)
    return len(ph3.supercells_with_displacements), ph3


@pytest.mark.slow
def test_lbte_with_a_separate_fc2_supercell_matches_sequential(lj_calc64):
    atoms = _materials()[0]
    (result,) = thermal_conductivity(
        atoms,
        lj_calc64,
        fc2_supercell=(3, 3, 3),
        mesh=MESH,
        temperatures=TEMPERATURES,
        method="lbte",
        relax=False,
    )
    assert result.ok, result.error
    ph3, kappa = _sequential(lj_calc64, atoms, fc2_supercell=(3, 3, 3), method="lbte")
    assert result.n_fc2_displacements == len(ph3.phonon_supercells_with_displacements)
    assert result.force_sums.shape == (
        result.n_fc3_displacements + result.n_fc2_displacements,
    )
    np.testing.assert_allclose(
        _voigt(result.kappa), kappa, rtol=KAPPA_RTOL, atol=KAPPA_ATOL
    )


def test_every_supercell_of_every_material_in_one_call(lj_calc64, monkeypatch):
    calls = []
    original = lj_calc64.calculate_batch

    def counting(images, properties=("energy", "forces")):
        calls.append(len(images))
        return original(images, properties)

    monkeypatch.setattr(lj_calc64, "calculate_batch", counting)
    results = thermal_conductivity(
        _materials(), lj_calc64, mesh=(2, 2, 2), temperatures=20.0, relax=False
    )
    # one perfect supercell per material, for the residual force
    assert calls == [sum(r.n_fc3_displacements + 1 for r in results)]


def _with_constant_force(calc, monkeypatch, natoms, which, force):
    """Add ``force`` to every atom of the ``which``-th structure of ``natoms``."""
    original = calc.calculate_batch
    seen = [0]

    def shifted(images, properties=("energy", "forces")):
        results = original(images, properties)
        for atoms, result in zip(images, results, strict=True):
            if len(atoms) != natoms:
                continue
            if seen[0] == which:
                result["forces"] = result["forces"] + np.asarray(force)
            seen[0] += 1
        return results

    monkeypatch.setattr(calc, "calculate_batch", shifted)


def test_broken_translational_invariance_fails_its_material_only(
    lj_calc64, monkeypatch
):
    # the hcp material's first displaced supercell (its 16-atom perfect
    # supercell is evaluated before it) gets 1e-3 eV/Å on every atom
    _with_constant_force(lj_calc64, monkeypatch, 16, 1, [1e-3, 0.0, 0.0])
    fcc, hcp = thermal_conductivity(
        _materials(), lj_calc64, mesh=MESH, temperatures=TEMPERATURES, relax=False
    )
    assert fcc.ok, fcc.error
    assert (fcc.kappa_mean > 0).all()
    assert not hcp.ok
    assert "translational invariance" in hcp.error
    assert "FC3 displaced supercell 1 " in hcp.error
    assert hcp.max_force_sum == pytest.approx(16e-3, rel=1e-6)  # kept, reported
    assert hcp.kappa is None


def test_broken_acoustic_sum_rule_is_reported(lj_calc64, monkeypatch):
    _with_constant_force(lj_calc64, monkeypatch, 16, 1, [1e-3, 0.0, 0.0])
    fcc, hcp = thermal_conductivity(
        _materials(),
        lj_calc64,
        mesh=MESH,
        temperatures=TEMPERATURES,
        force_sum_tolerance=None,
        relax=False,
    )
    assert fcc.ok, fcc.error
    assert not hcp.ok
    assert "acoustic sum rule" in hcp.error
    assert hcp.acoustic_gamma > ACOUSTIC_TOLERANCE
    assert hcp.fc2_sum_rule > 1e-2
    # with both checks off the same forces give a κ nothing flags
    _with_constant_force(lj_calc64, monkeypatch, 16, 1, [1e-3, 0.0, 0.0])
    (unchecked,) = thermal_conductivity(
        _materials()[1],
        lj_calc64,
        mesh=MESH,
        temperatures=TEMPERATURES,
        force_sum_tolerance=None,
        acoustic_tolerance=None,
        relax=False,
    )
    assert unchecked.ok
    assert unchecked.acoustic_gamma == pytest.approx(hcp.acoustic_gamma)


def test_results_serialise_to_strict_json_with_units(batched):
    _, _, results = batched
    data = json.loads(json.dumps(results[0].to_dict(), allow_nan=False))
    assert data["units"]["kappa"] == "W/(m K)"
    assert "phono3py" not in data
    assert "atoms" not in data
    assert np.asarray(data["kappa"]).shape == (len(TEMPERATURES), 3, 3)


def test_a_failing_material_is_reported_and_the_others_finish(lj_calc64):
    slab = bulk("Ar", "fcc", a=A_AR, cubic=True)
    slab.pbc = (True, True, False)
    good, _ = _materials()
    results = thermal_conductivity(
        [slab, good], lj_calc64, mesh=(2, 2, 2), temperatures=20.0, relax=False
    )
    assert [r.ok for r in results] == [False, True]
    assert "periodic" in results[0].error


def test_missing_phono3py_names_the_extra(lj_calc64, monkeypatch):
    real = importlib.util.find_spec

    def without(name, *args, **kwargs):
        return None if name == "phono3py" else real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", without)
    with pytest.raises(ImportError, match=r"nvalchemi-ase\[kappa\]"):
        thermal_conductivity(_materials()[0], lj_calc64)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"method": "green-kubo"}, "method"),
        ({"temperatures": (300.0, -1.0)}, "positive"),
        ({"temperatures": ()}, "temperatures"),
        ({"displacement": 0.0}, "displacement"),
        ({"mesh": (4, 4)}, "mesh"),
        ({"supercell": (2, 2)}, "supercell"),
        ({"fc2_supercell": 0}, "singular"),
        ({"cutoff_pair_distance": -1.0}, "cutoff_pair_distance"),
        ({"force_sum_tolerance": 0.0}, "force_sum_tolerance"),
        ({"cell_optimizer": "MDMin"}, "cell_optimizer"),
    ],
)
def test_invalid_arguments_are_refused_before_any_work(
    lj_calc64, monkeypatch, kwargs, match
):
    def no_calls(*args, **kwargs):
        raise AssertionError("the model was called")

    monkeypatch.setattr(lj_calc64, "calculate_batch", no_calls)
    with pytest.raises(ValueError, match=match):
        thermal_conductivity(_materials()[0], lj_calc64, **kwargs)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("sevenn") is None, reason="needs sevenn")
def test_sevennet_silicon_passes_both_checks():
    """SevenNet-0 (float32) on Si: checks far below their tolerances, κ > 0.

    A 16-atom supercell of the primitive cell and a coarse mesh (κ itself is
    not converged here; 64-atom cells give ~22 W/(m K), docs/performance.md).
    """
    (result,) = thermal_conductivity(
        bulk("Si", "diamond", a=5.43),
        "sevennet-0",
        device="cpu",
        supercell=(2, 2, 2),
        mesh=(5, 5, 5),
        temperatures=(300.0,),
        fmax=5e-3,
    )
    assert result.ok, result.error
    assert result.max_force_sum < 0.1 * FORCE_SUM_TOLERANCE
    assert result.acoustic_gamma < 0.5 * ACOUSTIC_TOLERANCE
    assert result.kappa_mean[0] > 0
    assert np.sort(np.abs(result.gamma_frequencies))[3] > 10.0  # optical, THz
