"""Exact restart: ``run(n)``, a new object with ``restart=``, ``run(n)`` ≡ ``run(2n)``.

Every ASE-style class continues bit for bit (float64, CPU) from its checkpoint,
on a batch of structures of different sizes, also across processes; damaged,
foreign or mismatched files are refused before anything runs; an interrupted
write leaves the previous checkpoint.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import numpy as np
import pytest
from ase import units
from ase.filters import FrechetCellFilter, UnitCellFilter
from ase.optimize import BFGS as AseBFGS

from nvalchemi_ase.dynamics import checkpoint as checkpoint_module
from nvalchemi_ase.dynamics.checkpoint import (
    DEFAULT_RESTART_INTERVAL,
    CheckpointError,
    read_checkpoint,
    write_checkpoint,
)
from nvalchemi_ase.dynamics.failures import FailureLimits, StructureFailedWarning
from nvalchemi_ase.md import (
    MTKNPT,
    NPH,
    Andersen,
    Bussi,
    IsotropicMTKNPT,
    Langevin,
    LangevinBAOAB,
    NoseHooverChainNVT,
    NVTBerendsen,
    VelocityVerlet,
)
from nvalchemi_ase.optimize import BFGS, FIRE, FIRE2, LBFGS, MDMin
from tests.helpers import assert_same_snapshot, snapshot, spawn_forked
from tests.structures import cluster, rattled_bulk, thermalize, triclinic

ROOT = Path(__file__).resolve().parents[1]
DT = 5 * units.fs


def _structures(calc, *, bulk_only=False):
    """2-3 structures of different sizes (32, 4 and 55 atoms), thermalised."""
    images = [thermalize(rattled_bulk(2), 300.0, 0), thermalize(triclinic(), 300.0, 1)]
    if not bulk_only:
        images.append(thermalize(cluster(), 300.0, 2))
    for atoms in images:
        atoms.calc = calc
    return images


def _filtered(calc, cell_filter=FrechetCellFilter):
    return [cell_filter(atoms) for atoms in _structures(calc, bulk_only=True)]


NPT = {
    "temperature_K": 300.0,
    "pressure_au": 0.0,
    "tdamp": 100 * units.fs,
    "pdamp": 1000 * units.fs,
}

# name -> (factory(calc, **kwargs), steps per half); L-BFGS reaches FMAX (and
# then a zero curvature) within 30 steps; BFGS diagonalises a (3N)² Hessian per
# structure and step, so it gets the two smaller structures
CLASSES = {
    "VelocityVerlet": (lambda c, **k: VelocityVerlet(_structures(c), DT, **k), 50),
    "Langevin": (
        lambda c, **k: Langevin(
            _structures(c), DT, temperature_K=300.0, friction=0.01 / units.fs, **k
        ),
        50,
    ),
    "LangevinBAOAB": (
        lambda c, **k: LangevinBAOAB(
            _structures(c), DT, temperature_K=300.0, T_tau=50 * DT, seed=4, **k
        ),
        50,
    ),
    "LangevinBAOAB-NPT": (
        lambda c, **k: LangevinBAOAB(
            _structures(c, bulk_only=True),
            DT,
            temperature_K=300.0,
            T_tau=50 * DT,
            externalstress=-0.1 * units.GPa,
            P_tau=1000 * units.fs,
            P_mass=1e4,
            seed=4,
            **k,
        ),
        50,
    ),
    "NoseHooverChainNVT": (
        lambda c, **k: NoseHooverChainNVT(
            _structures(c), DT, temperature_K=300.0, tdamp=100 * units.fs, **k
        ),
        50,
    ),
    "IsotropicMTKNPT": (
        lambda c, **k: IsotropicMTKNPT(_structures(c, bulk_only=True), DT, **NPT, **k),
        50,
    ),
    "MTKNPT": (
        lambda c, **k: MTKNPT(_structures(c, bulk_only=True), DT, **NPT, **k),
        50,
    ),
    "IsotropicMTKNPT-tchain3-pchain2": (
        lambda c, **k: IsotropicMTKNPT(
            _structures(c, bulk_only=True), DT, tchain=3, pchain=2, **NPT, **k
        ),
        50,
    ),
    "MTKNPT-tchain2-pchain4": (
        lambda c, **k: MTKNPT(
            _structures(c, bulk_only=True), DT, tchain=2, pchain=4, **NPT, **k
        ),
        50,
    ),
    "MTKNPT-tchain1-pchain2": (  # the one-link chain's frozen link, rebuilt
        lambda c, **k: MTKNPT(
            _structures(c, bulk_only=True), DT, tchain=1, pchain=2, **NPT, **k
        ),
        50,
    ),
    "NPH": (
        lambda c, **k: NPH(
            _structures(c, bulk_only=True),
            DT,
            pressure_au=0.0,
            pdamp=1000 * units.fs,
            pressure_coupling="triclinic",
            **k,
        ),
        50,
    ),
    "Bussi": (
        lambda c, **k: Bussi(
            _structures(c), DT, temperature_K=300.0, taut=100 * units.fs, **k
        ),
        50,
    ),
    "NVTBerendsen": (
        lambda c, **k: NVTBerendsen(
            _structures(c), DT, temperature_K=300.0, taut=100 * units.fs, **k
        ),
        50,
    ),
    "Andersen": (
        lambda c, **k: Andersen(
            _structures(c), DT, temperature_K=300.0, andersen_prob=0.05, **k
        ),
        50,
    ),
    "FIRE": (lambda c, **k: FIRE(_structures(c), logfile=None, **k), 50),
    "FIRE-FrechetCellFilter": (
        lambda c, **k: FIRE(_filtered(c), logfile=None, **k),
        50,
    ),
    "FIRE-UnitCellFilter": (
        lambda c, **k: FIRE(_filtered(c, UnitCellFilter), logfile=None, **k),
        50,
    ),
    "FIRE2": (lambda c, **k: FIRE2(_structures(c), logfile=None, **k), 50),
    "FIRE2-FrechetCellFilter": (
        lambda c, **k: FIRE2(_filtered(c), logfile=None, **k),
        50,
    ),
    "LBFGS": (lambda c, **k: LBFGS(_structures(c), logfile=None, **k), 10),
    "LBFGS-FrechetCellFilter": (
        lambda c, **k: LBFGS(_filtered(c), logfile=None, **k),
        10,
    ),
    "BFGS": (
        lambda c, **k: BFGS(_structures(c, bulk_only=True), logfile=None, **k),
        20,
    ),
    "BFGS-FrechetCellFilter": (
        lambda c, **k: BFGS(_filtered(c), logfile=None, **k),
        20,
    ),
    "BFGS-UnitCellFilter": (
        lambda c, **k: BFGS(_filtered(c, UnitCellFilter), logfile=None, **k),
        20,
    ),
    "MDMin": (lambda c, **k: MDMin(_structures(c), logfile=None, **k), 50),
    "MDMin-FrechetCellFilter": (
        lambda c, **k: MDMin(_filtered(c), logfile=None, **k),
        50,
    ),
    "MDMin-UnitCellFilter": (
        lambda c, **k: MDMin(_filtered(c, UnitCellFilter), logfile=None, **k),
        50,
    ),
}
STOCHASTIC = {"Langevin", "Bussi", "Andersen"}
FMAX = 1e-9  # eV/Å: no structure converges before the second half ends


def _run(dyn, steps):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        if hasattr(dyn, "fmax"):
            return dyn.run(fmax=FMAX, steps=steps)
        return dyn.run(steps)


def _seed(name, seed):
    return {"seed": seed} if name in STOCHASTIC else {}


def _assert_same_state(expected, actual):
    assert actual.nsteps == expected.nsteps
    for reference, atoms in zip(expected.images, actual.images, strict=True):
        np.testing.assert_array_equal(atoms.positions, reference.positions)
        np.testing.assert_array_equal(atoms.get_momenta(), reference.get_momenta())
        np.testing.assert_array_equal(atoms.cell.array, reference.cell.array)
    np.testing.assert_array_equal(
        actual.batch.velocities.numpy(), expected.batch.velocities.numpy()
    )


@pytest.mark.parametrize("name", list(CLASSES))
def test_restart_continues_bit_for_bit(name, tmp_path, lj_calc64):
    make, steps = CLASSES[name]
    path = tmp_path / "restart.npz"
    reference = make(lj_calc64, **_seed(name, 1))
    _run(reference, 2 * steps)
    first = make(lj_calc64, restart=path, **_seed(name, 1))
    _run(first, steps)
    assert first.nsteps == steps
    assert path.exists()
    # a fresh copy of the input; a stochastic class gets another seed, which the
    # checkpoint's overrides
    second = make(lj_calc64, restart=path, **_seed(name, 2))
    assert second.nsteps == steps
    _assert_same_state(first, second)  # the structures are restored at once
    _run(second, steps)
    _assert_same_state(reference, second)
    if hasattr(reference, "converged_mask"):
        np.testing.assert_array_equal(second.converged_mask, reference.converged_mask)
    if name in STOCHASTIC:
        assert second.seed == 1
    if name in ("VelocityVerlet", "Langevin"):
        assert second.get_time() == pytest.approx(2 * steps * DT)


def _on_the_moved_structures(filters, cell_filter, calc):
    """New filters on copies of the structures a run left (ASE's restart test)."""
    moved = []
    for old in filters:
        atoms = old.atoms.copy()
        atoms.calc = calc
        moved.append(cell_filter(atoms))
    return moved


@pytest.mark.parametrize(
    "cell_filter", [FrechetCellFilter, UnitCellFilter], ids=lambda c: c.__name__
)
def test_restart_on_the_moved_structures_restores_the_filters_orig_cell(
    cell_filter, tmp_path, lj_calc64
):
    """A filter built on the restarted structure gets the run's ``orig_cell``.

    ASE's BFGS dumps the filter's ``orig_cell`` and sets it back on restart; the
    filter coordinates (cell part log/linear in F = L0⁻¹ L) and the steps are
    then the uninterrupted run's.
    """
    steps = 5
    reference = BFGS(_filtered(lj_calc64, cell_filter), logfile=None)
    _run(reference, 2 * steps)
    filters = _filtered(lj_calc64, cell_filter)
    origin = [np.array(f.orig_cell) for f in filters]
    first = BFGS(filters, restart=tmp_path / "restart.npz", logfile=None)
    _run(first, steps)
    moved = _on_the_moved_structures(filters, cell_filter, lj_calc64)
    second = BFGS(moved, restart=tmp_path / "restart.npz", logfile=None)
    # ASE's own BFGS, restarted the same way from its own file, does the same
    ase_filters = _filtered(lj_calc64, cell_filter)
    ase_path = tmp_path / "ase.json"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # ASE: restart "untested"
        AseBFGS(ase_filters[0], restart=str(ase_path), logfile=None).run(
            fmax=FMAX, steps=steps
        )
        ase_moved = _on_the_moved_structures(ase_filters, cell_filter, lj_calc64)
        AseBFGS(ase_moved[0], restart=str(ase_path), logfile=None)
    np.testing.assert_array_equal(np.array(ase_moved[0].orig_cell), origin[0])
    for restored, expected in zip(moved, origin, strict=True):
        np.testing.assert_array_equal(np.array(restored.orig_cell), expected)
    _run(second, steps)
    _assert_same_state(reference, second)


def test_fire_downhill_check_keeps_the_positions_it_would_go_back_to(
    tmp_path, lj_calc64
):
    """ASE's FIRE restart forgets them; here the first step after it can go back."""
    path = tmp_path / "fire.npz"

    def make(**kwargs):
        return FIRE(
            _structures(lj_calc64),
            logfile=None,
            downhill_check=True,
            maxstep=0.4,
            **kwargs,
        )

    first = make(restart=path)
    first.run(fmax=1e-9, steps=12)
    second = make(restart=path)
    for name in ("previous_positions", "previous_cell"):
        saved = getattr(first.engine, name)
        assert saved is not None
        np.testing.assert_array_equal(getattr(second.engine, name), saved)


def test_optimizer_continues_with_structures_already_converged(tmp_path, lj_calc64):
    """Per-structure convergence: the small cell converges before the checkpoint."""

    def make(**kwargs):
        return FIRE(_structures(lj_calc64), logfile=None, **kwargs)

    path = tmp_path / "fire.npz"
    reference = make()
    reference.run(fmax=0.01, steps=40)  # converged at steps 29, 16 and 35
    first = make(restart=path)
    first.run(fmax=0.01, steps=20)
    assert first.converged_mask.any()
    assert not first.converged_mask.all()
    second = make(restart=path)
    second.run(fmax=0.01, steps=20)
    _assert_same_state(reference, second)
    np.testing.assert_array_equal(second.converged_mask, reference.converged_mask)
    np.testing.assert_array_equal(
        read_checkpoint(path).arrays["extra/converged"], second.converged_mask
    )


def test_failed_structures_stay_failed_and_are_not_reported_again(tmp_path, lj_calc64):
    """images[0] crosses max_force before the checkpoint, images[2] after it."""
    limits = FailureLimits(max_force=0.2)

    def make(**kwargs):
        return VelocityVerlet(
            _structures(lj_calc64), DT, failure_limits=limits, **kwargs
        )

    path = tmp_path / "vv.npz"
    reference, first = make(), make(restart=path)
    with pytest.warns(StructureFailedWarning):
        reference.run(20)
    assert [failure.index for failure in reference.failures] == [0, 2]
    with pytest.warns(StructureFailedWarning, match=r"images\[0\]"):
        first.run(10)
    second = make(restart=path)  # no warning: images[0] is known to have failed
    assert [failure.index for failure in second.failures] == [0]
    np.testing.assert_array_equal(second.failed_mask, [True, False, False])
    with pytest.warns(StructureFailedWarning) as caught:
        second.run(10)
    assert ["images[2]" in str(warning.message) for warning in caught] == [True]
    assert second.failures == reference.failures
    _assert_same_state(reference, second)


# One process of its own for both checks across processes (forked from the
# zygote of tests/cli_zygote.py, which imported torch and nvalchemi once): it
# runs the first half of a Langevin run, which this process continues (its
# checkpoint is complete when run() returns), then writes a checkpoint after
# every step until it is killed.
FRESH = r"""
import sys
from ase import units
from nvalchemi_ase import NVAlchemiCalculator
from nvalchemi_ase.md import Langevin, VelocityVerlet
from tests.test_restart import _structures, DT

continued, steps, killed = sys.argv[1], int(sys.argv[2]), sys.argv[3]
calc = NVAlchemiCalculator("lj", device="cpu", dtype="float64")
dyn = Langevin(_structures(calc), DT, temperature_K=300.0,
               friction=0.01 / units.fs, seed=7, restart=continued)
dyn.run(steps)
dyn = VelocityVerlet(_structures(calc), DT, restart=killed, restart_interval=1)
dyn.run(1_000_000)
"""
FRESH_STEPS = 30


@pytest.fixture(scope="module")
def fresh_process(tmp_path_factory) -> tuple[Path, Path]:
    """(Langevin's checkpoint after its first half, VelocityVerlet's when killed).

    Both written by :data:`FRESH` in a process of its own, SIGKILLed half a
    second after its first VelocityVerlet checkpoint (a few more writes: the
    kill lands at an arbitrary point).
    """
    import signal
    import time

    folder = tmp_path_factory.mktemp("fresh_process")
    continued, killed = folder / "langevin.npz", folder / "vv.npz"
    argv = [str(continued), str(FRESH_STEPS), str(killed)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    process = spawn_forked(FRESH, argv, ROOT, env, folder / "stderr.txt")
    try:
        deadline = time.monotonic() + 300
        while not killed.exists() and process.poll() is None:
            assert time.monotonic() < deadline, "no checkpoint in time"
            time.sleep(0.05)
        time.sleep(0.5)
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=60)
        process.stderr.close()
    # it ran until killed: both checkpoints are there
    assert process.returncode == -signal.SIGKILL, (folder / "stderr.txt").read_text()
    return continued, killed


@pytest.mark.slow  # a process of its own (shared with the test below)
def test_restart_across_processes(fresh_process, lj_calc64):
    path, _ = fresh_process
    steps = FRESH_STEPS

    def make(**kwargs):
        return Langevin(
            _structures(lj_calc64),
            DT,
            temperature_K=300.0,
            friction=0.01 / units.fs,
            **kwargs,
        )

    reference = make(seed=7)
    reference.run(2 * steps)
    continued = make(restart=path)  # no seed: the checkpoint's is used
    assert continued.nsteps == steps
    continued.run(steps)
    _assert_same_state(reference, continued)


# -- when the file is written ---------------------------------------------------


def test_written_every_restart_interval_and_after_every_run(
    tmp_path, lj_calc64, monkeypatch
):
    written = []
    original = checkpoint_module.write_checkpoint

    def recording(path, meta, arrays):
        written.append(meta["nsteps"])
        return original(path, meta, arrays)

    monkeypatch.setattr("nvalchemi_ase.dynamics.base.write_checkpoint", recording)
    path = tmp_path / "vv.npz"
    dyn = VelocityVerlet(_structures(lj_calc64), DT, restart=path, restart_interval=10)
    assert dyn.restart_interval == 10
    dyn.run(25)
    dyn.run(5)
    assert written == [10, 20, 25, 30]
    assert read_checkpoint(path).meta["nsteps"] == 30
    default = VelocityVerlet(_structures(lj_calc64), DT, restart=tmp_path / "d.npz")
    assert default.restart_interval == DEFAULT_RESTART_INTERVAL == 100


def test_leaving_irun_early_writes_the_state_at_the_last_yield(tmp_path, lj_calc64):
    path = tmp_path / "irun.npz"
    dyn = VelocityVerlet(_structures(lj_calc64), DT, restart=path)
    for _ in dyn.irun(50):
        if dyn.nsteps == 7:
            break
    assert read_checkpoint(path).meta["nsteps"] == 7


def test_checkpoint_format_is_arrays_and_json(tmp_path, lj_calc64):
    path = tmp_path / "bfgs.npz"
    opt = BFGS(_structures(lj_calc64), logfile=None, restart=path)
    opt.run(fmax=FMAX, steps=3)
    assert opt.todict()["restart"] == str(path)
    with np.load(path, allow_pickle=False) as data:
        assert all(data[key].dtype != object for key in data.files)
        meta = json.loads(str(data["meta"]))
    assert meta["format"] == "nvalchemi_ase.checkpoint"
    assert meta["version"] == 1
    assert meta["class"] == "BFGS"
    assert meta["n_atoms"] == [32, 4, 55]
    assert meta["dtype"] == "float64"
    assert meta["nsteps"] == 3
    arrays = read_checkpoint(path).arrays
    assert arrays["engine/hessian"].shape == (3, 165, 165)
    assert arrays["batch/positions"].shape == (91, 3)
    assert "neighbors/0/matrix" in arrays


def test_write_checkpoint_needs_a_path_and_an_evaluation(tmp_path, lj_calc64):
    dyn = VelocityVerlet(_structures(lj_calc64), DT)
    with pytest.raises(ValueError, match="give a path"):
        dyn.write_checkpoint()
    with pytest.raises(RuntimeError, match="call run"):
        dyn.write_checkpoint(tmp_path / "x.npz")
    with pytest.raises(ValueError, match="restart_interval must be >= 1"):
        VelocityVerlet(_structures(lj_calc64), DT, restart="x.npz", restart_interval=0)


# -- refused files ----------------------------------------------------------------


def _written(tmp_path, calc, make=None, steps=3):
    path = tmp_path / "good.npz"
    dyn = (make or (lambda **k: VelocityVerlet(_structures(calc), DT, **k)))(
        restart=path
    )
    dyn.run(steps)
    return path


def _refused(make, calc, message):
    images = _structures(calc)
    before = [snapshot(atoms) for atoms in images]
    with pytest.raises(CheckpointError, match=message) as caught:
        make(images)
    for snap, atoms in zip(before, images, strict=True):
        assert_same_snapshot(snap, atoms)  # nothing was changed or run
    assert isinstance(caught.value, ValueError)
    return str(caught.value)


def test_damaged_file_is_refused(tmp_path, lj_calc64):
    path = _written(tmp_path, lj_calc64)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    text = _refused(
        lambda images: VelocityVerlet(images, DT, restart=path),
        lj_calc64,
        "cannot be read as an nvalchemi_ase checkpoint",
    )
    assert str(path) in text
    path.write_bytes(b"\x00garbage" * 100)
    _refused(
        lambda images: VelocityVerlet(images, DT, restart=path),
        lj_calc64,
        "cannot be read",
    )


@pytest.mark.parametrize(
    "content",
    [
        "ase_json",  # ASE's own optimizer restart file
        "foreign_npz",
        "pickle",
    ],
)
def test_foreign_file_is_refused(content, tmp_path, lj_calc64):
    path = tmp_path / "restart.npz"
    if content == "ase_json":
        path.write_text(json.dumps({"H": None, "r0": None}))
        message = "cannot be read"
    elif content == "foreign_npz":
        with path.open("wb") as stream:
            np.savez(stream, positions=np.zeros((3, 3)))
        message = "is not an nvalchemi_ase checkpoint"
    else:
        with path.open("wb") as stream:
            np.savez(stream, meta=np.array([{"format": "x"}], dtype=object))
        message = "cannot be read"
    _refused(lambda images: BFGS(images, restart=path), lj_calc64, message)


@pytest.mark.parametrize("name", ["FIRE", "BFGS", "MDMin"])
def test_checkpoint_with_the_engines_old_name_continues(name, tmp_path, lj_calc64):
    """Checkpoints written before the engines took the ``ASE`` prefix still load."""
    make, steps = CLASSES[name]
    path = tmp_path / "restart.npz"
    reference = make(lj_calc64)
    _run(reference, 2 * steps)
    first = make(lj_calc64, restart=path)
    _run(first, steps)
    checkpoint = read_checkpoint(path)
    assert checkpoint.meta["engine"] == f"ASE{name}"
    meta = {k: v for k, v in checkpoint.meta.items() if k not in ("format", "version")}
    write_checkpoint(path, dict(meta, engine=name), dict(checkpoint.arrays))
    second = make(lj_calc64, restart=path)
    _run(second, steps)
    _assert_same_state(reference, second)


def test_newer_format_version_is_refused(tmp_path, lj_calc64):
    path = _written(tmp_path, lj_calc64)
    checkpoint = read_checkpoint(path)
    meta = dict(checkpoint.meta, version=99)
    with path.open("wb") as stream:
        np.savez(stream, meta=np.array(json.dumps(meta)), **checkpoint.arrays)
    _refused(
        lambda images: VelocityVerlet(images, DT, restart=path),
        lj_calc64,
        "format version 99",
    )


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda images, path: Langevin(images, DT, 300.0, 0.01, restart=path), "class"),
        (
            lambda images, path: VelocityVerlet(images[:2], DT, restart=path),
            "engine|n_",
        ),
        (
            lambda images, path: VelocityVerlet(images[::-1], DT, restart=path),
            "n_atoms",
        ),
        (
            lambda images, path: VelocityVerlet(
                [images[0], images[1], _other_element(images[2])], DT, restart=path
            ),
            r"atomic_numbers.*images\[2\]",
        ),
        (
            lambda images, path: VelocityVerlet(images, 2 * DT, restart=path),
            "parameters",
        ),
        (lambda images, path: VelocityVerlet(images, DT, restart=path), "dtype"),
    ],
    ids=["class", "count", "order", "atoms", "timestep", "dtype"],
)
def test_mismatched_checkpoint_is_refused(make, field, tmp_path, lj_calc64, request):
    path = _written(tmp_path, lj_calc64)
    calc = request.getfixturevalue("lj_calc32" if field == "dtype" else "lj_calc64")
    text = _refused(lambda images: make(images, path), calc, field)
    assert str(path) in text
    assert "remove the file" in text


def _other_element(atoms):
    other = atoms.copy()
    other.numbers[0] = 36  # Kr
    other.calc = atoms.calc
    return other


# -- interrupted writes -------------------------------------------------------------


def test_failed_write_keeps_the_previous_checkpoint(tmp_path, lj_calc64, monkeypatch):
    path = tmp_path / "vv.npz"
    dyn = VelocityVerlet(_structures(lj_calc64), DT, restart=path)
    dyn.run(5)
    good = path.read_bytes()

    def killed(source, target):
        raise KeyboardInterrupt  # as if the job were stopped mid-write

    monkeypatch.setattr(checkpoint_module.os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        dyn.run(5)
    monkeypatch.undo()
    assert path.read_bytes() == good
    assert [p.name for p in tmp_path.iterdir()] == ["vv.npz"]  # no temporary left
    assert read_checkpoint(path).meta["nsteps"] == 5


@pytest.mark.slow  # a process of its own (shared with the test above)
def test_sigkill_while_writing_leaves_a_loadable_checkpoint(fresh_process, lj_calc64):
    _, path = fresh_process
    steps = read_checkpoint(path).meta["nsteps"]
    assert steps >= 1
    continued = VelocityVerlet(_structures(lj_calc64), DT, restart=path)
    assert continued.nsteps == steps
    continued.run(1)


def test_stale_temporary_file_is_ignored(tmp_path, lj_calc64):
    path = _written(tmp_path, lj_calc64, steps=4)
    # what a SIGKILL during np.savez leaves: a partial temporary next to the file
    (tmp_path / f".{path.name}.abc123.tmp").write_bytes(b"PK\x03\x04partial")
    dyn = VelocityVerlet(_structures(lj_calc64), DT, restart=path)
    assert dyn.nsteps == 4
    dyn.run(1)
    assert read_checkpoint(path).meta["nsteps"] == 5


# -- trajectories ---------------------------------------------------------------------


@pytest.mark.parametrize("first", [10, 0], ids=["stopped-at-10", "stopped-at-0"])
def test_trajectory_continues_without_duplicated_frames(tmp_path, lj_calc64, first):
    """Also from a checkpoint taken at step 0 (a stop before the first step)."""
    from ase.io import read

    def make(name, **kwargs):
        return VelocityVerlet(
            _structures(lj_calc64),
            DT,
            trajectory=str(tmp_path / (name + "_{i}.traj")),
            loginterval=5,
            **kwargs,
        )

    make("whole").run(20)
    path = tmp_path / "vv.npz"
    make("parts", restart=path).run(first)
    make("parts", restart=path, append_trajectory=True).run(20 - first)
    for index in range(3):
        whole = read(tmp_path / f"whole_{index}.traj", ":")
        parts = read(tmp_path / f"parts_{index}.traj", ":")
        assert len(parts) == len(whole) == 5
        for expected, frame in zip(whole, parts, strict=True):
            np.testing.assert_array_equal(frame.positions, expected.positions)


# -- replay_trajectory -----------------------------------------------------------------


def test_bfgs_replay_trajectory_is_ases(tmp_path, lj_calc64):
    """Hessians rebuilt from each structure's trajectory equal ASE's; so do steps."""
    from ase.io import read
    from ase.optimize import BFGS as AseBFGS

    starts = [rattled_bulk(2, seed=1, stdev=0.1), triclinic()]
    expected_hessians, expected_positions, last_frames = [], [], []
    for index, atoms in enumerate(starts):
        atoms.calc = lj_calc64
        path = tmp_path / f"relax_{index}.traj"
        with AseBFGS(atoms, trajectory=str(path), logfile=None) as opt:
            opt.run(fmax=1e-6, steps=4 + index)  # trajectories of different lengths
        continued = read(path, -1)
        continued.calc = lj_calc64
        ase_opt = AseBFGS(continued, logfile=None)
        ase_opt.replay_trajectory(str(path))
        expected_hessians.append(ase_opt.H.copy())
        ase_opt.run(fmax=1e-6, steps=3)
        expected_positions.append(continued.positions.copy())
        frame = read(path, -1)
        frame.calc = lj_calc64
        last_frames.append(frame)
    ours = BFGS(last_frames, logfile=None)
    ours.replay_trajectory(str(tmp_path / "relax_{i}.traj"))
    ours.run(fmax=1e-6, steps=0)  # the first evaluation applies the replay
    hessians = ours.engine._state.hessian.numpy()
    for index, expected in enumerate(expected_hessians):
        width = expected.shape[0]
        np.testing.assert_allclose(hessians[index, :width, :width], expected, atol=1e-9)
    ours.run(fmax=1e-6, steps=3)
    for atoms, expected in zip(last_frames, expected_positions, strict=True):
        np.testing.assert_allclose(atoms.positions, expected, rtol=0, atol=1e-10)


def test_replay_trajectory_needs_one_trajectory_per_structure(tmp_path, lj_calc64):
    opt = BFGS(_structures(lj_calc64), logfile=None)
    with pytest.raises(ValueError, match="got 1 trajectories for 3 structures"):
        opt.replay_trajectory([_structures(lj_calc64)[0]])
    with pytest.raises(ValueError, match="has other atoms"):
        opt.replay_trajectory([[atoms] for atoms in _structures(lj_calc64)[::-1]])


def test_lbfgs_replay_of_its_own_trajectory_continues_the_run(tmp_path, lj_calc64):
    """Frames written every step give back the engine's history: same next steps."""
    from ase.io import read

    template = str(tmp_path / "relax_{i}.traj")
    reference = LBFGS(_structures(lj_calc64), logfile=None)
    reference.run(fmax=FMAX, steps=13)
    LBFGS(_structures(lj_calc64), logfile=None, trajectory=template).run(
        fmax=FMAX, steps=8
    )
    last_frames = [read(template.format(i=index), -1) for index in range(3)]
    for atoms in last_frames:
        atoms.calc = lj_calc64
    continued = LBFGS(last_frames, logfile=None)
    continued.replay_trajectory(template)
    continued.run(fmax=FMAX, steps=5)
    for expected, atoms in zip(reference.images, last_frames, strict=True):
        np.testing.assert_allclose(atoms.positions, expected.positions, atol=1e-10)
    fresh = [read(template.format(i=index), -1) for index in range(3)]
    for atoms in fresh:
        atoms.calc = lj_calc64
    LBFGS(fresh, logfile=None).run(fmax=FMAX, steps=5)  # without the history
    assert not np.allclose(fresh[0].positions, reference.images[0].positions)


def test_frames_written_after_the_checkpoint_by_a_killed_run_are_dropped(
    tmp_path, lj_calc64
):
    """Checkpoint at 20, frames up to 25, then killed: continuing repeats none."""
    from ase.io import read

    def make(name, **kwargs):
        return VelocityVerlet(
            _structures(lj_calc64),
            DT,
            trajectory=str(tmp_path / (name + "_{i}.traj")),
            **kwargs,
        )

    make("whole").run(30)
    path = tmp_path / "vv.npz"
    first = make("parts", restart=path, restart_interval=10)
    first.run(20)
    at_20 = path.read_bytes()
    first.run(5)  # frames 21..25 reach the files, then the job is killed ...
    path.write_bytes(at_20)  # ... before the checkpoint of step 25 was written
    continued = make("parts", restart=path, append_trajectory=True)
    assert continued.nsteps == 20
    continued.run(10)
    for index in range(3):
        whole = read(tmp_path / f"whole_{index}.traj", ":")
        parts = read(tmp_path / f"parts_{index}.traj", ":")
        assert len(parts) == len(whole) == 31
        for expected, frame in zip(whole, parts, strict=True):
            np.testing.assert_array_equal(frame.positions, expected.positions)


# -- logs -----------------------------------------------------------------------------


def _md_log(count, template=False):
    def make(images, log, **kwargs):
        log = log + "_{i}" if template else log
        return VelocityVerlet(images[:count], DT, logfile=log, **kwargs)

    return make


def _fire_log(count):
    def make(images, log, **kwargs):
        return FIRE(images[:count], logfile=log, **kwargs)

    return make


# name -> (factory(images, logfile, **kwargs), run arguments, wall-clock column)
LOGS = {
    "md-batch": (_md_log(3), {}, None),
    "md-one": (_md_log(1), {}, None),
    "md-template": (_md_log(3, template=True), {}, None),
    "fire-batch": (_fire_log(3), {"fmax": 1e-9}, 2),
    "fire-one": (_fire_log(1), {"fmax": 1e-9}, 2),
}


def _log_texts(base: Path, clock_column: int | None) -> list[str]:
    """The text of a run's log file(s), the wall-clock column blanked."""
    texts = []
    for path in sorted(base.parent.glob(base.name + "*")):
        lines = path.read_text().splitlines()
        if clock_column is not None:
            lines = [
                " ".join(
                    "-" if number == clock_column else word
                    for number, word in enumerate(line.split())
                )
                for line in lines
            ]
        texts.append("\n".join(lines))
    assert texts
    return texts


@pytest.mark.parametrize("name", sorted(LOGS))
def test_logs_continue_without_repeated_header_or_lines(name, tmp_path, lj_calc64):
    """Checkpoint at 10, logged to 15, killed: the continued log is the whole run's."""
    make, run, clock = LOGS[name]
    whole_log, parts_log = str(tmp_path / "whole.log"), str(tmp_path / "parts.log")
    make(_structures(lj_calc64), whole_log).run(steps=25, **run)
    path = tmp_path / "ck.npz"
    first = make(_structures(lj_calc64), parts_log, restart=path, restart_interval=5)
    first.run(steps=10, **run)
    at_10 = path.read_bytes()
    first.run(steps=5, **run)  # lines 11..15 are logged, then the job is killed ...
    path.write_bytes(at_10)  # ... before the checkpoint of step 15
    continued = make(_structures(lj_calc64), parts_log, restart=path)
    assert continued.nsteps == 10
    continued.run(steps=15, **run)
    whole = _log_texts(tmp_path / "whole.log", clock)
    assert _log_texts(tmp_path / "parts.log", clock) == whole
    assert sum(text.count("\n") + 1 for text in whole) >= 26  # header + 0..25


def test_npt_checkpoint_with_another_barostat_chain_is_refused(tmp_path, lj_calc64):
    """``pchain`` sizes the barostat chain's state: another one's is refused."""

    def make(pchain):
        return lambda **k: IsotropicMTKNPT(
            _structures(lj_calc64, bulk_only=True),
            DT,
            tchain=3,
            pchain=pchain,
            **NPT,
            **k,
        )

    path = _written(tmp_path, lj_calc64, make=make(2))
    images = _structures(lj_calc64, bulk_only=True)
    with pytest.raises(CheckpointError, match="parameters") as caught:
        IsotropicMTKNPT(images, DT, tchain=3, pchain=4, restart=path, **NPT)
    assert "pchain" in str(caught.value)
