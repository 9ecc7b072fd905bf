"""Behaviours ASE's own md/optimize tests check, on this package's classes.

Each test names the ASE 3.29 test (``ase/test/...``) it follows; ASE's own
class on the same LJ model is the reference wherever the algorithm is ASE's.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ase import Atoms, units
from ase.build import bulk
from ase.calculators.lj import LennardJones
from ase.md import VelocityVerlet as AseVelocityVerlet
from ase.md import thermalize_momenta
from ase.neighborlist import neighbor_list
from ase.optimize import FIRE as AseFIRE
from ase.optimize import RestartError

from nvalchemi_ase import NVAlchemiCalculator
from nvalchemi_ase.convert import StructureError, atoms_to_batch
from nvalchemi_ase.dynamics.checkpoint import CheckpointError
from nvalchemi_ase.dynamics.failures import FailureLimits
from nvalchemi_ase.md import Bussi, Langevin, VelocityVerlet
from nvalchemi_ase.models import load_model
from nvalchemi_ase.models.builtin import ARGON
from nvalchemi_ase.optimize import BFGS, FIRE
from tests._tolerances import EXACT
from tests.helpers import assert_same_snapshot, snapshot
from tests.structures import A_AR, cluster, rattled_bulk

ENERGY_TOL = 1e-8  # eV, same algorithm and float64 model on both sides


def _fresh(model):
    return NVAlchemiCalculator(model, device="cpu", dtype="float64")


def _distorted_argon():
    """ASE's ``distorted_bulk_gold`` fixture in argon: 2x2x2 fcc, atom 0 moved."""
    atoms = bulk("Ar", "fcc", a=5.26) * (2, 2, 2)
    atoms[0].x += 1.4  # far enough that ASE's FIRE jumps tens of Å
    return atoms


def test_fire_takes_the_long_steps_ases_fire_takes(lj_calc64):
    """ase/test/optimize/test_fire.py: dt = dtmax = 1, maxstep = 100 Å.

    (With ``downhill_check=True`` ASE's path on argon brings two atoms within
    0.04 Å, which the calculator refuses as a duplicated site.)
    """
    kwargs = {"dtmax": 1.0, "dt": 1.0, "maxstep": 100.0, "downhill_check": False}
    reference = _distorted_argon()
    reference.calc = _fresh(lj_calc64.model)
    ase_opt = AseFIRE(reference, logfile=None, **kwargs)
    previous = [reference.positions.copy()]
    longest, strongest = [], []

    def watch():
        step = np.linalg.norm(reference.positions - previous[0], axis=1).max()
        longest.append(step)
        strongest.append(np.linalg.norm(reference.get_forces(), axis=1).max())
        previous[0] = reference.positions.copy()

    ase_opt.attach(watch)
    assert ase_opt.run(fmax=0.001)
    # ASE's own path crosses MD's limits; the optimizer must follow it
    defaults = FailureLimits()
    assert max(longest) > defaults.max_displacement
    assert max(strongest) > defaults.max_force
    atoms = _distorted_argon()
    atoms.calc = lj_calc64
    opt = FIRE(atoms, logfile=None, **kwargs)
    assert opt.run(fmax=0.001)
    assert opt.failures == []
    assert opt.nsteps == ase_opt.nsteps
    assert atoms.get_potential_energy() == pytest.approx(
        reference.get_potential_energy(), abs=ENERGY_TOL
    )


def test_failure_limit_defaults_per_kind(lj_calc64):
    atoms = bulk("Ar", "fcc", a=5.26, cubic=True)
    atoms.calc = lj_calc64
    assert VelocityVerlet(atoms, 1.0)._guard.limits == FailureLimits()
    assert BFGS(atoms, logfile=None)._guard.limits == FailureLimits(
        max_force=np.inf, max_displacement=2.0
    )  # ASE's maxstep 0.2 Å: MD's 2 Å stays
    fire = FIRE(atoms, logfile=None, maxstep=1.5)
    assert fire._guard.limits.max_force == np.inf
    assert fire._guard.limits.max_displacement == 3.0
    given = FailureLimits(max_force=10.0, max_displacement=0.1)
    assert BFGS(atoms, logfile=None, failure_limits=given)._guard.limits == given


@pytest.mark.parametrize("with_atoms", [False, True])
def test_bad_restart_raises_ases_restart_error(tmp_path, with_atoms, lj_calc64):
    """ase/test/optimize/test_restart.py::test_bad_restart."""
    path = tmp_path / "tmp.dat"
    path.write_text("hello world\n")
    atoms = Atoms()
    if with_atoms:
        atoms = bulk("Ar", "fcc", a=5.26, cubic=True)
        atoms.calc = lj_calc64
    with pytest.raises(RestartError, match="Could not decode") as caught:
        BFGS(atoms, restart=str(path))
    assert isinstance(caught.value, CheckpointError)
    assert isinstance(caught.value, ValueError)  # as before
    assert path.read_text() == "hello world\n"  # not overwritten


def test_bussi_attributes_for_one_atoms_are_ases_floats(lj_calc64):
    """ase/test/md/test_bussi.py::test_bussi, on a one-atom argon cell."""
    atoms = bulk("Ar", "fcc", a=5.26)
    atoms.calc = lj_calc64
    with pytest.raises(ValueError, match="zero kinetic energy"):
        Bussi(atoms, 0.1 * units.fs, 300, 100 * units.fs).run(1)
    thermalize_momenta(atoms, 300.0, rng=np.random.default_rng(seed=42))
    with Bussi(atoms, 0.1 * units.fs, 300, 100 * units.fs) as dyn:
        dyn.run(10)
    assert dyn.taut == 100 * units.fs
    assert dyn.temp == 300 * units.kB
    assert dyn.dt == 0.1 * units.fs
    assert dyn.ndof == 3
    assert dyn.target_kinetic_energy == 0.5 * dyn.temp * dyn.ndof
    assert isinstance(dyn.transferred_energy, float)
    assert dyn.transferred_energy != 0.0


def test_bussi_conserves_total_minus_transferred_energy_for_one_atoms(lj_calc64):
    """ase/test/md/test_bussi.py::test_bussi_transfered_energy_conservation."""
    atoms = bulk("Ar", "fcc", a=5.26, cubic=True) * (2, 2, 2)
    atoms.calc = lj_calc64
    thermalize_momenta(atoms, 300.0, rng=np.random.default_rng(seed=42))
    with Bussi(atoms, 1.0e-5 * units.fs, 300, 100 * units.fs, seed=42) as dyn:
        conserved = [
            dyn.atoms.get_total_energy() - dyn.transferred_energy for _ in dyn.irun(100)
        ]
    assert np.unique(np.round(conserved, 10)).size == 1


#: ASE's ``Langevin`` attributes that ASAP reads (ase/test/md/test_langevin_asapcompat).
ASE_LANGEVIN_SPLITTING = ("c1", "c2", "c3", "c4", "c5", "v", "rnd_pos", "rnd_vel")


def test_langevin_has_ases_bath_attributes_not_its_splitting(lj_calc64):
    """Known limit: ``temp`` and ``fr`` are ASE's; the splitting's are not.

    ``c1``-``c5``, ``v``, ``rnd_pos`` and ``rnd_vel`` are the coefficients and
    per-step arrays of ASE's own Langevin splitting, which ASAP re-runs in its
    own code; this class integrates with nvalchemi's BAOAB, so they would
    describe an integrator that is not running (README, Known limits).
    """
    atoms = bulk("Ar", "fcc", a=5.26, cubic=True)
    atoms.calc = lj_calc64
    thermalize_momenta(atoms, 300.0, rng=np.random.default_rng(seed=1))
    dyn = Langevin(atoms, 1 * units.fs, temperature_K=300.0, friction=0.02, seed=1)
    dyn.run(1)
    assert dyn.temp == pytest.approx(300.0 * units.kB)
    assert dyn.fr == 0.02
    assert not any(hasattr(dyn, name) for name in ASE_LANGEVIN_SPLITTING)


def _with_ghosts(atoms, every):
    """``atoms`` with every ``every``-th atom made ASE's ghost atom X (Z = 0)."""
    atoms.numbers[::every] = 0
    return atoms


def _ghost_batch():
    """Structures with and without ghost atoms, of different sizes and kinds."""
    return [
        _with_ghosts(rattled_bulk(repeat=2), every=5),  # 32 atoms, 7 ghosts
        rattled_bulk(repeat=3, seed=2),  # 108 argon atoms, no ghost
        _with_ghosts(cluster(), every=4),  # 55 atoms, no cell
        bulk("X", "fcc", a=A_AR),  # one ghost, primitive cell
    ]


def _ase_lennard_jones(atoms):
    """``atoms`` on ASE's own LJ with this package's argon parameters."""
    reference = atoms.copy()
    reference.calc = LennardJones(
        epsilon=ARGON["epsilon"],
        sigma=ARGON["sigma"],
        rc=ARGON["cutoff"],
        ro=ARGON["cutoff"],
        smooth=False,
    )
    return reference


def _ase_pair_shift(atoms) -> float:
    """ASE's LJ energy minus nvalchemi's: ASE shifts each pair by -u(rc)."""
    ratio = ARGON["sigma"] / ARGON["cutoff"]
    u_rc = 4 * ARGON["epsilon"] * (ratio**12 - ratio**6)
    return -(len(neighbor_list("i", atoms, ARGON["cutoff"])) // 2) * u_rc


def test_ghost_atoms_with_lj_match_ases_lj_in_one_batch(lj_calc64):
    """ase/test/test_stress.py relaxes bulk('X') with LJ, which reads no element."""
    images = _ghost_batch()
    before = [snapshot(atoms) for atoms in images]
    results = lj_calc64.calculate_batch(images, ["energy", "forces", "stress"])
    for snap, atoms in zip(before, images, strict=True):
        assert_same_snapshot(snap, atoms)
    tol = EXACT[torch.float64]
    for atoms, result in zip(images, results, strict=True):
        reference = _ase_lennard_jones(atoms)
        scale = max(1.0, np.abs(reference.get_forces()).max())
        np.testing.assert_allclose(
            result["forces"], reference.get_forces(), rtol=0, atol=tol * scale
        )
        assert result["energy"] == pytest.approx(
            reference.get_potential_energy() - _ase_pair_shift(atoms),
            rel=tol,
            abs=tol * len(atoms),
        )
        if atoms.pbc.all():
            np.testing.assert_allclose(
                result["stress"], reference.get_stress(), rtol=0, atol=tol * 1e-2
            )
        else:
            assert "stress" not in result


def test_ghost_atoms_carry_ases_mass_through_md(lj_calc64):
    """X has mass 1.0 amu in ASE; VelocityVerlet moves it as ASE's does."""
    images = _ghost_batch()[:3]
    batch = atoms_to_batch(images, device="cpu")
    np.testing.assert_array_equal(
        batch.atomic_masses.numpy(),
        np.concatenate([atoms.get_masses() for atoms in images]),
    )
    assert (batch.atomic_numbers.numpy() == 0).sum() == 7 + 14
    references = []
    for index, atoms in enumerate(images):
        thermalize_momenta(atoms, 30.0, rng=np.random.default_rng(seed=index))
        references.append(_ase_lennard_jones(atoms))
    for atoms in images:
        atoms.calc = lj_calc64
    VelocityVerlet(images, 2 * units.fs).run(10)
    for atoms, reference in zip(images, references, strict=True):
        AseVelocityVerlet(reference, 2 * units.fs).run(10)
        np.testing.assert_allclose(
            atoms.positions, reference.positions, rtol=0, atol=POSITION_TOL
        )
        np.testing.assert_array_equal(atoms.numbers, reference.numbers)


@pytest.mark.parametrize("name", ["d3", "demo", "lj+d3"])
def test_a_model_indexing_by_element_refuses_ghosts_naming_the_atom(name):
    """ML and D3 models index tables by Z: a ghost is named before any work."""
    model = load_model(name)
    calc = NVAlchemiCalculator(model, device="cpu")
    images = [rattled_bulk(repeat=2), _with_ghosts(rattled_bulk(repeat=2), every=9)]
    images[1].numbers[0] = 18  # the first ghost is atom 9
    before = [snapshot(atoms) for atoms in images]
    with pytest.raises(StructureError) as info:
        calc.calculate_batch(images)
    message = str(info.value)
    assert message.startswith("images[1].numbers[9]: ")
    assert "cannot evaluate X (atom 9 is X, Z = 0)" in message
    assert "remove the ghost atoms" in message
    assert (info.value.index, info.value.field) == (1, "numbers[9]")
    for snap, atoms in zip(before, images, strict=True):
        assert_same_snapshot(snap, atoms)


def test_sevennet_refuses_ghosts_naming_the_atom():
    pytest.importorskip("sevenn")
    calc = NVAlchemiCalculator("sevennet-0", device="cpu")
    atoms = _with_ghosts(bulk("Cu", cubic=True), every=3)
    atoms.calc = calc
    with pytest.raises(StructureError, match=r"^images\[0\]\.numbers\[0\]: .*Z = 0"):
        atoms.get_potential_energy()


POSITION_TOL = 1e-10  # Å, same algorithm and float64 model on both sides


def _strained_argon(shear: float = 0.15):
    atoms = bulk("Ar", "fcc", a=5.26) * (2, 1, 1)
    atoms.cell[1, 0] += shear  # a sheared cell
    atoms.rattle(0.02, seed=3)
    return atoms


@pytest.mark.parametrize("optimizer", ["FIRE", "BFGS", "MDMin"])
@pytest.mark.parametrize("mask", [None, [1, 1, 0, 0, 0, 1]])
def test_strain_filter_follows_ases_optimizer_step_for_step(lj_calc64, optimizer, mask):
    """ase/test/filter/test_strain*.py: only the cell moves, atoms keep fractions."""
    import ase.optimize
    from ase.filters import StrainFilter

    import nvalchemi_ase.optimize

    options = {"dt": 0.01} if optimizer == "MDMin" else {}
    ours_class = getattr(nvalchemi_ase.optimize, optimizer)
    ase_class = getattr(ase.optimize, optimizer)
    reference = _strained_argon()
    reference.calc = _fresh(lj_calc64.model)
    atoms = _strained_argon()
    atoms.calc = lj_calc64
    fractions = atoms.get_scaled_positions()
    theirs = ase_class(StrainFilter(reference, mask=mask), logfile=None, **options)
    ours = ours_class(StrainFilter(atoms, mask=mask), logfile=None, **options)
    paths = ([], [])
    theirs.attach(lambda: paths[0].append(reference.cell.array.copy()))
    ours.attach(lambda: paths[1].append(atoms.cell.array.copy()))
    theirs.run(fmax=1e-3, steps=12)
    ours.run(fmax=1e-3, steps=12)
    assert ours.nsteps == theirs.nsteps
    np.testing.assert_allclose(paths[1], paths[0], atol=POSITION_TOL)
    np.testing.assert_allclose(atoms.positions, reference.positions, atol=POSITION_TOL)
    np.testing.assert_allclose(atoms.get_scaled_positions(), fractions, atol=1e-12)
    assert not np.allclose(atoms.cell.array, _strained_argon().cell.array)
    if mask is not None:  # masked strain components stay at zero
        deformation = np.linalg.solve(_strained_argon().cell.array, atoms.cell.array)
        assert deformation[2, 2] == pytest.approx(1.0, abs=1e-12)
        assert deformation[1, 2] == pytest.approx(0.0, abs=1e-12)


STRAIN_STEPS = 300  # enough for both to converge


@pytest.mark.parametrize("optimizer", ["FIRE", "BFGS"])
def test_failure_guard_lets_a_large_cells_strain_step_through(lj_calc64, optimizer):
    """A 26 Å cell, 12 % stretched: ASE's first strain step moves far atoms > 2 Å.

    The guard checks the atoms' own displacement past the homogeneous strain
    (the volume limit bounds the cell), so ASE's path is followed, not failed.
    """
    import ase.optimize
    from ase.filters import StrainFilter

    import nvalchemi_ase.optimize

    def stretched():
        atoms = bulk("Ar", "fcc", a=5.26, cubic=True).repeat(4)
        atoms.set_cell(atoms.cell * 1.12, scale_atoms=True)
        return atoms

    reference, atoms = stretched(), stretched()
    reference.calc = _fresh(lj_calc64.model)
    atoms.calc = lj_calc64
    theirs = getattr(ase.optimize, optimizer)(StrainFilter(reference), logfile=None)
    start = reference.positions.copy()
    theirs.run(fmax=1e-3, steps=1)
    moved = np.linalg.norm(reference.positions - start, axis=1).max()
    assert moved > FailureLimits().max_displacement  # ASE's own first step
    assert theirs.run(fmax=1e-3, steps=STRAIN_STEPS)
    ours = getattr(nvalchemi_ase.optimize, optimizer)(StrainFilter(atoms), logfile=None)
    assert ours.run(fmax=1e-3, steps=STRAIN_STEPS + 1)
    assert ours.failures == []
    assert ours.nsteps == theirs.nsteps
    np.testing.assert_allclose(atoms.cell.array, reference.cell.array, atol=1e-8)


def test_strain_filter_is_refused_by_nvalchemis_variable_cell_engines(lj_calc64):
    from ase.filters import StrainFilter

    from nvalchemi_ase.optimize import FIRE2, LBFGS

    atoms = _strained_argon()
    atoms.calc = lj_calc64
    before = atoms.positions.copy()
    for optimizer in (FIRE2, LBFGS):
        with pytest.raises(ValueError, match="StrainFilter is run by FIRE, BFGS"):
            optimizer(StrainFilter(atoms), logfile=None)
    np.testing.assert_array_equal(atoms.positions, before)


def _fire2_argon():
    atoms = bulk("Ar", "fcc", a=5.26, cubic=True)
    atoms.positions[0, 0] += 0.9  # uphill steps: ABC-FIRE restarts
    atoms.rattle(0.05, seed=2)
    return atoms


#: ASE's test_fire2 parameters.
FIRE2_OPTIONS = {
    "dt": 0.1,
    "maxstep": 0.2,
    "dtmax": 1.0,
    "Nmin": 20,
    "finc": 1.1,
    "fdec": 0.5,
    "astart": 0.25,
    "fa": 0.99,
}


@pytest.mark.slow
@pytest.mark.parametrize("cell_filter", [None, "FrechetCellFilter"])
def test_abc_fire2_follows_ases_step_for_step(lj_calc64, cell_filter):
    """ase/test/optimize/test_fire2.py, ``use_abc=True``, restarts included."""
    import ase.filters
    from ase.optimize import FIRE2 as AseFIRE2

    from nvalchemi_ase.optimize import FIRE2

    wrap = getattr(ase.filters, cell_filter) if cell_filter else (lambda a: a)
    reference = _fire2_argon()
    reference.calc = _fresh(lj_calc64.model)
    atoms = _fire2_argon()
    atoms.calc = lj_calc64
    theirs = AseFIRE2(wrap(reference), logfile=None, use_abc=True, **FIRE2_OPTIONS)
    ours = FIRE2(wrap(atoms), logfile=None, use_abc=True, **FIRE2_OPTIONS)
    paths = ([], [])
    theirs.attach(lambda: paths[0].append(reference.positions.copy()))
    ours.attach(lambda: paths[1].append(atoms.positions.copy()))
    restarts = []
    original_step = theirs.step

    def step(*args, **kwargs):
        count = theirs.Nsteps
        original_step(*args, **kwargs)
        restarts.append(count > 0 and theirs.Nsteps == 0)

    theirs.step = step
    assert theirs.run(fmax=1e-3, steps=200)
    assert ours.run(fmax=1e-3, steps=200)
    assert any(restarts)  # the path goes through ASE's forces re-read
    assert ours.nsteps == theirs.nsteps
    np.testing.assert_allclose(paths[1], paths[0], atol=POSITION_TOL)
    np.testing.assert_allclose(atoms.cell.array, reference.cell.array, atol=1e-10)
    assert atoms.get_potential_energy() == pytest.approx(
        reference.get_potential_energy(), abs=ENERGY_TOL
    )


def test_per_atom_stresses_are_not_offered_but_the_ideal_gas_part_is(lj_calc64):
    """ase/test/md/test_idealgas.py: pV = NkT from ``include_ideal_gas``.

    Known limit: ``get_stresses()`` (per atom) needs a model output nvalchemi
    0.3's models do not have; ``get_stress(include_ideal_gas=True)`` works.
    """
    from ase.calculators.calculator import PropertyNotImplementedError

    atoms = bulk("Ar", "sc", a=12.0) * (3, 3, 3)  # beyond the 8.5 Å cutoff
    atoms.calc = lj_calc64
    thermalize_momenta(atoms, 1000.0, rng=np.random.default_rng(17))
    with VelocityVerlet(atoms, 0.1) as md:
        md.run(5)
    stress = atoms.get_stress(include_ideal_gas=True)
    pressure_volume = -stress[:3].sum() / 3 * atoms.cell.volume
    thermal = len(atoms) * units.kB * atoms.get_temperature()
    assert pressure_volume == pytest.approx(thermal, abs=1e-6)
    np.testing.assert_allclose(atoms.get_stress(), 0.0, atol=1e-14)
    with pytest.raises(PropertyNotImplementedError):
        atoms.get_stresses()


def test_fire_downhill_check_follows_ases_path_through_a_near_collision():
    """ase/test/optimize/test_fire.py with ``downhill_check=True``.

    ASE's path on distorted argon brings two atoms within 0.04 Å, then goes
    back (the energy rose). The calculator refuses such a pair as a duplicated
    site when it is *given* one (input); inside a run the dynamics do not
    check it, so this package's FIRE takes ASE's path. Reference and run use
    the same ASE ``LennardJones`` (shifted, as ASE's), through the same numbers.
    """
    from ase.calculators.lj import LennardJones

    from tests.ase_suite.ase_model import AseCalculatorModel

    kwargs = {"dtmax": 1.0, "dt": 1.0, "maxstep": 100.0, "downhill_check": True}

    def lj():
        return LennardJones(sigma=3.4, epsilon=0.0104, rc=8.5)

    reference = _distorted_argon()
    reference.calc = lj()
    ase_opt = AseFIRE(reference, logfile=None, **kwargs)
    closest = []

    def watch():
        distances = reference.get_all_distances(mic=True)
        closest.append(distances[np.triu_indices(len(reference), 1)].min())

    ase_opt.attach(watch)
    assert ase_opt.run(fmax=0.001, steps=500)
    assert min(closest) < 0.1  # what the calculator refuses on input
    atoms = _distorted_argon()
    model = AseCalculatorModel([lj()])
    atoms.calc = NVAlchemiCalculator(model, device="cpu", dtype="float64")
    opt = FIRE(atoms, logfile=None, **kwargs)
    assert opt.run(fmax=0.001, steps=500)
    assert opt.failures == []
    assert opt.nsteps == ase_opt.nsteps
    # the path passes through 1e21 eV: rounding there leaves 4e-8 Å (measured)
    np.testing.assert_allclose(atoms.positions, reference.positions, atol=1e-6)
    assert atoms.get_potential_energy() == pytest.approx(
        reference.get_potential_energy(), abs=ENERGY_TOL
    )
