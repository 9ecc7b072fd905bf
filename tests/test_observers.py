"""The observer contract: ASE's schedule, trajectories, irun, hooks and stages."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ase import units
from ase.io import read
from ase.io.trajectory import Trajectory
from ase.md.verlet import VelocityVerlet as AseVelocityVerlet
from ase.optimize import FIRE as AseFIRE

from nvalchemi_ase import NVAlchemiCalculator
from nvalchemi_ase.md import VelocityVerlet
from nvalchemi_ase.optimize import FIRE
from tests.structures import cluster, rattled_bulk, thermalize

INTERVALS = [1, 2, 3, 0, -3]


def _pair(lj_calc64):
    atoms = thermalize(rattled_bulk(repeat=2, seed=1, stdev=0.1), 50.0, seed=1)
    reference = atoms.copy()
    atoms.calc = lj_calc64
    reference.calc = NVAlchemiCalculator(lj_calc64.model, device="cpu", dtype="float64")
    return atoms, reference


def _schedule(dyn, interval, steps, runner):
    calls = []
    dyn.attach(lambda: calls.append(dyn.nsteps), interval=interval)
    yields = sum(1 for _ in runner(dyn, steps))
    return calls, yields


@pytest.mark.parametrize("interval", INTERVALS)
def test_md_observer_schedule_frames_and_yields_equal_ases(
    interval, tmp_path, lj_calc64
):
    atoms, reference = _pair(lj_calc64)
    loginterval = abs(interval) or 1
    ours = VelocityVerlet(
        atoms, units.fs, trajectory=tmp_path / "ours.traj", loginterval=loginterval
    )
    theirs = AseVelocityVerlet(
        reference,
        units.fs,
        trajectory=str(tmp_path / "ase.traj"),
        loginterval=loginterval,
    )
    got = _schedule(ours, interval, 7, lambda d, n: d.irun(n))
    expected = _schedule(theirs, interval, 7, lambda d, n: d.irun(n))
    assert got == expected
    assert len(read(tmp_path / "ours.traj", ":")) == len(
        read(tmp_path / "ase.traj", ":")
    )


@pytest.mark.parametrize("interval", INTERVALS)
def test_optimizer_observer_schedule_frames_and_yields_equal_ases(
    interval, tmp_path, lj_calc64
):
    atoms, reference = _pair(lj_calc64)
    loginterval = abs(interval) or 1
    ours = FIRE(
        atoms, logfile=None, trajectory=tmp_path / "ours.traj", loginterval=loginterval
    )
    theirs = AseFIRE(
        reference,
        logfile=None,
        trajectory=str(tmp_path / "ase.traj"),
        loginterval=loginterval,
    )
    got = _schedule(ours, interval, 7, lambda d, n: d.irun(fmax=1e-6, steps=n))
    expected = _schedule(theirs, interval, 7, lambda d, n: d.irun(fmax=1e-6, steps=n))
    assert got == expected
    assert len(read(tmp_path / "ours.traj", ":")) == len(
        read(tmp_path / "ase.traj", ":")
    )


def test_observers_see_the_current_state_without_another_model_call(lj_calc64):
    images = [thermalize(rattled_bulk(repeat=2, seed=s), 50.0, seed=s) for s in (1, 2)]
    for atoms in images:
        atoms.calc = lj_calc64
    dyn = VelocityVerlet(images, units.fs)
    seen = []
    calls = []
    handle = lj_calc64.model.register_forward_hook(lambda *args: calls.append(1))

    def observer():
        before = len(calls)
        seen.append(
            (
                dyn.nsteps,
                images[1].get_potential_energy(),
                images[1].get_forces().copy(),
                images[0].positions.copy(),
            )
        )
        assert len(calls) == before, "an observer's reads triggered a model call"

    try:
        dyn.attach(observer, interval=2)
        dyn.run(4)
    finally:
        handle.remove()
    assert [s[0] for s in seen] == [0, 2, 4]
    assert len(calls) == 5  # one priming evaluation, one per step
    fresh = images[1].copy()
    fresh.calc = NVAlchemiCalculator(lj_calc64.model, device="cpu", dtype="float64")
    assert seen[-1][1] == pytest.approx(fresh.get_potential_energy(), abs=1e-10)
    np.testing.assert_allclose(seen[-1][2], fresh.get_forces(), atol=1e-10)


def test_insert_observer_order_and_write_objects(tmp_path, lj_calc64):
    atoms, _ = _pair(lj_calc64)
    dyn = VelocityVerlet(atoms, units.fs)
    order = []
    dyn.attach(lambda: order.append("second"))
    dyn.insert_observer(lambda: order.append("first"))
    with Trajectory(tmp_path / "manual.traj", "w", atoms) as traj:
        dyn.attach(traj, interval=2)  # an object with .write, as in ASE
        dyn.run(2)
    assert order[:2] == ["first", "second"]
    assert len(read(tmp_path / "manual.traj", ":")) == 2


def test_per_structure_trajectories_from_a_template_carry_results(tmp_path, lj_calc64):
    images = [rattled_bulk(repeat=2, seed=1, stdev=0.1), cluster()]
    for atoms in images:
        atoms.calc = lj_calc64
    opt = FIRE(images, logfile=None, trajectory=str(tmp_path / "relax_{i}.traj"))
    opt.run(fmax=0.01, steps=300)
    for index, atoms in enumerate(images):
        frames = read(tmp_path / f"relax_{index}.traj", ":")
        assert np.allclose(frames[-1].positions, atoms.positions)
        assert frames[-1].get_potential_energy() == pytest.approx(
            atoms.get_potential_energy()
        )
        assert np.linalg.norm(frames[-1].get_forces(), axis=1).max() < 0.01
    assert "stress" in read(tmp_path / "relax_0.traj").calc.results
    with pytest.raises(ValueError, match="one file for 2 structures"):
        FIRE(images, trajectory=str(tmp_path / "one.traj"))


def test_a_structure_stops_getting_frames_once_converged(tmp_path, lj_calc64):
    near = rattled_bulk(repeat=2, seed=1, stdev=0.001)
    far = rattled_bulk(repeat=2, seed=2, stdev=0.15)
    for atoms in (near, far):
        atoms.calc = lj_calc64
    opt = FIRE([near, far], logfile=None, trajectory=str(tmp_path / "t{i}.traj"))
    opt.run(fmax=0.01, steps=500)
    solo = near.copy()
    solo_ref = rattled_bulk(repeat=2, seed=1, stdev=0.001)
    solo_ref.calc = NVAlchemiCalculator(lj_calc64.model, device="cpu", dtype="float64")
    ase_opt = AseFIRE(solo_ref, logfile=None, trajectory=str(tmp_path / "ase.traj"))
    ase_opt.run(fmax=0.01, steps=500)
    del solo
    assert len(read(tmp_path / "t0.traj", ":")) == len(read(tmp_path / "ase.traj", ":"))
    assert len(read(tmp_path / "t1.traj", ":")) == opt.nsteps + 1


def test_appending_writes_the_initial_frame_only_into_empty_files(tmp_path, lj_calc64):
    # ASE's optimizer writes frame 0 only into an empty trajectory (no
    # duplicate when a run continues one); batched, into each empty file.
    old, new = (rattled_bulk(repeat=2, seed=k, stdev=0.1) for k in (1, 2))
    counts = {}
    for name, atoms in (("old", old), ("new", new)):
        solo = atoms.copy()
        solo.calc = NVAlchemiCalculator(lj_calc64.model, device="cpu", dtype="float64")
        for prefix in ("ase", "ours"):
            if name == "old":  # an earlier run's last frame
                with Trajectory(tmp_path / f"{prefix}_old.traj", "w") as writer:
                    writer.write(solo)
        path = tmp_path / f"ase_{name}.traj"
        AseFIRE(solo, logfile=None, trajectory=str(path), append_trajectory=True).run(
            fmax=1e-6, steps=4
        )
        counts[name] = len(read(path, ":"))
    for atoms in (old, new):
        atoms.calc = lj_calc64
    FIRE(
        [old, new],
        logfile=None,
        trajectory=[tmp_path / "ours_old.traj", tmp_path / "ours_new.traj"],
        append_trajectory=True,
    ).run(fmax=1e-6, steps=4)
    assert counts == {"old": 1 + 4, "new": 1 + 4}
    for name in ("old", "new"):
        assert len(read(tmp_path / f"ours_{name}.traj", ":")) == counts[name]


def test_attach_at_a_stage_gates_on_ases_step_count(lj_calc64):
    from nvalchemi.dynamics import DynamicsStage

    atoms, _ = _pair(lj_calc64)
    dyn = VelocityVerlet(atoms, units.fs)
    seen = {}
    for stage in ("ON_ADMISSION", "AFTER_COMPUTE", "BEFORE_STEP", "AFTER_STEP"):
        seen[stage] = []
        dyn.attach_at(stage, lambda s=stage: seen[s].append(dyn.nsteps), interval=2)
    forces_after_compute = []
    dyn.attach_at(
        DynamicsStage.AFTER_COMPUTE,
        lambda: forces_after_compute.append(atoms.get_forces().copy()),
        interval=-3,
    )
    dyn.run(4)
    # during a step nsteps still shows the previous count; the ASE step the
    # stage belongs to (0 for admission and the initial evaluation) gates it
    assert seen["ON_ADMISSION"] == [0]
    assert seen["AFTER_COMPUTE"] == [0, 1, 3]
    assert seen["BEFORE_STEP"] == [1, 3]
    assert seen["AFTER_STEP"] == [1, 3]
    assert len(forces_after_compute) == 1


def test_nvalchemi_hooks_attach_and_run_natively(tmp_path, lj_calc64):
    from nvalchemi.dynamics.hooks import (
        EnergyDriftMonitorHook,
        LoggingHook,
        MaxForceClampHook,
        NaNDetectorHook,
        SnapshotHook,
        StageTimingHook,
    )
    from nvalchemi.dynamics.sinks import HostMemory

    from nvalchemi_ase._quiet import import_quietly

    hooks_module = import_quietly("nvalchemi.hooks")
    images = [thermalize(rattled_bulk(repeat=2, seed=s), 50.0, seed=s) for s in (1, 2)]
    for atoms in images:
        atoms.calc = lj_calc64
    dyn = VelocityVerlet(images, units.fs)
    sink = HostMemory(capacity=100)
    timing = StageTimingHook("step")
    contexts = []

    class Recorder:
        frequency = 1
        stage = import_quietly("nvalchemi.dynamics").DynamicsStage.AFTER_STEP

        def __call__(self, ctx, stage):
            contexts.append((ctx.step_count, ctx.batch.num_graphs))

    bias_calls = []

    def bias(batch):
        bias_calls.append(1)
        zeros_e = torch.zeros(batch.num_graphs, 1, dtype=batch.positions.dtype)
        return zeros_e, torch.zeros_like(batch.positions)

    with pytest.warns(DeprecationWarning):
        biased = hooks_module.BiasedPotentialHook(
            bias, stage=import_quietly("nvalchemi.dynamics").DynamicsStage.AFTER_COMPUTE
        )
    stages = import_quietly("nvalchemi.dynamics").DynamicsStage
    for hook in (
        NaNDetectorHook(),
        EnergyDriftMonitorHook(threshold=1.0, action="raise"),
        LoggingHook(backend="csv", log_path=str(tmp_path / "log.csv")),
        SnapshotHook(sink=sink, frequency=2),
        timing,
        MaxForceClampHook(max_force=10.0),
        biased,
        hooks_module.WrapPeriodicHook(stage=stages.AFTER_POST_UPDATE),
        Recorder(),
    ):
        dyn.attach(hook)
    dyn.run(4)
    assert contexts == [(0, 2), (1, 2), (2, 2), (3, 2)]
    assert len(sink) == 4  # 2 snapshots x 2 structures
    summary = timing.summary()
    assert summary
    assert all(entry["n_samples"] == 4 for entry in summary.values())
    assert bias_calls
    assert (tmp_path / "log.csv").read_text().count("\n") >= 8


@pytest.mark.parametrize("on_failure", ["isolate", "raise"])
def test_nan_in_one_structure_is_caught_and_named(lj_calc64, on_failure):
    from nvalchemi.dynamics.hooks import NaNDetectorHook

    from nvalchemi_ase.dynamics.failures import (
        DynamicsFailureError,
        StructureFailedWarning,
    )

    images = [
        thermalize(rattled_bulk(repeat=2, seed=s), 50.0, seed=s) for s in (1, 2, 3)
    ]
    for atoms in images:
        atoms.calc = lj_calc64
    dyn = VelocityVerlet(images, units.fs, on_failure=on_failure)
    dyn.attach(NaNDetectorHook())
    good_before = images[0].positions.copy()
    broken_before = images[1].positions.copy()

    def poison():
        first_atom_of_structure_1 = int(dyn.batch.batch_ptr[1])
        dyn.batch.positions[first_atom_of_structure_1] = float("nan")

    from nvalchemi_ase._quiet import import_quietly

    stages = import_quietly("nvalchemi.dynamics").DynamicsStage

    class Poison:
        frequency = 1
        stage = stages.AFTER_PRE_UPDATE

        def __call__(self, ctx, stage):
            if ctx.step_count == 2:
                poison()

    dyn.attach(Poison())
    expected = "images[1] failed at step 3: positions became non-finite"
    if on_failure == "raise":
        with pytest.raises(DynamicsFailureError) as error:
            dyn.run(5)
        assert str(error.value).startswith(expected)
        assert dyn.nsteps == 3
    else:
        with pytest.warns(StructureFailedWarning, match=r"images\[1\] failed"):
            dyn.run(5)
        assert [str(f) for f in dyn.failures] == [
            f"{expected}; it keeps its state of step 2"
        ]
        assert dyn.nsteps == 5
    # the guard ran before the user's NaN detector: nothing non-finite reached it;
    # structures that stayed finite keep their progress, the broken one its last state
    assert not np.array_equal(images[0].positions, good_before)
    assert np.isfinite(images[1].positions).all()
    assert not np.array_equal(images[1].positions, broken_before)


def test_todict_and_context_manager(tmp_path, lj_calc64):
    atoms, _ = _pair(lj_calc64)
    with VelocityVerlet(atoms, 2 * units.fs, trajectory=tmp_path / "md.traj") as dyn:
        dyn.run(3)
        assert dyn.todict() == {
            "type": "molecular-dynamics",
            "md-type": "VelocityVerlet",
            "timestep": 2 * units.fs,
        }
        assert dyn.get_time() == pytest.approx(6 * units.fs)
        assert dyn.get_number_of_steps() == 3
    with FIRE(atoms, logfile=None) as opt:
        opt.run(fmax=0.5, steps=2)
        description = opt.todict()
    assert description["optimizer"] == "FIRE"
    assert description["fmax"] == 0.5
    assert len(read(tmp_path / "md.traj", ":")) == 4
