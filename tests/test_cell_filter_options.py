"""Cell-filter options (``scalar_pressure``, ``hydrostatic_strain``,
``constant_volume``, ``mask``) against ASE's filter with ASE's optimizer.

References: ASE's ``LBFGS`` on ASE's ``FrechetCellFilter`` with the same
option, same model; ours must reach the same relaxed cell (1e-3 Å) and
pressure. Each option's invariant is checked on its own too (the shape, the
volume, the masked components), for both variable-cell engines.
"""

from __future__ import annotations

import numpy as np
import pytest
from ase import units
from ase.build import bulk
from ase.filters import FrechetCellFilter
from ase.optimize import LBFGS as AseLBFGS

from nvalchemi_ase import NVAlchemiCalculator
from nvalchemi_ase.optimize import FIRE2, LBFGS

CELL_TOL = 1e-3  # Å, relaxed cell against ASE's
PRESSURE_TOL = 1e-3 * units.GPa  # relaxed pressure against the target / ASE's
FMAX = 1e-4
OPTIONS = {
    "scalar_pressure": {"scalar_pressure": 0.3 * units.GPa},
    "hydrostatic_strain": {"hydrostatic_strain": True},
    "constant_volume": {"constant_volume": True},
    "mask": {"mask": [1, 1, 0, 0, 0, 0]},
}


def _orthorhombic():
    """32 argon atoms in a strained orthorhombic cell (on the axes), rattled."""
    atoms = bulk("Ar", "fcc", a=5.3, cubic=True).repeat((2, 2, 2))
    atoms.set_cell(np.diag([10.4, 10.8, 11.0]), scale_atoms=True)
    atoms.rattle(0.02, seed=1)
    return atoms


def _pressure(atoms):
    return -np.trace(atoms.get_stress(voigt=False)) / 3.0


@pytest.fixture(scope="module")
def ase_relaxed(lj_calc64):
    relaxed = {}
    for name, options in OPTIONS.items():
        atoms = _orthorhombic()
        atoms.calc = NVAlchemiCalculator(lj_calc64.model, device="cpu", dtype="float64")
        AseLBFGS(FrechetCellFilter(atoms, **options), logfile=None).run(
            fmax=FMAX, steps=2000
        )
        relaxed[name] = atoms
    return relaxed


@pytest.mark.slow  # ASE's LBFGS relaxes the references
@pytest.mark.parametrize("name", list(OPTIONS))
def test_lbfgs_reaches_ases_cell(name, ase_relaxed, lj_calc64):
    atoms = _orthorhombic()
    optimizer = LBFGS(
        FrechetCellFilter(atoms, **OPTIONS[name]), model=lj_calc64.model, logfile=None
    )
    assert optimizer.run(fmax=FMAX, steps=2000)
    reference = ase_relaxed[name]
    np.testing.assert_allclose(atoms.cell[:], reference.cell[:], atol=CELL_TOL)
    assert _pressure(atoms) == pytest.approx(_pressure(reference), abs=PRESSURE_TOL)


@pytest.mark.parametrize("optimizer_class", [LBFGS, FIRE2])
def test_each_option_keeps_its_invariant(optimizer_class, lj_calc64):
    images = [_orthorhombic() for _ in OPTIONS]
    start = _orthorhombic()
    filters = [
        FrechetCellFilter(atoms, **options)
        for atoms, options in zip(images, OPTIONS.values(), strict=True)
    ]
    optimizer = optimizer_class(filters, model=lj_calc64.model, logfile=None)
    assert optimizer.run(fmax=FMAX, steps=3000)
    pressure, hydrostatic, constant, masked = images
    assert _pressure(pressure) == pytest.approx(0.3 * units.GPa, abs=PRESSURE_TOL)
    ratios = np.diag(hydrostatic.cell[:]) / np.diag(start.cell[:])
    np.testing.assert_allclose(ratios, ratios[0], rtol=1e-10)  # the shape is kept
    assert abs(ratios[0] - 1.0) > 1e-3  # while the volume changed
    assert constant.get_volume() == pytest.approx(start.get_volume(), rel=1e-12)
    assert masked.cell[2, 2] == pytest.approx(start.cell[2, 2], abs=1e-12)
    assert abs(masked.cell[0, 0] - start.cell[0, 0]) > 1e-3
