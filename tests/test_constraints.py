"""``FixSymmetry``, ``FixCartesian`` and ``FixCom`` in batched dynamics, against ASE.

References: ASE's own optimizers and MD with the same constraint on the same
model (``BFGS`` and ``VelocityVerlet`` here follow ASE step for step, so the
paths must agree to rounding), ASE's ``symmetrize_rank1``/``symmetrize_rank2``
for the tensors, and spglib for the space group a relaxation must keep.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ase import units
from ase.build import bulk
from ase.constraints import (
    FixCartesian,
    FixCom,
    FixSubsetCom,
    FixSymmetry,
    Hookean,
)
from ase.filters import FrechetCellFilter
from ase.md.verlet import VelocityVerlet as AseVelocityVerlet
from ase.optimize import BFGS as AseBFGS
from ase.optimize import LBFGS as AseLBFGS
from ase.spacegroup.symmetrize import symmetrize_rank1, symmetrize_rank2

from nvalchemi_ase import NVAlchemiCalculator, atoms_to_batch
from nvalchemi_ase.dynamics.constraints import BatchConstraints
from nvalchemi_ase.md import VelocityVerlet
from nvalchemi_ase.optimize import BFGS, LBFGS
from tests._tolerances import EXACT
from tests.structures import cluster, rattled_bulk, thermalize

spglib = pytest.importorskip("spglib")

SYMPREC_KEPT = 1e-5  # space group checked this tightly after relaxing
ENERGY_PER_ATOM_TOL = 1e-6  # eV/atom, against ASE's FixSymmetry + LBFGS
FMAX = 1e-4


def _space_group(atoms, symprec=SYMPREC_KEPT):
    cell = (atoms.cell[:], atoms.get_scaled_positions(), atoms.numbers)
    return spglib.get_spacegroup(cell, symprec=symprec)


def _hcp(c_over_a=1.7, repeat=(2, 2, 2)):
    """Distorted-but-symmetric hcp argon (P6_3/mmc), c/a off ideal."""
    atoms = bulk("Ar", "hcp", a=3.9, c=3.9 * c_over_a).repeat(repeat)
    atoms.rattle(1e-3, seed=1)  # FixSymmetry's refinement removes it
    atoms.set_constraint(FixSymmetry(atoms, symprec=0.01))
    return atoms


def _layered():
    """Argon on wurtzite sites with u = 0.42: symmetric, with internal forces."""
    atoms = bulk("ArAr", "wurtzite", a=3.8, c=6.3, u=0.42).repeat((2, 2, 1))
    atoms.set_constraint(FixSymmetry(atoms, symprec=0.01))
    return atoms


def _ase_calculator(model):
    return NVAlchemiCalculator(model, device="cpu", dtype="float64")


def test_symmetrisation_matches_ases_functions():
    images = [_hcp(), _layered()]
    for atoms in images:
        atoms.rattle(0.02, seed=3)  # unsymmetric vectors and cells to act on
    batch = atoms_to_batch(
        images, device="cpu", dtype=torch.float64, warn_dropped=False
    )
    constraints = BatchConstraints(images, batch)
    rng = np.random.default_rng(0)
    vectors = rng.normal(size=(sum(map(len, images)), 3))
    tensors = rng.normal(size=(len(images), 3, 3))
    ours1 = constraints._rank1(torch.tensor(vectors), batch.cell).numpy()
    ours2 = constraints._rank2(torch.tensor(tensors), batch.cell).numpy()
    start = 0
    for index, atoms in enumerate(images):
        fix = atoms.constraints[0]
        rows = slice(start, start + len(atoms))
        lattice, inverse = atoms.get_cell()[:], atoms.cell.reciprocal().T
        theirs1 = symmetrize_rank1(
            lattice,
            inverse,
            vectors[rows],
            fix.rotations,
            fix.translations,
            fix.symm_map,
        )
        theirs2 = symmetrize_rank2(lattice, inverse, tensors[index], fix.rotations)
        np.testing.assert_allclose(ours1[rows], theirs1, atol=1e-13)
        np.testing.assert_allclose(ours2[index], theirs2, atol=1e-13)
        start += len(atoms)


def test_fixed_cell_bfgs_with_fixsymmetry_follows_ase_step_for_step(lj_calc64):
    ours, reference = _layered(), _layered()
    optimizer = BFGS(ours, model=lj_calc64.model, logfile=None)
    assert optimizer.run(fmax=FMAX, steps=100)
    reference.calc = _ase_calculator(lj_calc64.model)
    ase_optimizer = AseBFGS(reference, logfile=None)
    ase_optimizer.run(fmax=FMAX, steps=100)
    assert optimizer.nsteps == ase_optimizer.nsteps > 2
    np.testing.assert_allclose(ours.positions, reference.positions, atol=1e-10)
    assert _space_group(ours) == _space_group(reference)


@pytest.mark.slow  # ASE's LBFGS at small steps beside ours
def test_variable_cell_relaxation_keeps_the_space_group_and_ases_energy(lj_calc64):
    images = [_hcp(1.7), _hcp(1.55, (3, 3, 1)), _hcp(1.62, (1, 1, 2))]  # 16, 18, 4
    groups = [_space_group(atoms) for atoms in images]
    cells = [atoms.cell.cellpar() for atoms in images]
    references = [atoms.copy() for atoms in images]
    filters = [FrechetCellFilter(atoms) for atoms in images]
    assert LBFGS(filters, model=lj_calc64.model, logfile=None).run(fmax=FMAX, steps=300)
    for atoms, reference, group, cell in zip(
        images, references, groups, cells, strict=True
    ):
        assert np.abs(atoms.cell.cellpar() - cell).max() > 1e-2  # the cell relaxed
        reference.calc = _ase_calculator(lj_calc64.model)
        # smaller steps: ASE's FixSymmetry refuses deformation steps above 0.25
        ase_optimizer = AseLBFGS(
            FrechetCellFilter(reference), maxstep=0.05, logfile=None
        )
        ase_optimizer.run(fmax=FMAX, steps=1000)
        assert _space_group(atoms) == group == _space_group(reference)
        difference = atoms.get_potential_energy() - reference.get_potential_energy()
        assert abs(difference) / len(atoms) < ENERGY_PER_ATOM_TOL


@pytest.mark.slow  # ASE's BFGS beside ours: ~11 CPU-s
def test_fixcartesian_follows_ases_bfgs_and_holds_the_masked_components(lj_calc64):
    start = rattled_bulk(repeat=2, seed=7, stdev=0.1)
    start.set_constraint(FixCartesian([0, 3, 5], mask=(True, False, True)))
    ours, reference = start.copy(), start.copy()
    BFGS(ours, model=lj_calc64.model, logfile=None).run(fmax=1e-3, steps=200)
    reference.calc = _ase_calculator(lj_calc64.model)
    AseBFGS(reference, logfile=None).run(fmax=1e-3, steps=200)
    np.testing.assert_allclose(ours.positions, reference.positions, atol=1e-9)
    held = start.positions[[0, 3, 5]][:, [0, 2]]
    np.testing.assert_array_equal(ours.positions[[0, 3, 5]][:, [0, 2]], held)
    assert (
        np.abs(ours.positions[[0, 3, 5], 1] - start.positions[[0, 3, 5], 1]).max()
        > 1e-3
    )


def test_fixcom_velocity_verlet_matches_ase(lj_calc64):
    start = thermalize(rattled_bulk(repeat=2, seed=8), 80.0, seed=9)
    start.set_momenta(start.get_momenta() + 0.5)  # a centre-of-mass drift to remove
    start.set_constraint(FixCom())
    ours, reference = start.copy(), start.copy()
    VelocityVerlet(
        [ours, rattled_bulk(repeat=2, seed=10)], 2 * units.fs, model=lj_calc64.model
    ).run(40)
    reference.calc = _ase_calculator(lj_calc64.model)
    AseVelocityVerlet(reference, 2 * units.fs).run(40)
    np.testing.assert_allclose(
        ours.positions, reference.positions, atol=EXACT[torch.float64]
    )
    np.testing.assert_allclose(
        ours.get_momenta(), reference.get_momenta(), atol=EXACT[torch.float64]
    )
    np.testing.assert_allclose(
        ours.get_center_of_mass(), start.get_center_of_mass(), atol=1e-12
    )


@pytest.mark.slow  # ASE's BFGS beside ours: ~6 CPU-s
def test_fixcom_in_bfgs_weighs_with_the_atoms_masses_as_ases(lj_calc64):
    """The optimizers' unit masses are for their dynamics; FixCom keeps ASE's."""
    start = rattled_bulk(repeat=2, seed=12, stdev=0.1)
    start.set_masses(np.random.default_rng(13).uniform(1.0, 60.0, len(start)))
    start.set_constraint(FixCom())
    ours, reference = start.copy(), start.copy()
    BFGS([cluster(), ours], model=lj_calc64.model, logfile=None).run(
        fmax=1e-3, steps=20
    )
    reference.calc = _ase_calculator(lj_calc64.model)
    AseBFGS(reference, logfile=None).run(fmax=1e-3, steps=20)
    np.testing.assert_allclose(ours.positions, reference.positions, atol=1e-9)
    np.testing.assert_allclose(
        ours.get_center_of_mass(), start.get_center_of_mass(), atol=1e-10
    )


def test_constraints_added_between_runs_are_honoured(lj_calc64):
    atoms = rattled_bulk(repeat=2, seed=11, stdev=0.1)
    optimizer = BFGS(atoms, model=lj_calc64.model, logfile=None)
    optimizer.run(fmax=1e-3, steps=2)
    atoms.set_constraint(FixCartesian([1], mask=(True, True, True)))
    held = atoms.positions[1].copy()
    optimizer.run(fmax=1e-3, steps=20)
    np.testing.assert_array_equal(atoms.positions[1], held)


@pytest.mark.parametrize(
    "constraint",
    [lambda: Hookean(0, 1, k=1.0, rt=4.0), lambda: FixSubsetCom([0, 1])],
    ids=["Hookean", "FixSubsetCom"],
)
def test_other_constraints_are_refused_by_name(constraint, lj_calc64):
    images = [rattled_bulk(repeat=2), cluster()]
    images[1].set_constraint(constraint())
    name = type(images[1].constraints[0]).__name__
    with pytest.raises(ValueError, match=rf"images\[1\] has constraint {name}"):
        BFGS(images, model=lj_calc64.model, logfile=None)


def test_temperatures_count_the_degrees_of_freedom_ase_counts(lj_calc64):
    images = [thermalize(rattled_bulk(repeat=2, seed=s), 80.0, seed=s) for s in (1, 2)]
    images[0].set_constraint(FixCom())
    images[1].set_constraint(FixCartesian([0, 1, 2], mask=(True, False, True)))
    dyn = VelocityVerlet(images, 2 * units.fs, model=lj_calc64.model)
    dyn.run(5)
    ours = dyn.per_structure_thermo()["temperature"]
    theirs = [atoms.get_temperature() for atoms in images]  # 3N - 3, 3N - 6
    np.testing.assert_allclose(ours, theirs, rtol=1e-12)
