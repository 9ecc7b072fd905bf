"""Batched defect formation energies vs ASE's FIRE cell by cell, and bond counting."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ase.build import bulk, make_supercell
from ase.optimize import FIRE

from nvalchemi_ase.properties import _common, defect_formation_energies
from nvalchemi_ase.properties.defects import largest_void, parse_defect
from tests._nearest_neighbour_lj import BOND, nn_calculator
from tests._tolerances import EXACT
from tests.helpers import assert_same_snapshot, snapshot
from tests.structures import A_AR

# Relaxations to FMAX leave energies off the minimum by ~ FMAX² / k (~1e-5 eV),
# but both sides take the same FIRE path cell by cell, so they agree to
# ENERGY_ATOL.
FMAX = 1e-3
ENERGY_ATOL = 1e-7  # eV
ROUNDOFF = EXACT[torch.float64]
MU_KR = -0.0731  # eV/atom, any value: the LJ model ignores species


@pytest.fixture(scope="module")
def nn_calc():
    return nn_calculator()


def _relaxed_energy(calc, atoms, relax):
    atoms = atoms.copy()
    atoms.calc = calc
    if relax:
        FIRE(atoms, logfile=None).run(fmax=FMAX, steps=2000)
    return atoms.get_potential_energy()


def _sequential(calc, cell, repeat, octahedral, relax):
    """E_f of V_Ar, Ar_i, Kr_Ar built by hand, each relaxed alone by ASE's FIRE."""
    e_cell = _relaxed_energy(calc, cell, relax)
    perfect = make_supercell(cell, np.diag([repeat] * 3))
    n = len(perfect)
    e_bulk = e_cell * n / len(cell)
    vacancy = perfect.copy()
    del vacancy[0]
    interstitial = perfect.copy()
    interstitial.append("Ar")
    interstitial.positions[-1] = octahedral
    substituted = perfect.copy()
    substituted[0].symbol = "Kr"
    mu = e_bulk / n
    return np.array(
        [
            _relaxed_energy(calc, vacancy, relax) - e_bulk + mu,
            _relaxed_energy(calc, interstitial, relax) - e_bulk - mu,
            _relaxed_energy(calc, substituted, relax) - e_bulk + mu - MU_KR,
        ]
    )


DEFECTS = ("vacancy", "interstitial", "substitution:Kr")


def test_relaxed_formation_energies_match_ase_cell_by_cell_in_one_run(
    nn_calc, monkeypatch
):
    runs = []
    original = _common._run_in_flight

    def counting(optimizer_class, calc, derived, selected, **kwargs):
        runs.append(len(selected))
        return original(optimizer_class, calc, derived, selected, **kwargs)

    monkeypatch.setattr(_common, "_run_in_flight", counting)
    # a 32-atom cubic and a 27-atom primitive supercell: different sizes
    cubic = bulk("Ar", "fcc", a=A_AR, cubic=True)
    primitive = bulk("Ar", "fcc", a=5.30)
    materials = [cubic, primitive]
    before = [snapshot(atoms) for atoms in materials]
    results = defect_formation_energies(
        materials,
        nn_calc,
        defects=DEFECTS,
        supercell=2,
        chemical_potentials={"Kr": MU_KR},
        fmax=FMAX,
    )
    # one in-flight run over every cell with forces (the substituted and
    # perfect cells have none with this model, nor the interstitial in the
    # 8-atom supercell, symmetric between its images)
    moved = sum(int((r.relax_steps > 0).sum()) for r in results)
    assert runs == [moved]
    assert moved >= 3
    for atoms, result, seen in zip(materials, results, before, strict=True):
        assert result.ok, result.error
        assert result.defects == ["V_Ar", "Ar_i", "Kr_Ar"]
        a = np.linalg.norm(atoms.cell[0]) * (1 if atoms is cubic else np.sqrt(2))
        expected = _sequential(nn_calc, atoms, 2, np.full(3, a / 2), relax=True)
        np.testing.assert_allclose(
            result.formation_energies, expected, atol=ENERGY_ATOL
        )
        assert result.chemical_potentials["Kr"] == MU_KR
        assert result.supercell_natoms == 8 * len(atoms)
        assert_same_snapshot(seen, atoms)
        for structure, label, energy in zip(
            result.structures, result.defects, result.defect_energies, strict=True
        ):
            assert structure.info["defect"] == label
            assert structure.get_potential_energy() == energy
    # relaxation lowers the vacancy's energy
    (unrelaxed,) = defect_formation_energies(cubic, nn_calc, relax=False)
    assert results[0].formation_energies[0] < unrelaxed.formation_energies[0]


def test_unrelaxed_nearest_neighbour_vacancy_is_six_bonds(nn_calc):
    # a vacancy breaks 12 bonds; the N - 1 atoms left would hold 6 (N - 1) in
    # bulk: E_def - (N - 1)/N E_bulk = (6N - 12) u - 6 (N - 1) u = -6 u
    results = defect_formation_energies(
        [bulk("Ar", "fcc", a=A_AR, cubic=True), bulk("Ar", "fcc", a=A_AR)],
        nn_calc,
        supercell=[[3, 0, 0], [0, 3, 0], [0, 0, 3]],
        relax=False,
    )
    for result in results:
        assert result.ok, result.error
        assert result.formation_energies[0] == pytest.approx(-6 * BOND, rel=ROUNDOFF)
        assert result.bulk_energy_per_atom == pytest.approx(6 * BOND, rel=ROUNDOFF)
        assert (result.relax_steps == -1).all()
    assert [r.supercell_natoms for r in results] == [108, 27]


def test_largest_void_is_the_octahedral_site():
    cubic = bulk("Ar", "fcc", a=A_AR, cubic=True)
    np.testing.assert_allclose(largest_void(cubic), np.full(3, A_AR / 2), atol=1e-12)
    # rocksalt: the centre of a cube of side a/2 spanned by the ions, √3 a/4
    # from its eight corners
    nacl = bulk("NaCl", "rocksalt", a=5.6, cubic=True)
    void = largest_void(nacl)
    probe = nacl.copy()
    probe.append("Ar")
    probe.positions[-1] = void
    nearest = probe.get_distances(-1, range(len(nacl)), mic=True).min()
    assert nearest == pytest.approx(np.sqrt(3) * 5.6 / 4, rel=1e-12)
    np.testing.assert_allclose(np.mod(void / (5.6 / 4), 2), 1.0, atol=1e-12)


def test_compound_needs_chemical_potentials_and_failures_are_isolated(nn_calc):
    nacl = bulk("NaCl", "rocksalt", a=5.6, cubic=True)
    with pytest.raises(ValueError, match=r"material 0 .*V_Na.*chemical_potentials"):
        defect_formation_energies(nacl, nn_calc, relax=False)
    not_bulk = bulk("Ar", "fcc", a=A_AR, cubic=True)
    not_bulk.pbc = (True, True, False)
    mu = {"Na": -0.05, "Cl": -0.07}
    results = defect_formation_energies(
        [not_bulk, nacl], nn_calc, chemical_potentials=mu, relax=False
    )
    assert not results[0].ok
    assert "periodic" in results[0].error
    assert results[0].formation_energies is None
    assert results[1].ok
    assert results[1].defects == ["V_Na", "V_Cl"]
    e_bulk = results[1].bulk_energy
    np.testing.assert_allclose(
        results[1].formation_energies,
        results[1].defect_energies - e_bulk + np.array([mu["Na"], mu["Cl"]]),
        rtol=1e-12,
    )
    assert results[1].to_dict()["units"]["formation_energies"] == "eV"


def test_parse_defect():
    assert parse_defect("vacancy").kind == "vacancy"
    spec = parse_defect("substitution:Kr@Ar")
    assert (spec.kind, spec.species, spec.host) == ("substitution", "Kr", "Ar")
    assert parse_defect("interstitial:He").species == "He"
    for bad in ("antisite", "substitution", "vacancy:Xx", "vacancy:Ar@Kr"):
        with pytest.raises(ValueError, match="defect"):
            parse_defect(bad)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"supercell": 0}, "supercell"),
        ({"supercell": [2, 2]}, "supercell"),
        ({"defects": ()}, "defects is empty"),
        ({"chemical_potentials": {"Q": 1.0}}, "not a chemical symbol"),
        ({"defects": ("interstitial:Kr",)}, "no chemical potential for Kr"),
        ({"fmax": 0.0}, "fmax"),
    ],
)
def test_bad_arguments_raise_before_any_work(nn_calc, kwargs, message):
    with pytest.raises(ValueError, match=message):
        defect_formation_energies(
            bulk("Ar", "fcc", a=A_AR, cubic=True), nn_calc, relax=False, **kwargs
        )
