"""``dyn.step()`` called by the user moves the ``Atoms`` exactly as ASE's ``step``.

Each batched object steps structures of different sizes (a 4- and a 32-atom
argon cell, a 4-atom triclinic cell and a 3-atom cluster) with ``step()``
only; every structure is compared after every call with ASE's own class
stepping a copy of it alone with ``step()``, on the same LJ model.
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import pytest
from ase import Atoms, units
from ase.filters import FrechetCellFilter
from ase.md.langevin import Langevin as AseLangevin
from ase.md.nvtberendsen import NVTBerendsen as AseNVTBerendsen
from ase.md.verlet import VelocityVerlet as AseVelocityVerlet
from ase.optimize import BFGS as AseBFGS
from ase.optimize import FIRE as AseFIRE
from ase.optimize import MDMin as AseMDMin

from nvalchemi_ase import NVAlchemiCalculator
from nvalchemi_ase.md import Langevin, NVTBerendsen, VelocityVerlet
from nvalchemi_ase.optimize import BFGS, FIRE, MDMin
from tests.structures import rattled_bulk, thermalize, triclinic

STEPS = 3
# Same algorithm, same float64 model: ours and ASE's differ by round-off only.
POSITION_TOL = 1e-10  # Å
MOMENTUM_TOL = 1e-10  # amu Å / ASE time
ENERGY_TOL = 1e-10  # eV
FORCE_TOL = 1e-10  # eV/Å


def _structures() -> list[Atoms]:
    cluster = Atoms("Ar3", positions=[[0, 0, 0], [3.8, 0, 0], [1.9, 3.3, 0.2]])
    cluster.center(vacuum=5.0)
    cluster.pbc = False
    images = [
        rattled_bulk(repeat=1, seed=1),
        rattled_bulk(repeat=2, seed=2),
        triclinic(),
        cluster,
    ]
    for index, atoms in enumerate(images):
        thermalize(atoms, 80.0, seed=20 + index)
    return images


def _fresh(model):
    return NVAlchemiCalculator(model, device="cpu", dtype="float64")


@contextmanager
def _model_calls(model):
    """Count forward calls of ``model`` inside the block."""
    calls = []
    handle = model.register_forward_hook(lambda *_: calls.append(1))
    try:
        yield calls
    finally:
        handle.remove()


def _assert_same(ours: Atoms, theirs: Atoms, model, *, momenta: bool) -> None:
    np.testing.assert_allclose(ours.positions, theirs.positions, atol=POSITION_TOL)
    np.testing.assert_allclose(ours.cell.array, theirs.cell.array, atol=POSITION_TOL)
    if momenta:
        np.testing.assert_allclose(
            ours.get_momenta(), theirs.get_momenta(), atol=MOMENTUM_TOL
        )
    with _model_calls(model) as calls:  # the step left its results in the Atoms
        energy, forces = ours.get_potential_energy(), ours.get_forces()
    assert not calls
    assert energy == pytest.approx(theirs.get_potential_energy(), abs=ENERGY_TOL)
    np.testing.assert_allclose(forces, theirs.get_forces(), atol=FORCE_TOL)


MD_CASES = [
    pytest.param(
        lambda images: VelocityVerlet(images, 2 * units.fs),
        lambda atoms: AseVelocityVerlet(atoms, 2 * units.fs),
        id="VelocityVerlet",
    ),
    pytest.param(  # no friction: ASE's Langevin and ours are velocity Verlet
        lambda images: Langevin(images, 2 * units.fs, 100.0, 0.0, seed=1),
        lambda atoms: AseLangevin(
            atoms, 2 * units.fs, temperature_K=100.0, friction=0, fixcm=False
        ),
        id="Langevin",
    ),
    pytest.param(
        lambda images: NVTBerendsen(
            images, 2 * units.fs, 150.0, 10 * units.fs, fixcm=False
        ),
        lambda atoms: AseNVTBerendsen(
            atoms, 2 * units.fs, temperature_K=150.0, taut=10 * units.fs, fixcm=False
        ),
        id="NVTBerendsen",
    ),
]


@pytest.mark.parametrize(("ours", "theirs"), MD_CASES)
def test_md_step_moves_every_atoms_as_ases_step(ours, theirs, lj_calc64):
    images = _structures()
    references = [atoms.copy() for atoms in images]
    for atoms in images:
        atoms.calc = lj_calc64
    dyn = ours(images)
    ase_dyns = []
    for reference in references:
        reference.calc = _fresh(lj_calc64.model)
        ase_dyns.append(theirs(reference))
    for _ in range(STEPS):
        dyn.step()
        for ase_dyn in ase_dyns:
            ase_dyn.step()
        for atoms, reference in zip(images, references, strict=True):
            _assert_same(atoms, reference, lj_calc64.model, momenta=True)
    assert dyn.nsteps == ase_dyns[0].nsteps == 0  # step() does not count, in ASE
    # a run continues from where the steps left off, as ASE's does
    dyn.run(2)
    for ase_dyn in ase_dyns:
        ase_dyn.run(2)
    for atoms, reference in zip(images, references, strict=True):
        _assert_same(atoms, reference, lj_calc64.model, momenta=True)


OPTIMIZER_CASES = [
    pytest.param(FIRE, AseFIRE, id="FIRE"),
    pytest.param(BFGS, AseBFGS, id="BFGS"),
    pytest.param(MDMin, AseMDMin, id="MDMin"),
]


@pytest.mark.parametrize(("ours", "theirs"), OPTIMIZER_CASES)
def test_optimizer_step_moves_every_atoms_as_ases_step(ours, theirs, lj_calc64):
    images = _structures()[:3]
    references = [atoms.copy() for atoms in images]
    for atoms in images:
        atoms.calc = lj_calc64
    optimizer = ours(images, logfile=None)
    ase_optimizers = []
    for reference in references:
        reference.calc = _fresh(lj_calc64.model)
        ase_optimizers.append(theirs(reference, logfile=None))
    for _ in range(STEPS):
        optimizer.step()
        for ase_optimizer in ase_optimizers:
            ase_optimizer.step()
        for atoms, reference in zip(images, references, strict=True):
            _assert_same(atoms, reference, lj_calc64.model, momenta=False)


def test_cell_filter_step_moves_cells_as_ases_step(lj_calc64):
    images = [rattled_bulk(repeat=1, seed=3), triclinic()]
    for atoms, factor in zip(images, (1.02, 0.98), strict=True):
        atoms.set_cell(atoms.cell * factor, scale_atoms=True)
    references = [atoms.copy() for atoms in images]
    for atoms in images:
        atoms.calc = lj_calc64
    optimizer = FIRE([FrechetCellFilter(atoms) for atoms in images], logfile=None)
    ase_optimizers = []
    for reference in references:
        reference.calc = _fresh(lj_calc64.model)
        ase_optimizers.append(AseFIRE(FrechetCellFilter(reference), logfile=None))
    for _ in range(STEPS):
        optimizer.step()
        for ase_optimizer in ase_optimizers:
            ase_optimizer.step()
        for atoms, reference in zip(images, references, strict=True):
            _assert_same(atoms, reference, lj_calc64.model, momenta=False)
    start_cell = rattled_bulk(repeat=1, seed=3).cell.array * 1.02
    assert np.abs(images[0].cell.array - start_cell).max() > 1e-4  # the cell moved


def test_changes_between_steps_are_taken_in_as_ase_does(lj_calc64):
    """A loop that changes the Atoms between steps (here: stops the atoms)."""
    images = _structures()[:2]
    references = [atoms.copy() for atoms in images]
    for atoms in images:
        atoms.calc = lj_calc64
    dyn = VelocityVerlet(images, 2 * units.fs)
    ase_dyns = []
    for reference in references:
        reference.calc = _fresh(lj_calc64.model)
        ase_dyns.append(AseVelocityVerlet(reference, 2 * units.fs))
    for step in range(STEPS):
        dyn.step()
        for ase_dyn in ase_dyns:
            ase_dyn.step()
        if step == 0:
            for atoms in [*images, *references]:
                atoms.set_momenta(np.zeros((len(atoms), 3)))
    for atoms, reference in zip(images, references, strict=True):
        _assert_same(atoms, reference, lj_calc64.model, momenta=True)


def test_run_writes_back_only_when_needed(lj_calc64):
    """Inside ``run`` the steps leave the Atoms alone; observers decide."""
    images = _structures()[:2]
    for atoms in images:
        atoms.calc = lj_calc64
    dyn = VelocityVerlet(images, 2 * units.fs)
    writes = []
    write_back = dyn._write_back
    dyn._write_back = lambda *a, **k: (writes.append(dyn.nsteps), write_back(*a, **k))
    seen = []
    dyn.attach(lambda: seen.append(images[0].positions.copy()), interval=2)
    dyn.run(3)
    assert writes == [0, 2, 3]  # ASE's interval 2 (steps 0, 2) and the run's end
    reference = _structures()[0]
    reference.calc = _fresh(lj_calc64.model)
    ase_dyn = AseVelocityVerlet(reference, 2 * units.fs)
    ase_seen = []
    ase_dyn.attach(lambda: ase_seen.append(reference.positions.copy()), interval=2)
    ase_dyn.run(3)
    np.testing.assert_allclose(np.array(seen), np.array(ase_seen), atol=POSITION_TOL)
