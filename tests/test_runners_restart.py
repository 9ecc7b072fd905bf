"""``irelax(restart=...)``: the working batch in flight continues from its checkpoint.

References are uninterrupted runs of the same runner with the same budget: a
run stopped by ``stop()`` and continued must write the same output text, the
same trajectory frames and the same plot series, bit for bit (float64, CPU;
see :mod:`nvalchemi_ase.runners.restart`). A run killed after its last
periodic checkpoint (its generator dropped mid-run) continues from that
checkpoint without writing a structure twice.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
from ase.filters import FrechetCellFilter
from ase.io import read

from nvalchemi_ase import NVAlchemiCalculator
from nvalchemi_ase.dynamics.checkpoint import CheckpointError
from nvalchemi_ase.runners import RunStopped, finished_indices, irelax, relax
from tests.helpers import frames_by_index
from tests.structures import mixed

COUNT = 16
SETTINGS = {"fmax": 0.02, "steps": 400, "max_atoms": 90, "restart_interval": 6}


@pytest.fixture(scope="module")
def calc():
    return NVAlchemiCalculator("lj", device="cpu", dtype="float64")


@pytest.fixture(scope="module")
def images():
    return mixed(COUNT, seed=5, largest=30)


def _stop_after(calls: int):
    """A ``stop=`` that asks for a stop at its ``calls``-th question."""
    asked = itertools.count(1)
    return lambda: next(asked) == calls


def _arguments(folder: Path, name: str, optimizer: str, **extra) -> dict:
    return {
        "optimizer": optimizer,
        "output": folder / f"{name}.extxyz",
        "trajectory": str(folder / f"{name}_{{i}}.traj"),
        **SETTINGS,
        **extra,
    }


def _uninterrupted(images, calc, folder: Path, optimizer: str, **extra):
    series: dict = {}
    arguments = _arguments(folder, "full", optimizer, **extra)
    arguments.pop("restart_interval")
    relax(images, calc, series=series, **arguments)
    return series


def _assert_same_frames(folder: Path, ours: str, theirs: str, exact: bool) -> None:
    for index in range(COUNT):
        have = read(folder / f"{ours}_{index}.traj", ":")
        want = read(folder / f"{theirs}_{index}.traj", ":")
        assert len(have) == len(want), index
        for a, b in zip(have, want, strict=True):
            if exact:
                np.testing.assert_array_equal(a.positions, b.positions)
                assert a.get_potential_energy() == b.get_potential_energy()
            else:
                np.testing.assert_allclose(a.positions, b.positions, atol=1e-10)


@pytest.mark.parametrize(
    ("optimizer", "stop_at"),
    [
        ("FIRE", 1),  # right after the first batch's initial evaluation
        ("FIRE", 9),  # mid-batch, past a periodic checkpoint
        ("FIRE", 40),  # after many refills
        pytest.param("BFGS", 9, marks=pytest.mark.slow),
        pytest.param("MDMin", 9, marks=pytest.mark.slow),
        pytest.param("FIRE2", 9, marks=pytest.mark.slow),
        pytest.param("LBFGS", 4, marks=pytest.mark.slow),
    ],
)
def test_stopped_and_continued_equals_the_uninterrupted_run(
    calc, images, tmp_path, optimizer, stop_at
):
    full_series = _uninterrupted(images, calc, tmp_path, optimizer)
    checkpoint = tmp_path / "ck.npz"
    series: dict = {}
    arguments = _arguments(tmp_path, "part", optimizer, restart=checkpoint)
    with pytest.raises(RunStopped) as stopped:
        list(
            irelax(images, calc, stop=_stop_after(stop_at), series=series, **arguments)
        )
    assert stopped.value.checkpoint == checkpoint
    assert checkpoint.exists()
    written = finished_indices(arguments["output"])
    assert len(written) < COUNT
    assert not set(stopped.value.input_indices) & set(written)

    results = relax(images, calc, series=series, **arguments)  # resume implied
    assert not checkpoint.exists()
    assert [int(a.info["index"]) for a in results] == list(range(COUNT))
    assert arguments["output"].read_text() == (tmp_path / "full.extxyz").read_text()
    _assert_same_frames(tmp_path, "part", "full", exact=True)
    assert sorted(series) == sorted(full_series) == list(range(COUNT))
    for index, values in full_series.items():
        for key, value in values.items():
            np.testing.assert_array_equal(series[index][key], value)


def test_variable_cell_batch_continues_exactly(calc, images, tmp_path):
    bulk_only = [atoms for atoms in images if atoms.pbc.all()][:6]
    extra = {"cell_filter": FrechetCellFilter, "max_atoms": 60}
    full = tmp_path / "full.extxyz"
    relax(bulk_only, calc, optimizer="FIRE", output=full, fmax=0.02, **extra)
    part, checkpoint = tmp_path / "part.extxyz", tmp_path / "ck.npz"
    arguments = {"optimizer": "FIRE", "output": part, "fmax": 0.02, **extra}
    with pytest.raises(RunStopped):
        list(
            irelax(
                bulk_only, calc, restart=checkpoint, stop=_stop_after(12), **arguments
            )
        )
    relax(bulk_only, calc, restart=checkpoint, **arguments)
    assert part.read_text() == full.read_text()


def test_killed_run_continues_from_its_last_checkpoint_writing_each_once(
    calc, images, tmp_path
):
    _uninterrupted(images, calc, tmp_path, "FIRE")
    checkpoint = tmp_path / "ck.npz"
    arguments = _arguments(tmp_path, "part", "FIRE", restart=checkpoint)
    running = irelax(images, calc, **arguments)
    for _ in range(5):  # five results written, then the process "dies"
        next(running)
    running.close()
    assert checkpoint.exists()
    before = frames_by_index(arguments["output"])
    assert len(before) == 5

    relax(images, calc, **arguments)
    assert not checkpoint.exists()
    ours = frames_by_index(arguments["output"])
    reference = frames_by_index(tmp_path / "full.extxyz")
    assert sorted(ours) == list(range(COUNT))  # each structure exactly once
    assert all(ours[index] == text for index, text in before.items())  # untouched
    have = {int(a.info["index"]): a for a in read(arguments["output"], ":")}
    for want in read(tmp_path / "full.extxyz", ":"):
        mine = have[int(want.info["index"])]
        np.testing.assert_allclose(mine.positions, want.positions, atol=1e-10)
        assert mine.info["steps"] == want.info["steps"]
    assert set(ours) == set(reference)
    _assert_same_frames(tmp_path, "part", "full", exact=False)


def test_foreign_or_mismatched_checkpoint_is_refused_before_any_step(
    calc, images, tmp_path
):
    from nvalchemi_ase.runners import md

    checkpoint = tmp_path / "ck.npz"
    with pytest.raises(RunStopped):  # an MD chunk's checkpoint
        md(
            images[:3],
            calc,
            timestep=1.0,
            steps=10,
            dynamics="VelocityVerlet",
            restart=checkpoint,
            stop=_stop_after(4),
        )
    with pytest.raises(ValueError, match="restart_interval"):
        relax(images, calc, restart=tmp_path / "new.npz", restart_interval=0)
    assert not (tmp_path / "new.npz").exists()
    output = tmp_path / "out.extxyz"
    with pytest.raises(CheckpointError, match="not written by a relaxation runner"):
        relax(images, calc, output=output, restart=checkpoint)
    assert not output.exists() or not finished_indices(output)

    checkpoint.unlink()
    with pytest.raises(RunStopped):
        list(irelax(images, calc, restart=checkpoint, stop=_stop_after(3), **SETTINGS))
    kept = checkpoint.read_bytes()
    others = mixed(COUNT, seed=6, largest=30)  # other structures, same indices
    with pytest.raises(CheckpointError, match=r"atomic_numbers|n_atoms|pbc"):
        relax(others, calc, restart=checkpoint, **SETTINGS)
    assert checkpoint.read_bytes() == kept  # the refused file is left as it was
