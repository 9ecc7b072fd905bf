"""FIRE, BFGS and MDMin under ASE's cell filters: ASE's path, structure by structure.

References: ASE's own optimizer on ASE's own ``FrechetCellFilter`` or
``UnitCellFilter`` with the same model (float64), run on each structure alone.
Ours relaxes a batch of two strained fcc cells of different sizes (a
non-lower-triangular primitive cell and a cubic 4-atom cell) and must give
every structure ASE's positions, cell and energy after ``STEPS`` steps, and
ASE's converged flag and step count, to ``PATH_TOL``. The filters' coordinates
themselves (``filter.get_positions()``/``get_forces()``) are compared first.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from ase import units
from ase.build import bulk
from ase.constraints import FixAtoms, FixCartesian
from ase.filters import FrechetCellFilter, UnitCellFilter
from ase.optimize import BFGS as AseBFGS
from ase.optimize import FIRE as AseFIRE
from ase.optimize import MDMin as AseMDMin

from nvalchemi_ase import NVAlchemiCalculator, atoms_to_batch
from nvalchemi_ase.optimize import BFGS, FIRE, MDMin
from nvalchemi_ase.optimize.cell_filters import filter_coordinates

try:  # ASE's Fréchet filter calls scipy's LAPACK each step: one BLAS thread is
    # ~8x faster on a busy machine than a contended pool
    from threadpoolctl import threadpool_limits
except ImportError:  # pragma: no cover - the references only run slower
    threadpool_limits = None

STEPS = 30  # steps compared with ASE (most structures have not converged by then)
FMAX = 1e-3  # eV/Å: converged flags and step counts are compared at this threshold
PATH_TOL = 1e-9  # Å (positions, cell) and eV: same algorithm in float64
COORDINATE_TOL = 1e-12  # filter rows (Å or eV/Å) against ASE's, one evaluation
PAIRS = {"FIRE": (FIRE, AseFIRE), "BFGS": (BFGS, AseBFGS), "MDMin": (MDMin, AseMDMin)}
FILTERS = (FrechetCellFilter, UnitCellFilter)
OPTIONS = {
    "scalar_pressure": {"scalar_pressure": 0.3 * units.GPa},
    "hydrostatic_strain": {"hydrostatic_strain": True},
    "constant_volume": {"constant_volume": True},
    "mask": {"mask": [1, 1, 1, 0, 0, 0]},
}


def _strained_cells():
    """A strained primitive fcc cell (1 atom, triclinic) and a cubic one (4 atoms)."""
    primitive = bulk("Ar", "fcc", a=5.2)
    primitive.set_cell(
        primitive.cell @ np.array([[1.03, 0.01, 0], [0, 0.98, 0.02], [0, 0, 1.01]]),
        scale_atoms=True,
    )
    primitive = primitive.repeat((2, 1, 1))
    primitive.rattle(0.05, seed=1)
    cubic = bulk("Ar", "fcc", a=5.4, cubic=True)
    cubic.set_cell(
        cubic.cell @ np.array([[1.0, 0.02, 0], [0, 1.02, 0], [0.01, 0, 0.97]]),
        scale_atoms=True,
    )
    cubic.rattle(0.05, seed=3)
    return [primitive, cubic]


def _one_blas_thread():
    if threadpool_limits is None:
        return contextlib.nullcontext()
    return threadpool_limits(1)


def _fix_an_atom(images):
    """FixAtoms on atom 1 (not at the origin, so a cell change moves it)."""
    for atoms in images:
        atoms.set_constraint(FixAtoms(indices=[1]))
    return images


def _compare(name, cell_filter, options, model, steps=STEPS, *, fix=False, **kwargs):
    """Largest deviation from ASE (positions, cell, energy); flags and counts agree.

    Returns the deviation and how many structures ASE's optimizer converged.
    """
    ours_class, ase_class = PAIRS[name]
    images = _fix_an_atom(_strained_cells()) if fix else _strained_cells()
    optimizer = ours_class(
        [cell_filter(atoms, **options) for atoms in images],
        model=model,
        logfile=None,
        **kwargs,
    )
    optimizer.run(fmax=FMAX, steps=steps)
    deviation, converged_count = 0.0, 0
    references = _fix_an_atom(_strained_cells()) if fix else _strained_cells()
    for index, reference in enumerate(references):
        reference.calc = NVAlchemiCalculator(model, device="cpu", dtype="float64")
        ase_optimizer = ase_class(
            cell_filter(reference, **options), logfile=None, **kwargs
        )
        with _one_blas_thread():
            converged = ase_optimizer.run(fmax=FMAX, steps=steps)
        atoms = images[index]
        deviation = max(
            deviation,
            np.abs(atoms.positions - reference.positions).max(),
            np.abs(atoms.cell.array - reference.cell.array).max(),
            abs(atoms.get_potential_energy() - reference.get_potential_energy()),
        )
        assert optimizer.converged_mask[index] == converged, f"images[{index}]"
        steps_taken = optimizer.converged_at_step[index] if converged else steps
        assert steps_taken == ase_optimizer.nsteps, f"images[{index}]"
        converged_count += converged
    return deviation, converged_count


@pytest.mark.parametrize("cell_filter", FILTERS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("name", list(PAIRS))
def test_path_matches_ase_structure_by_structure(name, cell_filter, lj_calc64):
    deviation, _ = _compare(name, cell_filter, {}, lj_calc64.model)
    assert deviation < PATH_TOL


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize(
    ("name", "cell_filter"),
    [
        ("FIRE", FrechetCellFilter),
        ("BFGS", UnitCellFilter),
        ("MDMin", FrechetCellFilter),
    ],
)
def test_options_follow_ases_path(name, cell_filter, option, lj_calc64):
    deviation, _ = _compare(name, cell_filter, OPTIONS[option], lj_calc64.model)
    assert deviation < PATH_TOL


@pytest.mark.parametrize("cell_filter", FILTERS, ids=lambda f: f.__name__)
def test_fire_converges_at_ases_step(cell_filter, lj_calc64):
    # FIRE needs 42-47 steps here: both structures converge, each at ASE's step
    deviation, converged = _compare("FIRE", cell_filter, {}, lj_calc64.model, 100)
    assert deviation < PATH_TOL
    assert converged == 2


def test_fire_downhill_check_under_a_filter(lj_calc64):
    resets = []  # ours and ASE's: the same structure goes back once in each
    deviation, _ = _compare(
        "FIRE",
        FrechetCellFilter,
        {"scalar_pressure": 0.3 * units.GPa},
        lj_calc64.model,
        dt=0.5,
        downhill_check=True,
        position_reset_callback=lambda *args: resets.append(len(args)),
    )
    assert deviation < PATH_TOL
    assert len(resets) == 2


@pytest.mark.parametrize("cell_filter", FILTERS, ids=lambda f: f.__name__)
def test_filter_coordinates_are_ases(cell_filter, lj_calc64):
    images = _strained_cells()
    filters = [cell_filter(atoms, scalar_pressure=0.01) for atoms in images]
    for atoms in images:  # deformed after the filters were made
        atoms.set_cell(atoms.cell.array @ np.diag([1.02, 0.99, 1.01]), True)
    batch = atoms_to_batch(images, device="cpu", dtype=torch.float64)
    for atoms in images:
        atoms.calc = NVAlchemiCalculator(lj_calc64.model, device="cpu", dtype="float64")
    batch.forces = torch.as_tensor(np.vstack([a.get_forces() for a in images]))
    batch.stress = torch.as_tensor(
        np.stack([a.get_stress(voigt=False) for a in images])
    )
    coordinates = filter_coordinates(filters, cell_filter.__name__, batch)
    atoms_rows, cell_rows = coordinates.positions(batch)
    force_rows, cell_forces = coordinates.forces(batch, batch.forces)
    start = 0
    for index, (atoms, item) in enumerate(zip(images, filters, strict=True)):
        rows = slice(start, start + len(atoms))
        start += len(atoms)
        positions, forces = item.get_positions(), item.get_forces()
        ours = np.vstack([atoms_rows[rows].numpy(), cell_rows[index].numpy()])
        np.testing.assert_allclose(ours, positions, rtol=0, atol=COORDINATE_TOL)
        ours = np.vstack([force_rows[rows].numpy(), cell_forces[index].numpy()])
        np.testing.assert_allclose(ours, forces, rtol=0, atol=COORDINATE_TOL)


@pytest.mark.parametrize("name", list(PAIRS))
def test_fixatoms_moves_with_the_cell_as_in_ase(name, lj_calc64):
    # ASE keeps a fixed atom's filter row: it follows the cell's deformation
    deviation, _ = _compare(name, UnitCellFilter, {}, lj_calc64.model, fix=True)
    assert deviation < PATH_TOL
    start = _strained_cells()[1]
    atoms = _fix_an_atom(_strained_cells())[1]
    PAIRS[name][0](UnitCellFilter(atoms), model=lj_calc64.model, logfile=None).run(
        fmax=FMAX, steps=5
    )
    fractional = np.linalg.solve(atoms.cell.array.T, atoms.positions[1])
    expected = np.linalg.solve(start.cell.array.T, start.positions[1])
    np.testing.assert_allclose(fractional, expected, atol=1e-12)  # moved with it
    assert np.abs(atoms.positions[1] - start.positions[1]).max() > 1e-4


def test_other_constraints_are_refused_under_a_filter(lj_calc64):
    atoms = bulk("Ar", "fcc", a=5.3, cubic=True)
    atoms.set_constraint([FixAtoms(indices=[0]), FixCartesian(1, mask=[1, 0, 0])])
    atoms.calc = lj_calc64
    with pytest.raises(ValueError, match=r"images\[0\] has constraint FixCartesian"):
        BFGS(FrechetCellFilter(atoms), logfile=None)


def test_bfgs_replay_is_refused_under_a_filter(lj_calc64):
    atoms = bulk("Ar", "fcc", a=5.3, cubic=True)
    atoms.calc = lj_calc64
    optimizer = BFGS(UnitCellFilter(atoms), logfile=None)
    with pytest.raises(ValueError, match="not supported with a cell filter"):
        optimizer.replay_trajectory([atoms.copy()])
