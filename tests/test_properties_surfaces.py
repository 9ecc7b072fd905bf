"""Batched surface energies vs ASE's optimizers slab by slab, and bond counting."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ase.build import bulk, surface
from ase.optimize import FIRE

from nvalchemi_ase.properties import _common, surface_energies
from nvalchemi_ase.properties.surfaces import EV_PER_A2_TO_J_PER_M2
from tests._nearest_neighbour_lj import BOND, nn_calculator
from tests._tolerances import EXACT
from tests.helpers import assert_same_snapshot, snapshot
from tests.structures import A_AR

# Relaxations to FMAX leave energies off the minimum by ~ FMAX² / k (~1e-5 eV),
# but both sides take the same FIRE path slab by slab, so they agree far
# closer: GAMMA_ATOL (over 2A of 50-100 Å²) is about 1e-6 eV of energy.
FMAX = 1e-3
GAMMA_ATOL = 1e-8  # eV/Å²
ROUNDOFF = EXACT[torch.float64]
FACETS = [(1, 0, 0), (1, 1, 0), (1, 1, 1)]


@pytest.fixture(scope="module")
def nn_calc():
    return nn_calculator()


def _sequential(calc, atoms, miller, layers, vacuum, relax):
    """γ (eV/Å²) of each facet: ASE's FIRE on each slab alone, bulk single point."""
    reference = atoms.copy()
    reference.calc = calc
    if relax:
        FIRE(reference, logfile=None).run(fmax=FMAX, steps=2000)
    e_bulk = reference.get_potential_energy() / len(reference)
    gammas = []
    for hkl in miller:
        slab = surface(atoms, hkl, layers, vacuum=vacuum)
        slab.calc = calc
        if relax:
            FIRE(slab, logfile=None).run(fmax=FMAX, steps=2000)
        area = np.linalg.norm(np.cross(slab.cell[0], slab.cell[1]))
        gammas.append((slab.get_potential_energy() - len(slab) * e_bulk) / (2 * area))
    return np.array(gammas)


def test_relaxed_surface_energies_match_ase_slab_by_slab_in_one_run(
    nn_calc, monkeypatch
):
    runs = []
    original = _common._run_in_flight

    def counting(optimizer_class, calc, derived, selected, **kwargs):
        runs.append(len(selected))
        return original(optimizer_class, calc, derived, selected, **kwargs)

    monkeypatch.setattr(_common, "_run_in_flight", counting)
    rattled = bulk("Ar", "fcc", a=5.20, cubic=True)
    rattled.rattle(0.02, seed=4)
    materials = [bulk("Ar", "fcc", a=A_AR, cubic=True), rattled]
    before = [snapshot(atoms) for atoms in materials]
    results = surface_energies(
        materials, nn_calc, miller=FACETS, layers=2, vacuum=6.0, fmax=FMAX
    )
    # every slab of both materials and the rattled bulk: one in-flight run
    assert runs == [7]
    for atoms, result, seen in zip(materials, results, before, strict=True):
        assert result.ok, result.error
        expected = _sequential(nn_calc, atoms, FACETS, 2, 6.0, relax=True)
        np.testing.assert_allclose(result.surface_energies, expected, atol=GAMMA_ATOL)
        np.testing.assert_allclose(
            result.surface_energies_si,
            result.surface_energies * 16.02176634,
            rtol=1e-8,
        )
        assert (result.relax_steps > 0).all()
        assert_same_snapshot(seen, atoms)
        # the written slabs carry their energies and γ
        for slab, gamma, energy in zip(
            result.slabs, result.surface_energies, result.slab_energies, strict=True
        ):
            assert slab.get_potential_energy() == energy
            assert slab.info["surface_energy"] == gamma


def test_unrelaxed_nearest_neighbour_surface_energies_are_bond_counts(nn_calc):
    # per face per in-plane cell: broken bonds (111) 3 / atom of area √3a²/4,
    # (100) 4 / atom of area a²/2, (110) 5 + 1 / column of area a²/√2;
    # γ = (broken bonds) · |u| / 2 / area, u the nearest-neighbour bond
    a = A_AR
    expected = -BOND / a**2 * np.array([4.0, 3 * np.sqrt(2), 2 * np.sqrt(3)])
    (result,) = surface_energies(
        bulk("Ar", "fcc", a=a, cubic=True),
        nn_calc,
        miller=FACETS,
        layers=3,
        vacuum=6.0,
        relax=False,
    )
    np.testing.assert_allclose(result.surface_energies, expected, rtol=ROUNDOFF)
    assert (result.relax_steps == -1).all()
    # Miller indices are the given cell's: the primitive fcc cell's (1, 0, 0)
    # and (1, 1, 1) planes are both cubic {111}
    (primitive,) = surface_energies(
        bulk("Ar", "fcc", a=a),
        nn_calc,
        miller=[(1, 0, 0), (1, 1, 1)],
        layers=4,
        vacuum=6.0,
        relax=False,
    )
    np.testing.assert_allclose(primitive.surface_energies, expected[2], rtol=ROUNDOFF)


def test_lj_fcc_surface_energy_ordering(lj_calc64):
    # the full 8.5 Å LJ: (111) < (100) < (110), as for pair potentials
    (result,) = surface_energies(
        bulk("Ar", "fcc", a=A_AR, cubic=True),
        lj_calc64,
        miller=FACETS,
        layers=3,
        relax=False,
    )
    g100, g110, g111 = result.surface_energies
    assert g111 < g100 < g110
    expected = _sequential(
        lj_calc64, bulk("Ar", "fcc", a=A_AR, cubic=True), FACETS, 3, 10.0, False
    )
    np.testing.assert_allclose(result.surface_energies, expected, rtol=ROUNDOFF)


def test_given_bulk_energy_and_failure_isolation(nn_calc):
    good = bulk("Ar", "fcc", a=A_AR, cubic=True)
    not_bulk = good.copy()
    not_bulk.pbc = (True, True, False)
    (reference,) = surface_energies(
        good, nn_calc, miller=[(1, 1, 1)], layers=3, vacuum=6.0, relax=False
    )
    e_bulk = reference.bulk_energy_per_atom
    assert e_bulk == pytest.approx(6 * BOND, rel=ROUNDOFF)
    results = surface_energies(
        [not_bulk, good],
        nn_calc,
        miller=[(1, 1, 1)],
        layers=3,
        vacuum=6.0,
        relax=False,
        bulk_energies=[0.0, e_bulk],
    )
    assert not results[0].ok
    assert "periodic" in results[0].error
    assert results[0].surface_energies is None
    assert results[0].slabs == []
    assert results[1].ok
    assert results[1].bulk_energy_given
    np.testing.assert_allclose(
        results[1].surface_energies, reference.surface_energies, rtol=1e-12
    )
    data = results[1].to_dict()
    assert data["units"]["surface_energies_si"] == "J/m^2"
    assert "slabs" not in data


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"miller": [(0, 0, 0)]}, "miller\\[0\\]"),
        ({"miller": [(1, 1)]}, "three integers"),
        ({"layers": 0}, "layers"),
        ({"vacuum": -1.0}, "vacuum"),
        ({"bulk_energies": [1.0, 2.0]}, "bulk_energies has 2 values for 1"),
        ({"optimizer": "MDMin"}, "optimizer"),
    ],
)
def test_bad_arguments_raise_before_any_work(nn_calc, kwargs, message):
    with pytest.raises(ValueError, match=message):
        surface_energies(bulk("Ar", "fcc", a=A_AR, cubic=True), nn_calc, **kwargs)


def test_units_constant():
    assert pytest.approx(16.0217663, rel=1e-8) == EV_PER_A2_TO_J_PER_M2
