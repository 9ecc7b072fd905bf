"""Batched elastic constants vs matscipy's sequential fit on the same calculator."""

from __future__ import annotations

import json

import numpy as np
import pytest
from ase import units
from ase.build import bulk
from ase.optimize import BFGS
from matscipy.elasticity import fit_elastic_constants

from nvalchemi_ase.properties import _common, elastic_constants, moduli
from tests.helpers import assert_same_snapshot, snapshot
from tests.structures import A_AR

GPA_TOLERANCE = 0.1  # the acceptance tolerance, GPa
FMAX = 1e-5  # eV/Å, both sides


def _fcc():
    return bulk("Ar", "fcc", a=A_AR, cubic=True)


def _hcp():
    """Ideal hcp argon: its ions move under strain (clamped != relaxed)."""
    return bulk("Ar", "hcp", a=3.72, c=3.72 * np.sqrt(8.0 / 3.0))


def _matscipy(calc, atoms, *, relax):
    copy = atoms.copy()
    copy.calc = calc
    stiffness, _ = fit_elastic_constants(
        copy,
        symmetry="triclinic",
        N_steps=5,
        delta=0.005,  # strains -0.01 ... 0.01, as strain=0.01, n_strains=5
        optimizer=BFGS if relax else None,
        verbose=False,
        fmax=FMAX,
    )
    return stiffness / units.GPa


@pytest.mark.parametrize("relax_ions", [False, True])
def test_matches_matscipy_clamped_and_relaxed(lj_calc64, relax_ions):
    materials = [_fcc(), _hcp()]
    before = [snapshot(atoms) for atoms in materials]
    results = elastic_constants(
        materials, lj_calc64, relax_ions=relax_ions, fmax=FMAX, optimizer="LBFGS"
    )
    for atoms, result, seen in zip(materials, results, before, strict=True):
        assert result.ok, result.error
        reference = _matscipy(lj_calc64, atoms, relax=relax_ions)
        np.testing.assert_allclose(result.C, reference, atol=GPA_TOLERANCE)
        if not relax_ions:  # the same numbers through the same fit
            np.testing.assert_allclose(result.C, reference, atol=1e-8)
        assert_same_snapshot(seen, atoms)
    if relax_ions:
        (clamped,) = elastic_constants(_hcp(), lj_calc64, relax_ions=False)
        assert np.abs(results[1].C - clamped.C).max() > 0.2  # the ions did move
        assert (results[1].relax_steps > 0).any()


def test_fcc_has_cubic_symmetry_and_positive_stiffness(lj_calc64):
    (result,) = elastic_constants(_fcc(), lj_calc64, relax_ions=False)
    stiffness = result.C
    c11, c12, c44 = stiffness[0, 0], stiffness[0, 1], stiffness[3, 3]
    np.testing.assert_allclose(np.diag(stiffness)[:3], c11, rtol=1e-10)
    np.testing.assert_allclose(
        [stiffness[0, 1], stiffness[0, 2], stiffness[1, 2]], c12, rtol=1e-10
    )
    np.testing.assert_allclose(np.diag(stiffness)[3:], c44, rtol=1e-10)
    off_block = stiffness.copy()
    off_block[:3, :3] = off_block[3:, 3:] = 0.0
    np.testing.assert_allclose(off_block, 0.0, atol=1e-10)
    # ASE's stress is tensile positive: stretching gives a positive stress, C > 0
    assert c11 > c12 > 0
    assert c44 > 0
    # cubic averages in closed form
    assert result.bulk_voigt == pytest.approx((c11 + 2 * c12) / 3)
    assert result.bulk_reuss == pytest.approx((c11 + 2 * c12) / 3)
    assert result.shear_voigt == pytest.approx((c11 - c12 + 3 * c44) / 5)
    reuss = 5 * (c11 - c12) * c44 / (4 * c44 + 3 * (c11 - c12))
    assert result.shear_reuss == pytest.approx(reuss)
    assert result.shear_hill == pytest.approx((result.shear_voigt + reuss) / 2)


def test_sign_convention_is_c_equals_plus_dsigma_deps(lj_calc64):
    """C11 is the slope of ASE's get_stress()[0] against a stretch along x."""
    atoms = _fcc()
    stresses = []
    for value in (-1e-4, 1e-4):
        strained = atoms.copy()
        strained.set_cell(atoms.cell.array * [1 + value, 1, 1], scale_atoms=True)
        strained.calc = lj_calc64
        stresses.append(strained.get_stress()[0])
    slope = (stresses[1] - stresses[0]) / 2e-4 / units.GPa
    (result,) = elastic_constants(atoms, lj_calc64, relax_ions=False, strain=1e-3)
    assert slope > 0
    assert result.C[0, 0] == pytest.approx(slope, rel=1e-3)


def test_moduli_of_an_isotropic_solid():
    bulk_modulus, shear = 100.0, 40.0
    lam = bulk_modulus - 2 * shear / 3
    stiffness = np.zeros((6, 6))
    stiffness[:3, :3] = lam
    stiffness[np.arange(3), np.arange(3)] = lam + 2 * shear
    stiffness[np.arange(3, 6), np.arange(3, 6)] = shear
    figures = moduli(stiffness)
    for kind in ("voigt", "reuss", "hill"):
        assert figures[f"bulk_{kind}"] == pytest.approx(bulk_modulus)
        assert figures[f"shear_{kind}"] == pytest.approx(shear)
    youngs = 9 * bulk_modulus * shear / (3 * bulk_modulus + shear)
    assert figures["youngs_hill"] == pytest.approx(youngs)
    assert figures["poisson_hill"] == pytest.approx(youngs / (2 * shear) - 1)


def test_relaxed_strains_are_one_batched_run(lj_calc64, monkeypatch):
    runs = []
    original = _common._run_in_flight

    def counting(optimizer_class, calc, derived, selected, **kwargs):
        runs.append(len(selected))
        return original(optimizer_class, calc, derived, selected, **kwargs)

    monkeypatch.setattr(_common, "_run_in_flight", counting)
    results = elastic_constants([_fcc(), _hcp()], lj_calc64, n_strains=4)
    assert all(r.ok for r in results)
    # one in-flight run over every strained cell with forces: none of fcc's
    # (each atom is an inversion centre), some of hcp's
    assert len(runs) == 1
    assert 0 < runs[0] < 1 + 6 * 4
    assert (results[0].relax_steps == 0).all()
    assert (results[1].relax_steps > 0).sum() == runs[0]


def test_a_failing_material_is_reported_and_the_others_finish(lj_calc64):
    broken = _fcc()
    broken.positions[0, 0] = np.nan
    results = elastic_constants([_fcc(), broken, _hcp()], lj_calc64, relax_ions=False)
    assert [r.ok for r in results] == [True, False, True]
    assert "StructureError" in results[1].error
    assert results[1].C is None
    (alone,) = elastic_constants(_hcp(), lj_calc64, relax_ions=False)
    np.testing.assert_allclose(results[2].C, alone.C, rtol=1e-12)


def test_results_serialise_to_strict_json_with_units(lj_calc64):
    (result,) = elastic_constants(_fcc(), lj_calc64, relax_ions=False)
    data = json.loads(json.dumps(result.to_dict(), allow_nan=False))
    assert data["units"]["C"] == "GPa"
    assert np.array(data["C"]).shape == (6, 6)
    assert np.array(data["stresses"]).shape == (6, 5, 6)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"strain": 0.5}, "strain"),
        ({"n_strains": 1}, "n_strains"),
        ({"optimizer": "MDMin"}, "optimizer"),
    ],
)
def test_invalid_arguments_are_refused(lj_calc64, kwargs, match):
    with pytest.raises(ValueError, match=match):
        elastic_constants(_fcc(), lj_calc64, **kwargs)
