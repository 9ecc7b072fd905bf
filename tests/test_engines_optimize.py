"""BFGS and MDMin engines: step-for-step against ASE, batching, state, bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ase.build import bulk
from ase.constraints import FixAtoms
from ase.filters import FrechetCellFilter
from ase.optimize import BFGS as AseBFGS
from ase.optimize import MDMin as AseMDMin

from nvalchemi_ase import NVAlchemiCalculator, atoms_to_batch
from nvalchemi_ase._quiet import import_quietly
from nvalchemi_ase.dynamics.neighbors import neighbor_hooks
from nvalchemi_ase.optimize import BFGS, MDMin
from tests.helpers import assert_same_snapshot, snapshot
from tests.structures import A_AR, cluster, rattled_bulk

COMPARED_STEPS = 20  # the first 20 steps are compared with ASE's path
PATH_TOL = 1e-8  # Å, ours vs ASE per step: same algorithm in float64
BATCH_PATH_TOL = 1e-10  # Å, batched vs single-structure run of our own engine
FMAX = 0.01  # eV/Å, convergence threshold for step counts


def fresh_calc(model):
    return NVAlchemiCalculator(model, device="cpu", dtype="float64")


def record_positions(optimizer, atoms):
    """Positions after every step (index 0 = start), read by an observer."""
    frames = []
    optimizer.attach(lambda: frames.append(atoms.positions.copy()))
    return frames


def run_ase(reference_class, atoms, model, fmax=FMAX, **kwargs):
    atoms.calc = fresh_calc(model)
    optimizer = reference_class(atoms, logfile=None, **kwargs)
    frames = record_positions(optimizer, atoms)
    optimizer.run(fmax=fmax, steps=1000)
    return frames, optimizer.nsteps


def largest_step_difference(ours, theirs):
    steps = min(len(ours), len(theirs), COMPARED_STEPS + 1)
    return max(np.abs(ours[i] - theirs[i]).max() for i in range(steps))


@pytest.mark.parametrize(
    ("ours", "theirs", "kwargs"),
    [
        pytest.param(BFGS, AseBFGS, {}, marks=pytest.mark.slow),
        pytest.param(
            BFGS, AseBFGS, {"maxstep": 0.05, "alpha": 30.0}, marks=pytest.mark.slow
        ),
        (MDMin, AseMDMin, {}),
        (MDMin, AseMDMin, {"dt": 0.1, "maxstep": 0.05}),
    ],
)
def test_path_and_step_count_match_ase(ours, theirs, kwargs, lj_calc64):
    start = rattled_bulk(repeat=2, seed=1, stdev=0.1)
    reference = start.copy()
    atoms = start.copy()
    atoms.calc = lj_calc64
    optimizer = ours(atoms, logfile=None, **kwargs)
    frames = record_positions(optimizer, atoms)
    assert optimizer.run(fmax=FMAX, steps=1000)
    expected, expected_steps = run_ase(theirs, reference, lj_calc64.model, **kwargs)
    assert largest_step_difference(frames, expected) < PATH_TOL
    assert optimizer.nsteps == expected_steps


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [pytest.param(BFGS, AseBFGS, marks=pytest.mark.slow), (MDMin, AseMDMin)],
)
def test_frozen_atoms_match_ases_fixatoms(ours, theirs, lj_calc64):
    start = rattled_bulk(repeat=2, seed=3, stdev=0.1)
    start.set_constraint(FixAtoms(indices=[0, 4, 9]))
    reference = start.copy()
    atoms = start.copy()
    atoms.calc = lj_calc64
    optimizer = ours(atoms, logfile=None)
    frames = record_positions(optimizer, atoms)
    optimizer.run(fmax=FMAX, steps=1000)
    expected, expected_steps = run_ase(theirs, reference, lj_calc64.model)
    np.testing.assert_array_equal(
        atoms.positions[[0, 4, 9]], start.positions[[0, 4, 9]]
    )
    assert largest_step_difference(frames, expected) < PATH_TOL
    assert optimizer.nsteps == expected_steps


def mixed_sizes():
    """A 32-atom and a 48-atom crystal and a 55-atom cluster, rattled differently."""
    elongated = bulk("Ar", "fcc", a=A_AR, cubic=True).repeat((3, 2, 2))
    elongated.rattle(0.08, seed=2)
    images = [rattled_bulk(repeat=2, seed=1, stdev=0.1), elongated, cluster()]
    images[2].rattle(0.05, seed=3)
    return images


@pytest.mark.parametrize(
    "optimizer_class", [pytest.param(BFGS, marks=pytest.mark.slow), MDMin]
)
def test_batching_changes_nothing(optimizer_class, lj_calc64):
    """Each structure of a mixed-size batch follows its own single-structure path."""
    images = mixed_sizes()
    singles = [atoms.copy() for atoms in images]
    for atoms in images:
        atoms.calc = lj_calc64
    batched = optimizer_class(images, logfile=None)
    paths = [[] for _ in images]

    def record():
        for path, atoms in zip(paths, images, strict=True):
            path.append(atoms.positions.copy())

    batched.attach(record)
    assert batched.run(fmax=FMAX, steps=1000)
    for index, atoms in enumerate(singles):
        atoms.calc = fresh_calc(lj_calc64.model)
        alone = optimizer_class(atoms, logfile=None)
        own = record_positions(alone, atoms)
        alone.run(fmax=FMAX, steps=1000)
        # the batch keeps converged structures still while the others go on
        batch_path = paths[index][: len(own)]
        difference = max(
            np.abs(a - b).max() for a, b in zip(batch_path, own, strict=True)
        )
        assert difference < BATCH_PATH_TOL, index
        np.testing.assert_array_equal(paths[index][-1], paths[index][len(own) - 1])


@pytest.mark.slow
def test_stopped_structures_resume_where_ase_would(lj_calc64):
    """A second run (tighter fmax) continues each structure exactly as ASE does."""
    images = mixed_sizes()[:2]
    references = [atoms.copy() for atoms in images]
    for atoms in images:
        atoms.calc = lj_calc64
    optimizer = BFGS(images, logfile=None)
    optimizer.run(fmax=0.05)
    optimizer.run(fmax=FMAX)
    for atoms, reference in zip(images, references, strict=True):
        reference.calc = fresh_calc(lj_calc64.model)
        ase_optimizer = AseBFGS(reference, logfile=None)
        ase_optimizer.run(fmax=0.05)
        ase_optimizer.run(fmax=FMAX)
        assert np.abs(atoms.positions - reference.positions).max() < PATH_TOL


def engine_on(images, engine, model):
    """An engine stepping ``images`` directly (no ASE layer), with a status column."""
    batch = atoms_to_batch(images, device="cpu", dtype=torch.float64)
    for hook in neighbor_hooks(model, skin=1.0):
        engine.register_hook(hook)
    batch["status"] = torch.zeros(len(images), 1, dtype=torch.long)
    return batch


@pytest.mark.parametrize(
    "name", [pytest.param("ASEBFGS", marks=pytest.mark.slow), "ASEMDMin"]
)
def test_graphs_past_exit_status_keep_state_and_positions(name, lj_calc64):
    engines = import_quietly("nvalchemi_ase.engines")
    model = lj_calc64.model
    engine = getattr(engines, name)(model)
    batch = engine_on(mixed_sizes(), engine, model)
    engine.step(batch)
    engine.step(batch)
    batch["status"][1, 0] = 1
    frozen_state = {key: value[1].clone() for key, value in engine._state}
    moving_state = {key: value[0].clone() for key, value in engine._state}
    positions = batch.positions.detach().clone()
    engine.step(batch)
    engine.step(batch)
    ptr = batch.batch_ptr.tolist()
    np.testing.assert_array_equal(
        batch.positions[ptr[1] : ptr[2]].detach(), positions[ptr[1] : ptr[2]]
    )
    assert not torch.equal(batch.positions[: ptr[1]], positions[: ptr[1]])
    for key, value in engine._state:
        assert torch.equal(value[1], frozen_state[key]), key
    changed = [
        key
        for key, value in engine._state
        if not torch.equal(value[0], moving_state[key])
    ]
    expected = {"ASEBFGS": {"hessian", "previous_positions", "previous_gradient"}}
    assert set(changed) == expected.get(name, set())


def test_engine_refuses_a_different_batch(lj_calc64):
    engines = import_quietly("nvalchemi_ase.engines")
    model = lj_calc64.model
    engine = engines.ASEBFGS(model)
    engine.step(engine_on(mixed_sizes(), engine, model))
    other = atoms_to_batch(mixed_sizes()[:2], device="cpu", dtype=torch.float64)
    with pytest.raises(RuntimeError, match="holds state for 3 graphs"):
        engine.pre_update(other)


def test_bfgs_state_widens_for_larger_admitted_structures(lj_calc64):
    """Refill (nvalchemi's inflight batching) may admit a larger structure."""
    engines = import_quietly("nvalchemi_ase.engines")
    model = lj_calc64.model
    engine = engines.ASEBFGS(model, alpha=70.0)
    small, large = mixed_sizes()[:2]
    batch = engine_on([small], engine, model)
    engine.step(batch)
    engine.step(batch)  # the second step updates the Hessian
    kept = engine._state.hessian[0].clone()
    template = atoms_to_batch([small, large], device="cpu", dtype=torch.float64)
    engine._sync_state_to_batch(torch.tensor([0]), 1, template)
    width = 3 * len(large)
    assert engine._state.hessian.shape == (2, width, width)
    assert not torch.allclose(kept, 70.0 * torch.eye(96, dtype=torch.float64))
    torch.testing.assert_close(engine._state.hessian[0, :96, :96], kept)
    identity = 70.0 * torch.eye(width, dtype=torch.float64)
    torch.testing.assert_close(engine._state.hessian[1], identity)
    torch.testing.assert_close(engine._state.hessian[0, 96:, 96:], identity[96:, 96:])
    assert engine._state.started.tolist() == [True, False]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda images: BFGS(images, maxstep=-0.1), "maxstep must be positive"),
        (lambda images: BFGS(images, alpha=0.0), "alpha must be positive"),
        (lambda images: MDMin(images, dt=-0.2), "dt must be positive"),
        (lambda images: MDMin(images, maxstep=-1.0), "maxstep must be positive"),
        (
            lambda images: BFGS([FrechetCellFilter(a) for a in images], maxstep=0),
            "maxstep must be positive",
        ),
    ],
)
def test_bad_arguments_raise_before_any_step(make, message, lj_calc64):
    images = [rattled_bulk(repeat=2), rattled_bulk(repeat=2, seed=4)]
    for atoms in images:
        atoms.calc = lj_calc64
    before = [snapshot(atoms) for atoms in images]
    with pytest.raises(ValueError, match=message):
        make(images)
    for snap, atoms in zip(before, images, strict=True):
        assert_same_snapshot(snap, atoms)


def test_very_large_maxstep_warns_like_ase(lj_calc64):
    atoms = rattled_bulk(repeat=2)
    atoms.calc = lj_calc64
    with pytest.warns(UserWarning, match="very"):
        BFGS(atoms, logfile=None, maxstep=1.5)
