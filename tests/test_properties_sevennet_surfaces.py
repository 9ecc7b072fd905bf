"""SevenNet-0 surface and vacancy energies of copper vs ASE's FIRE one by one.

The batched workflows against the sequential ASE loop on the same float32
calculator, plus loose physics bounds around DFT-PBE (Cu γ(111) ≈ 1.3 J/m²,
γ(100) ≈ 1.5 J/m², vacancy ≈ 1.1 eV); the numbers are printed (``pytest -s``).
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from ase.build import bulk, make_supercell, surface
from ase.optimize import FIRE

from nvalchemi_ase.properties import defect_formation_energies, surface_energies

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("sevenn") is None, reason="needs sevenn"
    ),
]

FMAX = 0.05  # eV/Å
# float32 paths of the two sides drift apart; both stop within FMAX of a
# minimum, so energies agree to ~ FMAX² / k plus float32 rounding of ~30 atoms
ENERGY_ATOL = 5e-3  # eV
A_CU = 3.62  # Å, near SevenNet-0's lattice constant


@pytest.fixture(scope="module")
def calc():
    from nvalchemi_ase import NVAlchemiCalculator

    return NVAlchemiCalculator("sevennet-0", device="cpu", dtype="float32")


def _fire(calc, atoms):
    atoms = atoms.copy()
    atoms.calc = calc
    FIRE(atoms, logfile=None).run(fmax=FMAX, steps=300)
    return atoms.get_potential_energy()


@pytest.mark.timeout(1800)  # minutes on a CPU: SevenNet-0 steps of 8-32 atoms
def test_copper_surfaces_and_vacancy_match_ase_and_physics(calc):
    copper = bulk("Cu", "fcc", a=A_CU, cubic=True)
    facets = [(1, 0, 0), (1, 1, 1)]
    (surfaces,) = surface_energies(
        copper, calc, miller=facets, layers=2, vacuum=8.0, fmax=FMAX, steps=300
    )
    assert surfaces.ok, surfaces.error
    e_bulk = calc.get_potential_energy(copper.copy()) / len(copper)
    for hkl, gamma, area in zip(
        facets, surfaces.surface_energies, surfaces.areas, strict=True
    ):
        slab = surface(copper, hkl, 2, vacuum=8.0)
        expected = (_fire(calc, slab) - len(slab) * e_bulk) / (2 * area)
        assert gamma == pytest.approx(expected, abs=ENERGY_ATOL / (2 * area))
    g100, g111 = surfaces.surface_energies_si
    print(f"SevenNet-0 Cu: γ(100) = {g100:.3f}, γ(111) = {g111:.3f} J/m²")  # noqa: T201
    assert 0.8 < g111 < g100 < 2.2

    (defects,) = defect_formation_energies(
        copper, calc, supercell=2, fmax=FMAX, steps=300
    )
    assert defects.ok, defects.error
    perfect = make_supercell(copper, np.diag([2, 2, 2]))
    vacancy = perfect.copy()
    del vacancy[0]
    n = len(perfect)
    expected = _fire(calc, vacancy) - (n - 1) / n * e_bulk * n
    (formation,) = defects.formation_energies
    print(f"SevenNet-0 Cu: vacancy E_f = {formation:.3f} eV")  # noqa: T201
    assert formation == pytest.approx(expected, abs=ENERGY_ATOL)
    assert 0.6 < formation < 1.7
