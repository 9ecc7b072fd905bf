"""Behaviours ASE's own md/optimize tests check, on this package's classes.

Each test names the ASE 3.29 test (``ase/test/...``) it follows; ASE's own
class on the same LJ model is the reference wherever the algorithm is ASE's.
"""

from __future__ import annotations

import numpy as np
import pytest
from ase import Atoms, units
from ase.build import bulk
from ase.md import thermalize_momenta
from ase.optimize import FIRE as AseFIRE
from ase.optimize import RestartError

from nvalchemi_ase import NVAlchemiCalculator
from nvalchemi_ase.convert import StructureError
from nvalchemi_ase.dynamics.checkpoint import CheckpointError
from nvalchemi_ase.dynamics.failures import FailureLimits
from nvalchemi_ase.md import Bussi, Langevin, VelocityVerlet
from nvalchemi_ase.optimize import BFGS, FIRE

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


def test_ghost_atoms_are_refused_before_any_model_call(lj_calc64):
    """ase/test/test_stress.py uses bulk('X'); here Z = 0 is named and refused."""
    atoms = bulk("X", "fcc", a=1.5)
    atoms.calc = lj_calc64
    with pytest.raises(StructureError, match=r"numbers\[0\].*outside 1-118"):
        atoms.get_potential_energy()
    argon = atoms.copy()
    argon.numbers[:] = 18  # what to do instead: LJ does not read the element
    argon.calc = lj_calc64
    assert np.isfinite(argon.get_potential_energy())
