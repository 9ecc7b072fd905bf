"""ASE-style optimizers: per-structure convergence, ASE's minima, variable cell."""

from __future__ import annotations

import numpy as np
import pytest
from ase.build import bulk
from ase.constraints import FixAtoms
from ase.filters import FrechetCellFilter, UnitCellFilter
from ase.optimize import FIRE as AseFIRE
from ase.optimize import LBFGS as AseLBFGS

from nvalchemi_ase import NVAlchemiCalculator
from nvalchemi_ase.optimize import FIRE, FIRE2, LBFGS
from tests.helpers import assert_same_snapshot, snapshot
from tests.structures import cluster, rattled_bulk, triclinic

SAME_MINIMUM_EV_PER_ATOM = 1e-6  # same minimum as ASE's, at a tight fmax (below)
LATTICE_TOL = 1e-3  # Å: variable-cell minimum vs ASE's, both to a tight fmax


def fresh_calc(model):
    return NVAlchemiCalculator(model, device="cpu", dtype="float64")


def mixed_rattled():
    """Different sizes and rattles (2x2x2, 3x3x3 bulk, a cluster)."""
    images = [
        rattled_bulk(repeat=2, seed=1, stdev=0.1),
        rattled_bulk(repeat=3, seed=2, stdev=0.06),
        cluster(),
    ]
    images[2].rattle(0.05, seed=3)
    return images


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [(FIRE, AseFIRE), pytest.param(LBFGS, AseLBFGS, marks=pytest.mark.slow)],
)
def test_batch_reaches_fmax_and_ases_minimum(ours, theirs, lj_calc64):
    images = mixed_rattled()
    originals = [atoms.copy() for atoms in images]
    for atoms in images:
        atoms.calc = lj_calc64
    opt = ours(images, logfile=None)
    assert opt.run(fmax=0.01, steps=2000)
    assert opt.converged_mask.all()
    for atoms in images:
        assert np.linalg.norm(atoms.get_forces(), axis=1).max() <= 0.01
    # Same minimum: at fmax 0.01 soft LJ argon still holds ~1e-4 eV/atom of
    # relaxable energy, so both runs continue to a tight fmax and are compared there.
    opt.run(fmax=2e-4, steps=4000)
    for atoms, original in zip(images, originals, strict=True):
        reference = original.copy()
        reference.calc = fresh_calc(lj_calc64.model)
        assert theirs(reference, logfile=None).run(fmax=2e-4, steps=4000)
        difference = atoms.get_potential_energy() - reference.get_potential_energy()
        assert abs(difference) / len(atoms) < SAME_MINIMUM_EV_PER_ATOM


def test_converged_structures_stop_moving_while_others_go_on(lj_calc64):
    near = rattled_bulk(repeat=2, seed=1, stdev=0.002)
    far = rattled_bulk(repeat=2, seed=2, stdev=0.15)
    for atoms in (near, far):
        atoms.calc = lj_calc64
    opt = FIRE([near, far], logfile=None)
    frozen_at = {}

    def watch():
        for index, done in enumerate(opt.converged_mask):
            if done and index not in frozen_at:
                frozen_at[index] = (opt.nsteps, [near, far][index].positions.copy())

    opt.attach(watch)
    assert opt.run(fmax=0.01, steps=500)
    assert frozen_at[0][0] < frozen_at[1][0]
    np.testing.assert_array_equal(near.positions, frozen_at[0][1])


def test_already_converged_batch_returns_true_without_steps(lj_calc64):
    atoms = bulk("Ar", "fcc", a=5.26, cubic=True)
    atoms.calc = lj_calc64
    opt = LBFGS(atoms, logfile=None)
    assert opt.run(fmax=0.05)
    assert opt.nsteps == 0


def test_frozen_atoms_are_honoured(lj_calc64):
    atoms = rattled_bulk(repeat=2, seed=4, stdev=0.1)
    atoms.set_constraint(FixAtoms(indices=[0, 1, 2]))
    start = atoms.positions[:3].copy()
    atoms.calc = lj_calc64
    assert FIRE(atoms, logfile=None).run(fmax=0.01, steps=500)
    np.testing.assert_array_equal(atoms.positions[:3], start)


VARIABLE_CELL_STRUCTURES = {
    "cubic": lambda: bulk("Ar", "fcc", a=5.6, cubic=True).repeat(2),
    "primitive": lambda: bulk("Ar", "fcc", a=5.5).repeat(3),
}
# ASE's reference is computed once per structure (fixture below), so each case
# costs only its own relaxation. Every filter x optimizer runs on the primitive
# cell (which also needs the rotation to ASE's standard form and back) in the fast
# subset; the cubic cell, whose reference is the costlier one, in the full suite.
VARIABLE_CELL_CASES = [
    pytest.param(
        cell_filter,
        ours,
        name,
        id=f"{cell_filter.__name__}-{ours.__name__}-{name}",
        marks=pytest.mark.slow if name == "cubic" else (),
    )
    for cell_filter in (FrechetCellFilter, UnitCellFilter)
    for ours in (LBFGS, FIRE2)
    for name in VARIABLE_CELL_STRUCTURES
]


@pytest.fixture(scope="module")
def ase_lattice_constant(lj_calc64):
    """ASE's own variable-cell minimum, computed once per structure."""
    cache: dict[str, float] = {}

    def lattice_constant(name: str) -> float:
        if name not in cache:
            reference = VARIABLE_CELL_STRUCTURES[name]()
            reference.rattle(0.01, seed=1)
            reference.calc = fresh_calc(lj_calc64.model)
            AseLBFGS(FrechetCellFilter(reference), logfile=None).run(
                fmax=1e-4, steps=3000
            )
            cache[name] = (4 * reference.get_volume() / len(reference)) ** (1 / 3)
        return cache[name]

    return lattice_constant


@pytest.mark.parametrize(("cell_filter", "ours", "name"), VARIABLE_CELL_CASES)
def test_variable_cell_reaches_ases_lattice_constant(
    cell_filter, ours, name, lj_calc64, ase_lattice_constant
):
    atoms = VARIABLE_CELL_STRUCTURES[name]()
    atoms.rattle(0.01, seed=1)
    original_cell = atoms.cell.array.copy()
    atoms.calc = lj_calc64
    assert ours(cell_filter(atoms), logfile=None).run(fmax=1e-4, steps=3000)
    ours_a = (4 * atoms.get_volume() / len(atoms)) ** (1 / 3)
    assert abs(ours_a - ase_lattice_constant(name)) < LATTICE_TOL
    # the cell comes back in the user's orientation, only strained
    strain = np.linalg.solve(original_cell, atoms.cell.array)
    np.testing.assert_allclose(strain, strain.T, atol=1e-6)


def test_cell_filter_refusals(lj_calc64):
    atoms = rattled_bulk(repeat=2)
    atoms.calc = lj_calc64
    with pytest.raises(ValueError, match="scalar_pressure must be a finite"):
        LBFGS(FrechetCellFilter(atoms, scalar_pressure=float("nan")), logfile=None)
    with pytest.raises(
        TypeError, match=r"images\[1\] is a Atoms but images\[0\] is a Frechet"
    ):
        LBFGS([FrechetCellFilter(atoms), atoms.copy()], logfile=None)


def test_single_structure_log_has_ases_columns(tmp_path, lj_calc64):
    atoms = rattled_bulk(repeat=2, seed=5, stdev=0.05)
    atoms.calc = lj_calc64
    log = tmp_path / "opt.log"
    opt = LBFGS(atoms, logfile=log)
    opt.run(fmax=0.01)
    lines = log.read_text().splitlines()
    assert lines[0].split() == ["Step", "Time", "Energy", "fmax"]
    assert len(lines) == opt.nsteps + 2
    last = lines[-1].split()
    assert last[0] == "LBFGS:"
    assert int(last[1]) == opt.nsteps
    assert float(last[3]) == pytest.approx(atoms.get_potential_energy(), abs=1e-6)
    assert float(last[4]) == pytest.approx(
        np.linalg.norm(atoms.get_forces(), axis=1).max(), abs=1e-6
    )


def test_per_structure_logs_from_a_template(tmp_path, lj_calc64):
    images = mixed_rattled()[:2]
    for atoms in images:
        atoms.calc = lj_calc64
    opt = FIRE(images, logfile=str(tmp_path / "relax_{i}.log"))
    opt.run(fmax=0.01, steps=500)
    for index in range(2):
        lines = (tmp_path / f"relax_{index}.log").read_text().splitlines()
        assert lines[0].split() == ["Step", "Time", "Energy", "fmax"]
        assert float(lines[-1].split()[4]) < 0.01


def test_bad_optimizer_arguments(lj_calc64):
    atoms = rattled_bulk(repeat=2)
    atoms.calc = lj_calc64
    before = snapshot(atoms)
    with pytest.raises(ValueError, match="maxstep must be positive"):
        LBFGS(atoms, maxstep=-0.1)
    with pytest.raises(ValueError, match="fmax must be >= 0"):
        FIRE(atoms, logfile=None).run(fmax=-0.01)
    assert_same_snapshot(before, atoms)


def test_triclinic_and_cluster_relax_with_fire2(lj_calc64):
    images = [triclinic(), cluster()]
    for atoms in images:
        atoms.calc = lj_calc64
    assert FIRE2(images, logfile=None).run(fmax=0.01, steps=2000)


# Batched vs one-by-one evaluation of the same float64 model: round-off only.
SAME_PATH_ATOL = 1e-12


def test_status_column_appears_once_a_structure_converged_and_freezes_it(lj_calc64):
    """No ``status`` column (nvalchemi's masked step) until a structure is done.

    It is created mid-run, at the step the first structure converges; from that
    step on that structure must not move, and each follows the path it takes
    alone.
    """

    def structures():
        return [
            rattled_bulk(repeat=2, seed=1, stdev=0.02),  # converges first
            rattled_bulk(repeat=2, seed=2, stdev=0.15),
        ]

    images = structures()
    for atoms in images:
        atoms.calc = lj_calc64
    opt = FIRE(images, logfile=None)
    seen = []  # (status column present, positions of the early structure)
    opt.attach(lambda: seen.append(("status" in opt.batch, images[0].positions.copy())))
    assert opt.run(fmax=0.01, steps=500)
    early, late = opt.converged_at_step
    assert 0 < early < late
    present = [has_status for has_status, _ in seen]
    assert present == [step >= early for step in range(late + 1)]
    for _, positions in seen[early:]:
        np.testing.assert_array_equal(positions, seen[early][1])
    for index, atoms in enumerate(structures()):
        atoms.calc = fresh_calc(lj_calc64.model)
        alone = FIRE(atoms, logfile=None)
        assert alone.run(fmax=0.01, steps=500)
        assert alone.nsteps == opt.converged_at_step[index]
        np.testing.assert_allclose(
            images[index].positions, atoms.positions, atol=SAME_PATH_ATOL, rtol=0
        )
