"""Constrained runs report the calculator's raw forces and stress, as ASE does.

ASE keeps the calculator's values in ``atoms.calc.results``, in
``get_forces(apply_constraint=False)`` and in trajectory frames; only
``atoms.get_forces()`` (and ``get_stress()``) apply the constraints, on
reading. References: ASE's own optimizers and MD running each structure alone
on the same model, and a fresh single-point evaluation at the final positions.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ase import units
from ase.build import bulk, molecule
from ase.constraints import FixAtoms, FixBondLengths, FixCom, FixSymmetry
from ase.filters import FrechetCellFilter
from ase.io import read
from ase.md.verlet import VelocityVerlet as AseVelocityVerlet
from ase.optimize import BFGS as AseBFGS
from ase.optimize import FIRE as AseFIRE

from nvalchemi_ase import NVAlchemiCalculator
from nvalchemi_ase.md import VelocityVerlet
from nvalchemi_ase.optimize import BFGS, FIRE, LBFGS
from tests._tolerances import EXACT
from tests.structures import cluster, rattled_bulk, thermalize

STEPS = 5
#: ours and ASE's runs follow each other step for step (float64)
TOL = 1e-8
FMAX = 1e-6  # no structure converges within STEPS: every frame is compared


def _structures():
    """Three sizes, three constraints: FixAtoms, FixCom, FixBondLengths."""
    fixed = rattled_bulk(repeat=2, seed=21, stdev=0.1)  # 32 atoms
    fixed.set_constraint(FixAtoms(indices=[0, 5, 9]))
    centred = cluster()  # 55 atoms
    # unequal masses: FixCom then removes a non-zero m_i λ from the forces
    centred.set_masses(np.random.default_rng(23).uniform(20.0, 60.0, len(centred)))
    centred.set_constraint(FixCom())
    bonded = molecule("CH4")
    bonded.symbols = "Ar5"
    bonded.positions *= 3.4  # LJ argon distances
    bonded.rattle(0.1, seed=22)
    bonded.set_constraint(FixBondLengths([(0, 1), (0, 2)]))
    return [fixed, centred, bonded]


def _md_structures():
    images = _structures()
    for seed, atoms in enumerate(images):
        constraints = atoms.constraints
        atoms.set_constraint()
        thermalize(atoms, 60.0, seed=30 + seed)
        atoms.set_constraint(constraints)
    return images


RUNS = {
    "BFGS": (_structures, lambda i, **k: BFGS(i, **k), AseBFGS),
    "FIRE": (_structures, lambda i, **k: FIRE(i, **k), AseFIRE),
    "VelocityVerlet": (
        _md_structures,
        lambda i, **k: VelocityVerlet(i, 2 * units.fs, **k),
        lambda a, **k: AseVelocityVerlet(a, 2 * units.fs, **k),
    ),
}


@pytest.mark.parametrize("name", list(RUNS))
def test_results_and_frames_hold_raw_forces_as_ases(name, lj_calc64, tmp_path):
    make, ours_class, ase_class = RUNS[name]
    images = make()
    references = [atoms.copy() for atoms in images]
    ours = ours_class(
        images,
        model=lj_calc64.model,
        logfile=None,
        trajectory=str(tmp_path / "ours_{i}.traj"),
    )
    ours.run(fmax=FMAX, steps=STEPS) if name != "VelocityVerlet" else ours.run(STEPS)
    fresh = NVAlchemiCalculator(lj_calc64.model, device="cpu", dtype="float64")
    for index, (atoms, reference) in enumerate(zip(images, references, strict=True)):
        reference.calc = NVAlchemiCalculator(
            lj_calc64.model, device="cpu", dtype="float64"
        )
        path = tmp_path / f"ase_{index}.traj"
        dynamics = ase_class(reference, logfile=None, trajectory=str(path))
        (
            dynamics.run(fmax=FMAX, steps=STEPS)
            if name != "VelocityVerlet"
            else dynamics.run(STEPS)
        )
        np.testing.assert_allclose(atoms.positions, reference.positions, atol=TOL)
        raw = reference.get_forces(apply_constraint=False)
        # the raw forces differ from the constrained ones: the check can fail
        assert np.abs(raw - reference.get_forces()).max() > 1e-4
        np.testing.assert_allclose(atoms.calc.results["forces"], raw, atol=TOL)
        np.testing.assert_allclose(
            atoms.get_forces(apply_constraint=False), raw, atol=TOL
        )
        np.testing.assert_allclose(atoms.get_forces(), reference.get_forces(), atol=TOL)
        bare = atoms.copy()
        bare.set_constraint()
        bare.calc = fresh
        np.testing.assert_allclose(
            atoms.calc.results["forces"],
            bare.get_forces(),
            atol=EXACT[torch.float64],
        )
        frames = read(tmp_path / f"ours_{index}.traj", ":")
        ase_frames = read(path, ":")
        assert len(frames) == len(ase_frames) == STEPS + 1
        for frame, ase_frame in zip(frames, ase_frames, strict=True):
            np.testing.assert_allclose(
                frame.get_forces(apply_constraint=False),
                ase_frame.get_forces(apply_constraint=False),
                atol=TOL,
            )
            np.testing.assert_allclose(
                frame.get_forces(), ase_frame.get_forces(), atol=TOL
            )


def test_fixsymmetry_under_a_cell_filter_keeps_the_raw_stress(lj_calc64):
    """FixSymmetry adjusts the stress on reading (``get_stress``) only."""
    atoms = bulk("ArAr", "wurtzite", a=3.8, c=6.3, u=0.42).repeat((2, 2, 1))
    atoms.set_constraint(FixSymmetry(atoms, symprec=0.01))
    # unsymmetric positions (set directly: set_positions would symmetrise)
    atoms.positions += np.random.default_rng(5).normal(scale=0.02, size=(16, 3))
    LBFGS(FrechetCellFilter(atoms), model=lj_calc64.model, logfile=None).run(
        fmax=1e-4, steps=3
    )
    bare = atoms.copy()
    bare.set_constraint()
    bare.calc = NVAlchemiCalculator(lj_calc64.model, device="cpu", dtype="float64")
    raw = bare.get_stress()
    symmetric = raw.copy()
    atoms.constraints[0].adjust_stress(atoms, symmetric)
    assert np.abs(raw - symmetric).max() > 1e-7  # the check can fail
    np.testing.assert_allclose(atoms.calc.results["stress"], raw, atol=TOL)
    np.testing.assert_allclose(atoms.get_stress(apply_constraint=False), raw, atol=TOL)
    np.testing.assert_allclose(atoms.get_stress(), symmetric, atol=TOL)


def test_structures_kept_by_a_resize_keep_their_raw_forces(lj_calc64):
    """Only the admitted structures are evaluated; the kept ones' raw rows stay."""
    kept = rattled_bulk(repeat=2, seed=24, stdev=0.1)
    kept.set_constraint(FixAtoms(indices=[0, 3]))
    admitted = rattled_bulk(repeat=1, seed=25, stdev=0.1)  # 4 atoms
    admitted.set_constraint(FixAtoms(indices=[1]))
    optimizer = BFGS([cluster(), kept], model=lj_calc64.model, logfile=None)
    optimizer.run(fmax=FMAX, steps=2)
    optimizer.resize([1], [admitted])
    optimizer.run(fmax=FMAX, steps=0)  # primes: evaluates the admitted one only
    for atoms in optimizer.images:
        bare = atoms.copy()
        bare.set_constraint()
        bare.calc = NVAlchemiCalculator(lj_calc64.model, device="cpu", dtype="float64")
        raw = bare.get_forces()
        assert np.abs(raw[atoms.constraints[0].index]).min() > 1e-4  # can fail
        np.testing.assert_allclose(atoms.calc.results["forces"], raw, atol=TOL)
        np.testing.assert_allclose(
            atoms.get_forces(apply_constraint=False), raw, atol=TOL
        )
        assert not atoms.get_forces()[atoms.constraints[0].index].any()


def test_a_failed_structure_keeps_the_raw_forces_of_its_last_good_state(tmp_path):
    """The guard puts back the last good state; its raw forces come with it."""
    import warnings

    from nvalchemi_ase.dynamics.failures import StructureFailedWarning

    calc = NVAlchemiCalculator("lj", device="cpu", dtype="float64")
    failing = rattled_bulk(repeat=2, seed=26, stdev=0.1)
    failing.set_constraint(FixAtoms(indices=[2, 7]))
    images = [failing, cluster()]
    model = calc.model
    original = model.forward
    calls = {"n": 0}

    def forward(batch, *args, **kwargs):  # NaN forces for graph 0 from call 3
        outputs = original(batch, *args, **kwargs)
        calls["n"] += 1
        if calls["n"] >= 3:
            forces = outputs["forces"].clone()
            forces[batch.batch_idx.long() == 0] = float("nan")
            outputs["forces"] = forces
        return outputs

    model.forward = forward
    try:
        optimizer = BFGS(
            images,
            model=model,
            logfile=None,
            trajectory=str(tmp_path / "{i}.traj"),
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", StructureFailedWarning)
            optimizer.run(fmax=FMAX, steps=4)
    finally:
        model.__dict__.pop("forward", None)
    assert [failure.index for failure in optimizer.failures] == [0]
    bare = failing.copy()
    bare.set_constraint()
    bare.calc = NVAlchemiCalculator("lj", device="cpu", dtype="float64")
    raw = bare.get_forces()
    assert np.abs(raw[[2, 7]]).min() > 1e-4  # the check can fail
    np.testing.assert_allclose(failing.calc.results["forces"], raw, atol=TOL)
    last = read(tmp_path / "0.traj", -1)
    np.testing.assert_allclose(last.positions, failing.positions, atol=TOL)
    np.testing.assert_allclose(last.get_forces(apply_constraint=False), raw, atol=TOL)


def _assert_reported_as_ase(atoms, model) -> None:
    """``atoms`` reports what ASE reports for its state: the calculator's raw
    forces in ``calc.results`` and ``get_forces(apply_constraint=False)``, the
    constrained ones from ``get_forces()`` (ASE's ``Atoms`` applying them)."""
    reference = atoms.copy()  # the same positions and constraints, no results
    reference.calc = NVAlchemiCalculator(model, device="cpu", dtype="float64")
    raw = reference.get_forces(apply_constraint=False)
    fixed = atoms.constraints[0].index
    assert np.abs(raw[fixed]).min() > 1e-4  # raw and constrained differ: can fail
    for got in (atoms.calc.results["forces"], atoms.get_forces(apply_constraint=False)):
        np.testing.assert_allclose(got, raw, rtol=1e-10, atol=TOL)
    np.testing.assert_allclose(
        atoms.get_forces(), reference.get_forces(), rtol=1e-10, atol=TOL
    )
    assert atoms.get_potential_energy() == pytest.approx(
        reference.get_potential_energy(), rel=1e-10, abs=TOL
    )


def _fixed(atoms, indices):
    atoms.set_constraint(FixAtoms(indices=indices))
    return atoms


DYNAMICS = {
    "BFGS": (lambda images, **k: BFGS(images, **k), {"fmax": FMAX}),
    "VelocityVerlet": (
        lambda images, **k: VelocityVerlet(images, 2 * units.fs, **k),
        {},
    ),
}


@pytest.mark.parametrize("name", list(DYNAMICS))
def test_a_resize_before_any_evaluation_reports_raw_forces(name, lj_calc64):
    """Resized before its first evaluation (the kept structures reordered, one
    with FixAtoms leaving, one arriving), then run: every structure reports
    the raw forces as ASE would, at the start and after steps."""
    make, run = DYNAMICS[name]
    leaving = _fixed(rattled_bulk(repeat=2, seed=31, stdev=0.1), [1, 6])
    kept = _fixed(rattled_bulk(repeat=2, seed=32, stdev=0.1), [0, 3])
    icosahedron = cluster()
    icosahedron.set_constraint(FixAtoms(indices=[4]))  # its raw force is not 0
    arriving = _fixed(rattled_bulk(repeat=1, seed=33, stdev=0.1), [2])
    dynamics = make([kept, leaving, icosahedron], model=lj_calc64.model, logfile=None)
    dynamics.resize([2, 0], [arriving])
    for steps in (0, 2):
        dynamics.run(steps=steps, **run)
        assert dynamics.images == [icosahedron, kept, arriving]
        for atoms in dynamics.images:
            _assert_reported_as_ase(atoms, lj_calc64.model)


def _close_pair(atoms):
    """Two atoms 1.5 Å apart: a largest force of ~6100 eV/Å (argon LJ)."""
    atoms.positions[1] = atoms.positions[0] + [1.5, 0.0, 0.0]
    return atoms


@pytest.mark.parametrize("name", list(DYNAMICS))
@pytest.mark.parametrize("when", ["first run", "admitted", "next run"])
def test_a_structure_failing_at_its_first_evaluation_reports_the_models_forces(
    name, when, lj_calc64
):
    """A structure the guard rejects at the evaluation that starts it (no step
    taken, nothing to go back to) keeps the state it was given, and its
    ``Atoms`` report the model's raw forces and energy for that state, as ASE
    would: at the first run, admitted by a resize (in place of a structure
    of as many atoms), and at a run after the caller moved it."""
    import warnings

    from nvalchemi_ase.dynamics.failures import FailureLimits, StructureFailedWarning

    make, run = DYNAMICS[name]
    limits = FailureLimits(max_force=5.0)  # eV/Å, above the others' forces
    good = _fixed(rattled_bulk(repeat=2, seed=34, stdev=0.1), [0, 3])
    other = _fixed(rattled_bulk(repeat=2, seed=35, stdev=0.1), [1, 4])
    failing = _fixed(rattled_bulk(repeat=2, seed=36, stdev=0.1), [2, 5])
    images = [good, other]
    if when == "first run":
        images = [good, _close_pair(failing)]
    dynamics = make(images, model=lj_calc64.model, logfile=None, failure_limits=limits)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", StructureFailedWarning)
        if when != "first run":
            dynamics.run(steps=2, **run)
        if when == "admitted":
            dynamics.resize([0], [_close_pair(failing)])  # 32 atoms for 32 atoms
        elif when == "next run":
            failing = other
            _close_pair(failing)
        given = failing.positions.copy()
        dynamics.run(steps=2, **run)
    failure = dynamics.failures[-1]
    assert (failure.index, failure.reason) == (
        1,
        "the largest force exceeded max_force (5 eV/Å)",
    )
    # what it keeps is named truly: nothing was put back
    assert failure.restored is False
    expected = "its input state" if when == "first run" else "the state it was given"
    assert str(failure).endswith(f"it keeps {expected}")
    np.testing.assert_array_equal(failing.positions, given)  # never moved
    for atoms in dynamics.images:
        _assert_reported_as_ase(atoms, lj_calc64.model)
