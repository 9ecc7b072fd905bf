"""Batched adsorption energies vs ASE's FIRE structure by structure."""

from __future__ import annotations

import numpy as np
import pytest
from ase import Atoms
from ase.build import add_adsorbate, fcc100, fcc111
from ase.constraints import FixAtoms
from ase.optimize import FIRE

from nvalchemi_ase.properties import _common, adsorption_energies
from tests._nearest_neighbour_lj import BOND, EPSILON, nn_calculator
from tests.helpers import assert_same_snapshot, snapshot
from tests.structures import A_AR

# Relaxations to FMAX leave energies off by ~ FMAX² / k (k ~ 0.05 eV/Å² for the
# softest modes here: ~ 2e-5 eV); both sides take the same FIRE path, so they
# agree far closer than that.
FMAX = 1e-3
ENERGY_ATOL = 1e-6  # eV, batched vs one by one
MINIMUM_ATOL = 5e-5  # eV, relaxed energy vs the exact minimum
HEIGHT = 3.0  # Å


@pytest.fixture(scope="module")
def nn_calc():
    return nn_calculator()


def _slabs():
    pinned = fcc100("Ar", size=(2, 2, 3), a=A_AR, vacuum=6.0)
    pinned.set_constraint(FixAtoms(mask=pinned.positions[:, 2] < 7.0))
    return [fcc111("Ar", size=(2, 2, 3), a=A_AR, vacuum=6.0), pinned]


def _energy(calc, atoms):
    atoms = atoms.copy()
    atoms.calc = calc
    FIRE(atoms, logfile=None).run(fmax=FMAX, steps=3000)
    return atoms.get_potential_energy()


@pytest.mark.slow  # ~4 CPU-s: among test-fast's costliest
def test_relaxed_adsorption_energies_match_ase_one_by_one_in_one_run(
    nn_calc, monkeypatch
):
    runs = []
    original = _common._run_in_flight

    def counting(optimizer_class, calc, derived, selected, **kwargs):
        runs.append(len(selected))
        return original(optimizer_class, calc, derived, selected, **kwargs)

    monkeypatch.setattr(_common, "_run_in_flight", counting)
    slabs = _slabs()
    dimer = Atoms("Ar2", positions=[[0, 0, 0], [0, 0, 3.9]])
    sites = [(1.1, 0.7)]
    before = [snapshot(atoms) for atoms in slabs]
    results = adsorption_energies(
        slabs, ["Ar", dimer], sites, nn_calc, height=HEIGHT, fmax=FMAX
    )
    # both clean slabs, the two configurations of each and the dimer relax
    # together (the single atom has no forces)
    assert runs == [7]
    for slab, result, seen in zip(slabs, results, before, strict=True):
        assert result.ok, result.error
        assert result.adsorbates == ["Ar", "Ar2"]
        assert result.sites == ["1.1,0.7"] * 2
        e_slab = _energy(nn_calc, slab)
        expected = []
        for adsorbate in (Atoms("Ar"), dimer):
            e_molecule = _energy(nn_calc, adsorbate)
            for site in sites:
                atoms = slab.copy()
                add_adsorbate(atoms, adsorbate, HEIGHT, position=site)
                expected.append(_energy(nn_calc, atoms) - e_slab - e_molecule)
        np.testing.assert_allclose(
            result.adsorption_energies, expected, atol=ENERGY_ATOL
        )
        # the relaxed dimer sits at the LJ minimum, -epsilon
        assert result.adsorbate_energies[1] == pytest.approx(-EPSILON, abs=MINIMUM_ATOL)
        assert_same_snapshot(seen, slab)
    # FixAtoms is honoured: the pinned slab's bottom layers did not move
    pinned = slabs[1]
    fixed = pinned.constraints[0].index
    for structure in results[1].structures:
        np.testing.assert_array_equal(
            structure.positions[fixed], pinned.positions[fixed]
        )
        assert structure.info["adsorption_energy"] in results[1].adsorption_energies


def test_hollow_sites_bind_more_than_ontop(nn_calc):
    (result,) = adsorption_energies(
        fcc111("Ar", size=(2, 2, 3), a=A_AR, vacuum=6.0),
        "Ar",
        ["ontop", "fcc", "hcp"],
        nn_calc,
        height=HEIGHT,
        fmax=1e-3,
    )
    ontop, fcc, hcp = result.adsorption_energies
    assert fcc < ontop < 0
    assert hcp < ontop
    # three bonds in a hollow at best: no more binding than 3 u
    assert fcc >= 3 * BOND - 1e-3


def test_failures_are_isolated_per_slab(nn_calc):
    overlapping = fcc111("Ar", size=(2, 2, 3), a=A_AR, vacuum=6.0)
    overlapping.positions[1] = overlapping.positions[0] + 0.01
    good = fcc111("Ar", size=(2, 2, 3), a=A_AR, vacuum=6.0)
    results = adsorption_energies(
        [overlapping, good], "Ar", ["ontop"], nn_calc, relax=False
    )
    assert not results[0].ok
    assert "invalid structure" in results[0].error
    assert results[0].adsorption_energies is None
    assert results[1].ok
    assert results[1].slab_energy == pytest.approx(
        results[1].slab.get_potential_energy()
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("Ar", ["hollow"]), "site 'hollow' is not defined for slab 0"),
        (("Ar", [(1.0,)]), "sites\\[0\\]"),
        (("NotAMolecule", ["ontop"]), "adsorbates\\[0\\]"),
        (([], ["ontop"]), "adsorbates is empty"),
        (("Ar", []), "sites is empty"),
    ],
)
def test_bad_arguments_raise_before_any_work(nn_calc, args, message):
    slab = fcc111("Ar", size=(2, 2, 3), a=A_AR, vacuum=6.0)
    with pytest.raises(ValueError, match=message):
        adsorption_energies(slab, *args, nn_calc)
