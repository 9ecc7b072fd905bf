"""The Optimizer and MolecularDynamics API as ASE 3.29 has it, checked against ASE.

Each test states ASE's behaviour by running ASE's own class beside ours on
the same model and comparing what a script would observe: return values,
convergence answers, the order in which ``irun`` calls ``step``,
``_refresh_properties``, ``log`` and the observers.
"""

from __future__ import annotations

import numpy as np
import pytest
from ase import units
from ase.md.verlet import VelocityVerlet as AseVelocityVerlet
from ase.optimize import BFGS as AseBFGS

from nvalchemi_ase import NVAlchemiCalculator
from nvalchemi_ase.md import VelocityVerlet
from nvalchemi_ase.optimize import BFGS, FIRE
from tests.structures import rattled_bulk, thermalize


def _ase_twin(atoms, model):
    twin = atoms.copy()
    twin.calc = NVAlchemiCalculator(model, device="cpu", dtype="float64")
    return twin


def test_fmax_zero_runs_every_step_as_in_ase(lj_calc64):
    start = rattled_bulk(repeat=2, seed=2, stdev=0.1)
    ours = BFGS(start.copy(), model=lj_calc64.model, logfile=None)
    theirs = AseBFGS(_ase_twin(start, lj_calc64.model), logfile=None)
    assert ours.run(fmax=0.0, steps=5) is False  # ASE's returns np.False_
    assert not theirs.run(fmax=0.0, steps=5)
    assert ours.nsteps == theirs.nsteps == 5
    with pytest.raises(ValueError, match="fmax must be >= 0"):
        ours.run(fmax=-1.0, steps=1)


def test_converged_judges_the_forces_it_is_given(lj_calc64):
    start = rattled_bulk(repeat=2, seed=2, stdev=0.1)
    ours = BFGS(start.copy(), model=lj_calc64.model, logfile=None)
    theirs = AseBFGS(_ase_twin(start, lj_calc64.model), logfile=None)
    ours.run(fmax=0.05, steps=200)
    theirs.run(fmax=0.05, steps=200)
    big, small = np.full((len(start), 3), 10.0), np.zeros((len(start), 3))
    for forces in (big, small):
        assert ours.converged(forces=forces) == theirs.converged(forces=forces)
        assert ours.gradient_converged(-forces.ravel()) == theirs.gradient_converged(
            -forces.ravel()
        )
    assert ours.converged() is True
    assert ours.converged(forces=big) is False  # used to answer True
    with pytest.warns(FutureWarning, match="gradient keyword"):
        assert ours.converged(gradient=-big.ravel()) is False


def test_converged_takes_one_force_array_per_structure(lj_calc64):
    images = [rattled_bulk(repeat=2, seed=s, stdev=0.1) for s in (2, 3)]
    optimizer = BFGS(images, model=lj_calc64.model, logfile=None)
    optimizer.run(fmax=0.05, steps=200)
    small = [np.zeros((len(a), 3)) for a in images]
    assert optimizer.converged(forces=small)
    assert not optimizer.converged(forces=[small[0], np.full((32, 3), 1.0)])
    with pytest.raises(ValueError, match="one force"):
        optimizer.converged(forces=small[:1])


def test_optimizable_is_ases(lj_calc64):
    atoms = rattled_bulk(repeat=2, seed=2, stdev=0.1)
    optimizer = FIRE(atoms, model=lj_calc64.model, logfile=None)
    reference = AseBFGS(_ase_twin(atoms, lj_calc64.model), logfile=None)
    assert type(optimizer.optimizable) is type(reference.optimizable)
    np.testing.assert_array_equal(
        optimizer.optimizable.get_x(), atoms.positions.ravel()
    )
    assert optimizer.optimizable.ndofs() == reference.optimizable.ndofs()


class _Recording:
    """Mixin recording the calls ASE's ``irun`` makes, in order."""

    def step(self, *args):
        self.calls.append("step")
        return super().step(*args)

    def _refresh_properties(self):
        self.calls.append("refresh")
        return super()._refresh_properties()

    def log(self, *args):
        self.calls.append("log")
        return super().log(*args)


class _OurVerlet(_Recording, VelocityVerlet):
    pass


class _AseVerlet(_Recording, AseVelocityVerlet):
    pass


def test_md_irun_calls_step_refresh_log_and_observers_in_ases_order(lj_calc64):
    start = thermalize(rattled_bulk(repeat=2, seed=4), 50.0, seed=5)
    runs = []
    for make in (
        lambda: _OurVerlet(start.copy(), 2 * units.fs, model=lj_calc64.model),
        lambda: _AseVerlet(_ase_twin(start, lj_calc64.model), 2 * units.fs),
    ):
        calls: list[str] = []
        _Recording.calls = calls  # the class attribute both recorders append to
        dyn = make()
        dyn.attach(lambda calls=calls: calls.append("observer"), interval=1)
        dyn.run(3)
        runs.append(list(calls))
    assert runs[0] == runs[1]
    assert runs[0][:3] == ["refresh", "log", "observer"]
    assert runs[0].count("step") == 3
