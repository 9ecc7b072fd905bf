"""The failure guard's second check of a step reads only what may have changed.

At ``AFTER_STEP`` the guard re-checks the batch it checked at
``AFTER_COMPUTE``. What can change in between is the engine's
``post_update`` and the hooks of the later stages; when those are known
(an optimizer's no-op ``post_update``, velocity Verlet's second half kick)
the check reads those fields only, or nothing. These tests pin down when the
narrowing applies, and that a failure appearing after ``AFTER_COMPUTE`` is
still caught, at its step and with its reason, on both guard paths.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from ase import units
from ase.constraints import FixAtoms

from nvalchemi_ase import NVAlchemiCalculator, atoms_to_batch
from nvalchemi_ase._quiet import import_quietly
from nvalchemi_ase.dynamics.failures import (
    FailureGuard,
    FailureLimits,
    StructureFailedWarning,
)
from nvalchemi_ase.md import Langevin, VelocityVerlet
from nvalchemi_ase.optimize import FIRE
from tests.structures import moving_argon_cells


@pytest.fixture
def lj():
    return NVAlchemiCalculator("lj", device="cpu", dtype="float64")


def _with(calc, images):
    for atoms in images:
        atoms.calc = calc
    return images


class _PoisonVelocities:
    """An nvalchemi hook making one structure's velocities NaN at one step."""

    frequency = 1

    def __init__(self, stage, graph: int, at_step: int) -> None:
        self.stage = stage
        self.graph = graph
        self.at_step = at_step
        self.calls = 0

    def __call__(self, ctx, stage) -> None:
        self.calls += 1
        if self.calls == self.at_step:
            batch = ctx.batch
            with torch.no_grad():
                rows = batch.batch_idx == self.graph
                batch.velocities[rows] = float("nan")


def test_what_may_change_between_the_checks(lj):
    """Optimizers: nothing; VelocityVerlet: velocities; otherwise anything."""
    assert (
        FIRE(_with(lj, moving_argon_cells(2)), logfile=None)._changes_after_compute()
        == ()
    )
    dyn = VelocityVerlet(_with(lj, moving_argon_cells(2)), 1.0 * units.fs)
    assert dyn._changes_after_compute() == ("velocities",)
    thermostat = Langevin(
        _with(lj, moving_argon_cells(2)),
        1.0 * units.fs,
        temperature_K=300,
        friction=0.01,
    )
    assert thermostat._changes_after_compute() is None
    frozen = _with(lj, moving_argon_cells(2))
    frozen[0].set_constraint(FixAtoms([0]))  # nvalchemi's FreezeAtomsHook
    assert FIRE(frozen, logfile=None)._changes_after_compute() is None
    # a hook attached later (any stage from AFTER_COMPUTE on) counts at once
    opt = FIRE(_with(lj, moving_argon_cells(2)), logfile=None)
    stages = import_quietly("nvalchemi.dynamics.base").DynamicsStage
    opt.attach(_PoisonVelocities(stages.AFTER_POST_UPDATE, 0, 10**9))
    assert opt._changes_after_compute() is None


@pytest.mark.parametrize("cpu_path", [True, False], ids=["cpu", "accelerator"])
def test_failure_after_compute_is_caught_at_its_step(lj, monkeypatch, cpu_path):
    """NaN velocities written after AFTER_COMPUTE: flagged at that ASE step."""
    if not cpu_path:
        from nvalchemi_ase import devices

        monkeypatch.setattr(devices, "host_reads_are_free", lambda device: False)
    stages = import_quietly("nvalchemi.dynamics.base").DynamicsStage
    opt = FIRE(_with(lj, moving_argon_cells(3)), logfile=None)
    opt.attach(_PoisonVelocities(stages.AFTER_POST_UPDATE, graph=1, at_step=3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", StructureFailedWarning)
        opt.run(fmax=1e-6, steps=6)
    (failure,) = opt.failures
    assert (failure.index, failure.step) == (1, 3)
    assert failure.reason == "velocities became non-finite"
    assert np.isfinite(opt.images[1].positions).all()


@pytest.mark.parametrize(
    ("changes", "flagged"),
    [(None, True), (("velocities",), True), (("forces",), False), ((), False)],
)
def test_check_after_step_reads_the_fields_it_is_told(changes, flagged):
    """The narrowed quick test reads only the changed fields; a bad one is caught.

    A field outside ``changes`` is taken as unchanged since the first check,
    which passed: its corruption here is (by design) not looked at.
    """
    images = moving_argon_cells(3)
    batch = atoms_to_batch(images, device="cpu", dtype="float64")
    guard = FailureGuard(batch, FailureLimits(), ase_step=lambda: 4)
    guard.changes_after_compute = lambda: changes
    guard.take_snapshot(batch)
    before = batch.velocities.clone()
    rows = batch.batch_idx == 2
    with torch.no_grad():
        batch.velocities[rows] = float("inf")
    guard.check_after_step(batch)
    assert guard.failed.tolist() == [False, False, flagged]
    if flagged:
        assert int(guard.step[2]) == 4
        assert int(guard.code[2]) == 2  # velocities
        assert torch.equal(batch.velocities, before)  # put back
