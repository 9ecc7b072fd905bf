"""Failure isolation: one structure that blows up costs that structure only.

References are independent runs: the same dynamics on the structures without
the bad one, and each structure's input state.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from ase import Atoms, units
from ase.constraints import FixAtoms
from ase.io import read

from nvalchemi_ase import NVAlchemiCalculator
from nvalchemi_ase.dynamics.failures import (
    DynamicsFailureError,
    FailureLimits,
    StructureFailedWarning,
)
from nvalchemi_ase.md import VelocityVerlet
from nvalchemi_ase.optimize import FIRE
from tests.structures import moving_argon_cells

# Batched vs one-by-one evaluation of the same float64 model: round-off only.
SAME_PATH_ATOL = 1e-12


def _colliding_dimer() -> Atoms:
    """Two argon atoms 30 Å apart flying head-on at 1.2 Å/fs each.

    They are out of range of each other (LJ cutoff 8.5 Å) for the first ~9 fs
    and collide at step 12: at ~1.2 Å the LJ force passes 1e4 eV/Å.
    """
    dimer = Atoms("Ar2", positions=[[0, 0, 0], [30.0, 0, 0]], pbc=False)
    dimer.center(vacuum=10.0)
    speed = 1.2 / units.fs  # Å per ASE time unit
    masses = dimer.get_masses()
    dimer.set_momenta([[speed * masses[0], 0, 0], [-speed * masses[1], 0, 0]])
    return dimer


def _poisoned(model, graph: int, at_call: int):
    """Make ``model`` give NaN forces for ``graph`` from its ``at_call``-th call."""
    original = model.forward
    calls = {"n": 0}

    def forward(batch, *args, **kwargs):
        outputs = original(batch, *args, **kwargs)
        calls["n"] += 1
        if calls["n"] >= at_call and batch.num_graphs > graph:
            rows = batch.batch_idx.long() == graph
            forces = outputs["forces"].clone()
            forces[rows] = float("nan")
            outputs["forces"] = forces
        return outputs

    model.forward = forward
    return lambda: model.__dict__.pop("forward", None)


@pytest.fixture
def fresh_lj():
    return NVAlchemiCalculator("lj", device="cpu", dtype="float64")


def _run_vv(images, calc, steps, **kwargs):
    for atoms in images:
        atoms.calc = calc
    dyn = VelocityVerlet(images, 1.0 * units.fs, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", StructureFailedWarning)
        dyn.run(steps)
    return dyn


@pytest.fixture(params=["cpu path", "accelerator path"])
def guard_path(request, monkeypatch):
    """Run the guard as on a CPU, or as on a GPU: no host reads between syncs."""
    if request.param == "accelerator path":
        from nvalchemi_ase import devices

        monkeypatch.setattr(devices, "host_reads_are_free", lambda device: False)
    return request.param


def test_exploding_structure_stops_and_the_others_end_as_without_it(
    tmp_path, guard_path
):
    good = moving_argon_cells(7)
    bad = _colliding_dimer()
    images = (
        [atoms.copy() for atoms in good[:3]]
        + [bad]
        + [atoms.copy() for atoms in good[3:]]
    )
    calc = NVAlchemiCalculator("lj", device="cpu", dtype="float64")
    traj = str(tmp_path / "md_{i}.traj")
    for atoms in images:
        atoms.calc = calc
    dyn = VelocityVerlet(images, 1.0 * units.fs, trajectory=traj)
    with pytest.warns(StructureFailedWarning, match=r"images\[3\] failed at step"):
        dyn.run(40)

    assert [f.index for f in dyn.failures] == [3]
    failure = dyn.failures[0]
    assert 5 < failure.step < 40, failure
    assert "max_force" in failure.reason or "max_displacement" in failure.reason
    assert dyn.failed_mask.tolist() == [i == 3 for i in range(8)]

    reference = [atoms.copy() for atoms in good]
    _run_vv(reference, NVAlchemiCalculator("lj", device="cpu", dtype="float64"), 40)
    others = [atoms for i, atoms in enumerate(images) if i != 3]
    for atoms, expected in zip(others, reference, strict=True):
        np.testing.assert_allclose(
            atoms.positions, expected.positions, atol=SAME_PATH_ATOL, rtol=0
        )
        np.testing.assert_allclose(
            atoms.get_momenta(), expected.get_momenta(), atol=SAME_PATH_ATOL, rtol=0
        )

    # the bad one keeps its last finite state, which is the last frame written
    assert np.isfinite(bad.positions).all()
    frames = read(str(tmp_path / "md_3.traj"), ":")
    assert len(frames) == failure.step  # steps 0 .. step-1, no frame after
    np.testing.assert_array_equal(frames[-1].positions, bad.positions)
    assert np.isfinite(frames[-1].get_potential_energy())
    assert len(read(str(tmp_path / "md_0.traj"), ":")) == 41


def test_nan_forces_in_one_structure_cost_only_that_structure():
    from nvalchemi.dynamics.hooks import NaNDetectorHook

    calc = NVAlchemiCalculator("lj", device="cpu", dtype="float64")
    images = moving_argon_cells(8)
    undo = _poisoned(calc.model, graph=5, at_call=12)
    try:
        for atoms in images:
            atoms.calc = calc
        dyn = VelocityVerlet(images, 1.0 * units.fs)
        dyn.attach(NaNDetectorHook())  # sees finite forces: the guard runs first
        with pytest.warns(StructureFailedWarning, match=r"images\[5\]"):
            dyn.run(30)
    finally:
        undo()
    assert [(f.index, f.step) for f in dyn.failures] == [(5, 11)]
    assert "forces became non-finite" in dyn.failures[0].reason
    reference = [
        atoms.copy() for i, atoms in enumerate(moving_argon_cells(8)) if i != 5
    ]
    _run_vv(reference, NVAlchemiCalculator("lj", device="cpu", dtype="float64"), 30)
    others = [atoms for i, atoms in enumerate(images) if i != 5]
    for atoms, expected in zip(others, reference, strict=True):
        np.testing.assert_allclose(
            atoms.positions, expected.positions, atol=SAME_PATH_ATOL, rtol=0
        )
    assert np.isfinite(images[5].positions).all()
    assert np.isfinite(images[5].get_forces()).all()

    # the object can go on: the failed structure stays where it was
    frozen = images[5].positions.copy()
    with warnings.catch_warnings():
        warnings.simplefilter("error", StructureFailedWarning)  # no new failure
        dyn.run(5)
    np.testing.assert_array_equal(images[5].positions, frozen)
    assert dyn.nsteps == 35


def test_optimizer_returns_when_every_structure_converged_or_failed(guard_path):
    calc = NVAlchemiCalculator("lj", device="cpu", dtype="float64")
    images = moving_argon_cells(6)
    for atoms in images:
        atoms.set_momenta(None)
    undo = _poisoned(calc.model, graph=2, at_call=4)
    try:
        for atoms in images:
            atoms.calc = calc
        opt = FIRE(images, logfile=None)
        with pytest.warns(StructureFailedWarning):
            converged = opt.run(fmax=1e-3)  # ASE's default step limit
    finally:
        undo()
    assert converged is False
    assert opt.failed_mask.tolist() == [i == 2 for i in range(6)]
    assert opt.converged_mask.tolist() == [i != 2 for i in range(6)]
    assert opt.nsteps < 1000
    reference = [
        atoms.copy() for i, atoms in enumerate(moving_argon_cells(6)) if i != 2
    ]
    ref_calc = NVAlchemiCalculator("lj", device="cpu", dtype="float64")
    for atoms in reference:
        atoms.set_momenta(None)
        atoms.calc = ref_calc
    FIRE(reference, logfile=None).run(fmax=1e-3)
    others = [atoms for i, atoms in enumerate(images) if i != 2]
    for atoms, expected in zip(others, reference, strict=True):
        np.testing.assert_allclose(
            atoms.positions, expected.positions, atol=SAME_PATH_ATOL, rtol=0
        )


def test_on_failure_raise_restores_raise_on_first_failure(fresh_lj):
    images = [*moving_argon_cells(3), _colliding_dimer()]
    for atoms in images:
        atoms.calc = fresh_lj
    dyn = VelocityVerlet(images, 1.0 * units.fs, on_failure="raise")
    with pytest.raises(
        DynamicsFailureError, match=r"images\[3\] failed at step \d+"
    ) as info:
        dyn.run(40)
    assert [f.index for f in info.value.failures] == [3]
    assert all(np.isfinite(atoms.positions).all() for atoms in images)


def test_failure_limits_are_checked_and_configurable(fresh_lj):
    with pytest.raises(ValueError, match="on_failure"):
        VelocityVerlet(
            moving_argon_cells(1), 1.0 * units.fs, model="lj", on_failure="ignore"
        )
    with pytest.raises(ValueError, match="max_force"):
        FailureLimits(max_force=-1.0)
    images = moving_argon_cells(2)
    for atoms in images:
        atoms.calc = fresh_lj
    # a limit every structure crosses at once: all stop at step 1, input kept
    tight = FailureLimits(max_displacement=1e-9)
    before = [atoms.positions.copy() for atoms in images]
    dyn = VelocityVerlet(images, 1.0 * units.fs, failure_limits=tight)
    with pytest.warns(StructureFailedWarning):
        dyn.run(3)
    assert [(f.index, f.step) for f in dyn.failures] == [(0, 1), (1, 1)]
    for atoms, positions in zip(images, before, strict=True):
        np.testing.assert_array_equal(atoms.positions, positions)


def test_failed_call_keeps_exact_float64_input():
    calc = NVAlchemiCalculator("lj", device="cpu", dtype="float32")
    images = moving_argon_cells(3)
    before = [(a.positions.copy(), a.cell.array.copy()) for a in images]

    def broken(batch, *args, **kwargs):
        raise RuntimeError("model failed")

    calc.model.forward = broken
    try:
        for atoms in images:
            atoms.calc = calc
        with pytest.raises(RuntimeError, match="model failed"):
            FIRE(images, logfile=None).run(fmax=0.05, steps=5)
    finally:
        del calc.model.forward
    for atoms, (positions, cell) in zip(images, before, strict=True):
        np.testing.assert_array_equal(atoms.positions, positions)
        np.testing.assert_array_equal(atoms.cell.array, cell)


def test_structure_that_did_not_move_keeps_exact_float64_input():
    calc = NVAlchemiCalculator("lj", device="cpu", dtype="float32")
    images = moving_argon_cells(2)
    images[1].set_constraint(FixAtoms(indices=range(len(images[1]))))
    positions = images[1].positions.copy()
    for atoms in images:
        atoms.calc = calc
    VelocityVerlet(images, 1.0 * units.fs).run(5)
    np.testing.assert_array_equal(images[1].positions, positions)
    moved = images[0].positions
    np.testing.assert_array_equal(moved.astype(np.float32).astype(np.float64), moved)


def test_constraint_added_between_runs_is_honoured(fresh_lj):
    images = moving_argon_cells(2)
    for atoms in images:
        atoms.calc = fresh_lj
    dyn = VelocityVerlet(images, 1.0 * units.fs)
    dyn.run(3)
    images[1].set_constraint(FixAtoms(indices=[0]))
    pinned = images[1].positions[0].copy()
    dyn.run(5)
    np.testing.assert_array_equal(images[1].positions[0], pinned)
    assert not np.array_equal(images[1].positions[1], pinned)


def test_guard_costs_no_extra_model_call(fresh_lj):
    calls = {"n": 0}
    original = fresh_lj.model.forward

    def counting(batch, *args, **kwargs):
        calls["n"] += 1
        return original(batch, *args, **kwargs)

    fresh_lj.model.forward = counting
    try:
        images = moving_argon_cells(2)
        for atoms in images:
            atoms.calc = fresh_lj
        VelocityVerlet(images, 1.0 * units.fs).run(10)
    finally:
        del fresh_lj.model.forward
    assert calls["n"] == 11  # one priming evaluation and one per step
    assert torch.get_default_dtype() == torch.float32


def test_relax_then_md_isolates_a_failing_structure():
    def fused(images, calc):
        for atoms in images:
            atoms.calc = calc
        opt = FIRE(images, logfile=None)
        md = VelocityVerlet(images, 1.0 * units.fs)
        return opt.then(md, fmax=0.05, md_steps=10)

    calc = NVAlchemiCalculator("lj", device="cpu", dtype="float64")
    images = moving_argon_cells(4)
    undo = _poisoned(calc.model, graph=1, at_call=6)
    try:
        run = fused(images, calc)
        with pytest.warns(StructureFailedWarning, match=r"images\[1\]"):
            finished = run.run(200)
    finally:
        undo()
    assert finished
    assert [f.index for f in run.failures] == [1]
    reference = [atoms for i, atoms in enumerate(moving_argon_cells(4)) if i != 1]
    fused(reference, NVAlchemiCalculator("lj", device="cpu", dtype="float64")).run(200)
    others = [atoms for i, atoms in enumerate(images) if i != 1]
    for atoms, expected in zip(others, reference, strict=True):
        np.testing.assert_allclose(
            atoms.positions, expected.positions, atol=SAME_PATH_ATOL, rtol=0
        )
    assert np.isfinite(images[1].positions).all()


def test_guard_quick_test_answers_as_the_exact_one(fresh_lj):
    """The cheap whole-batch test may only send a batch on to the exact one."""
    dyn = _run_vv(moving_argon_cells(3), fresh_lj, 2)
    guard, batch = dyn._guard, dyn.batch
    guard.take_snapshot(batch)
    limits = guard.limits

    def verdicts(key, value):
        """(quick, exact, answer) with one component of ``key`` set to ``value``."""
        target = getattr(batch, key)
        saved = target.clone()
        target.view(-1)[0] = value
        try:
            return (
                guard._clearly_within_limits(batch),
                guard._within_limits(batch),
                guard._all_within_limits(batch),
            )
        finally:
            target.copy_(saved)

    position = float(batch.positions[0, 0])
    assert verdicts("positions", position) == (True, True, True)
    for key in ("positions", "velocities", "forces", "cell", "energy"):
        for bad in (float("nan"), float("inf"), -float("inf")):
            assert verdicts(key, bad) == (False, False, False), (key, bad)
    # |F| or a step between limit / sqrt(3) and the limit: the exact test decides
    assert verdicts("forces", 0.9 * limits.max_force) == (False, True, True)
    assert verdicts("forces", 1.01 * limits.max_force) == (False, False, False)
    step = 0.9 * limits.max_displacement
    assert verdicts("positions", position + step) == (False, True, True)
    step = 1.01 * limits.max_displacement
    assert verdicts("positions", position - step) == (False, False, False)


def test_guard_quick_test_catches_infinities_without_a_force_or_step_limit(fresh_lj):
    """Limits of ``math.inf`` (the optimizers' default ``max_force``) reject ±inf."""
    images = moving_argon_cells(3)
    for atoms in images:
        atoms.calc = fresh_lj
    assert FIRE(images, logfile=None)._guard.limits.max_force == float("inf")
    limits = FailureLimits(max_force=float("inf"), max_displacement=float("inf"))
    opt = FIRE(images, logfile=None, failure_limits=limits)
    opt.run(fmax=1e-9, steps=2)
    guard, batch = opt._guard, opt.batch
    guard.take_snapshot(batch)
    for key in ("forces", "positions"):
        for bad in (float("inf"), -float("inf")):
            target = getattr(batch, key)
            saved = target.clone()
            target.view(-1)[0] = bad
            try:
                verdicts = (
                    guard._clearly_within_limits(batch),
                    guard._within_limits(batch),
                )
            finally:
                target.copy_(saved)
            assert verdicts == (False, False), (key, bad)
