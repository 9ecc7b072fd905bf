"""Acceptance: ``calc``, ``relax`` and ``md`` stream, survive ``kill -9`` and resume.

A run is killed with SIGKILL in a process of its own (forked from an
interpreter that has imported the command line, ``tests/cli_zygote.py``) while
it writes (its model slowed down so that the kill lands mid-run), then
continued with ``--resume``: the result must be the one an uninterrupted run
writes, and what the killed run had finished must be kept, not computed again.
Streaming: the inputs are read one frame at a time, and no more of them are
alive at once than a working batch holds, whatever the number of inputs.
"""

from __future__ import annotations

import signal
import subprocess
import weakref
from pathlib import Path

import numpy as np
import pytest
from ase.build import bulk
from ase.io import read, write

from nvalchemi_ase.cli.main import main
from nvalchemi_ase.runners import finished_indices
from tests.helpers import frames_by_index, signal_when, spawn_slowed_cli
from tests.test_cli import mixed_argon

LJ = ["--model", "lj", "--dtype", "float64", "--device", "cpu", "--quiet"]


def _kill_when(process: subprocess.Popen, ready) -> None:
    """SIGKILL ``process`` as soon as ``ready()``; fail if it ended first."""
    status, _ = signal_when(process, ready, signal.SIGKILL)
    assert status == -signal.SIGKILL


def _written(path: Path, at_least: int):
    return lambda: len(finished_indices(path)) >= at_least


def _argon(count: int, seed: int = 0) -> list:
    """Bulk argon of 4-16 atoms, rattled enough for tens of optimizer steps."""
    rng = np.random.default_rng(seed)
    images = []
    for index in range(count):
        atoms = bulk("Ar", "fcc", a=5.26, cubic=True) * (1, 1, 1 + index % 4)
        atoms.rattle(0.1, seed=int(rng.integers(1 << 30)))
        images.append(atoms)
    return images


@pytest.mark.slow  # ~40 s: three relaxations, one killed in a process of its own
def test_relax_killed_mid_run_resumes_to_the_uninterrupted_result(tmp_path, capsys):
    inputs = tmp_path / "in.extxyz"
    count = 24
    write(inputs, _argon(count))
    settings = ["--optimizer", "BFGS", "--fmax", "0.01", "--batch-size", "6", *LJ]
    reference = tmp_path / "reference.extxyz"
    assert main(["relax", str(inputs), "-o", str(reference), *settings]) == 0

    output = tmp_path / "relaxed.extxyz"
    staged = tmp_path / "relaxed.partial.extxyz"
    argv = ["relax", str(inputs), "-o", str(output), *settings]
    _kill_when(spawn_slowed_cli(tmp_path, argv), _written(staged, 6))
    assert not output.exists()
    kept = frames_by_index(staged)
    assert 6 <= len(kept) < count

    assert main([*argv, "--resume"]) == 0, capsys.readouterr().err
    assert not staged.exists()
    final = frames_by_index(output)
    for index, text in kept.items():  # kept as written, not relaxed again
        assert final[index] == text
    relaxed, expected = read(output, ":"), read(reference, ":")
    assert [int(a.info["index"]) for a in relaxed] == list(range(count))
    assert [a.info["source"] for a in relaxed] == [
        f"{inputs}@{index}" for index in range(count)
    ]
    for have, want in zip(relaxed, expected, strict=True):
        # BFGS follows each structure's own path whatever the batch (5e-13 Å)
        np.testing.assert_allclose(have.positions, want.positions, atol=1e-8)
        assert have.info["steps"] == want.info["steps"]
        assert have.info["converged"]
        assert have.get_potential_energy() == pytest.approx(
            want.get_potential_energy(), abs=1e-10
        )
        np.testing.assert_allclose(have.get_stress(), want.get_stress(), atol=1e-10)


@pytest.mark.slow  # ~20 s: two runs and a killed one
def test_calc_killed_mid_run_resumes_to_the_uninterrupted_file(tmp_path, capsys):
    inputs = tmp_path / "in.extxyz"
    count = 40
    write(inputs, mixed_argon(count))
    settings = ["--batch-size", "2", *LJ]
    reference = tmp_path / "reference.extxyz"
    assert main(["calc", str(inputs), "-o", str(reference), *settings]) == 0

    output = tmp_path / "calc.extxyz"
    staged = tmp_path / "calc.partial.extxyz"
    argv = ["calc", str(inputs), "-o", str(output), *settings]
    _kill_when(spawn_slowed_cli(tmp_path, argv), _written(staged, 5))
    kept = frames_by_index(staged)
    assert 5 <= len(kept) < count
    assert main([*argv, "--resume"]) == 0, capsys.readouterr().err
    final, expected = frames_by_index(output), frames_by_index(reference)
    assert sorted(final) == list(range(count))
    for index, text in kept.items():
        assert final[index] == text
    for have, want in zip(read(output, ":"), read(reference, ":"), strict=True):
        assert have.info["source"] == want.info["source"]
        assert have.get_potential_energy() == pytest.approx(
            want.get_potential_energy(), abs=1e-10
        )
        np.testing.assert_allclose(have.get_forces(), want.get_forces(), atol=1e-10)
    assert len(expected) == count


@pytest.mark.slow  # ~40 s: three MD runs, one of them killed in a process of its own
def test_md_killed_mid_run_resumes_to_the_uninterrupted_trajectories(tmp_path, capsys):
    inputs = tmp_path / "in.extxyz"
    count = 12
    write(inputs, mixed_argon(count))
    settings = [
        "--ensemble",
        "nvt",  # Langevin: seeded noise per batch, momenta drawn per structure
        "--temperature",
        "40",
        "--steps",
        "20",
        "--interval",
        "5",
        "--batch-size",
        "3",
        *LJ,
    ]
    reference = tmp_path / "reference"
    assert main(["md", str(inputs), "-o", str(reference), *settings]) == 0

    output = tmp_path / "md"
    staged = output / "final.partial.extxyz"
    argv = ["md", str(inputs), "-o", str(output), *settings]
    _kill_when(spawn_slowed_cli(tmp_path, argv), _written(staged, 3))
    kept = frames_by_index(staged)
    assert 3 <= len(kept) < count
    assert main([*argv, "--resume"]) == 0, capsys.readouterr().err
    assert not list(output.glob("*.partial.*"))
    final = frames_by_index(output / "final.extxyz")
    assert sorted(final) == list(range(count))
    for index, text in kept.items():
        assert final[index] == text
    pairs = zip(
        read(output / "final.extxyz", ":"),
        read(reference / "final.extxyz", ":"),
        strict=True,
    )
    for have, want in pairs:
        np.testing.assert_allclose(have.positions, want.positions, atol=1e-10)
        np.testing.assert_allclose(have.get_momenta(), want.get_momenta(), atol=1e-10)
    for index in range(count):
        name = f"md_{index:05d}.traj"
        ours, theirs = read(output / name, ":"), read(reference / name, ":")
        assert len(ours) == len(theirs) == 5
        for have, want in zip(ours, theirs, strict=True):
            np.testing.assert_allclose(have.positions, want.positions, atol=1e-10)


def test_resume_refuses_other_inputs_and_a_finished_run(tmp_path, capsys):
    inputs = tmp_path / "in.extxyz"
    write(inputs, mixed_argon(6))
    output = tmp_path / "calc.extxyz"
    argv = ["calc", str(inputs), "-o", str(output), *LJ]
    assert main([*argv, "--resume"]) == 0  # nothing to resume: a fresh run
    first = output.read_bytes()
    # finished: a requeued --resume succeeds, says so and changes nothing
    assert main([*argv, "--resume"]) == 0
    assert "already finished" in capsys.readouterr().err
    assert output.read_bytes() == first
    assert not (tmp_path / "calc.partial.extxyz").exists()
    assert main(argv) == 2  # without --resume a finished output is refused
    assert "exists" in capsys.readouterr().err

    output.rename(tmp_path / "calc.partial.extxyz")  # as if interrupted
    other = tmp_path / "other.extxyz"
    write(other, mixed_argon(6)[::-1])
    code = main(["calc", str(other), "-o", str(output), "--resume", *LJ])
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert f"holds {inputs}@0 as structure 0" in err
    assert f"inputs give {other}@0 there" in err
    assert main([*argv, "--resume"]) == 0  # the right inputs: nothing left to do
    assert output.read_bytes() == first


@pytest.mark.parametrize("command", ["calc", "relax", "md"])
def test_inputs_are_streamed_never_all_held(tmp_path, capsys, monkeypatch, command):
    import ase.io

    count, batch = 60, 4
    write(tmp_path / "in.extxyz", mixed_argon(count))
    alive = {"now": 0, "most": 0}

    def released() -> None:
        alive["now"] -= 1

    original = ase.io.iread

    def counted(*args, **kwargs):
        for atoms in original(*args, **kwargs):
            alive["now"] += 1
            alive["most"] = max(alive["most"], alive["now"])
            weakref.finalize(atoms, released)
            yield atoms

    monkeypatch.setattr(ase.io, "iread", counted)
    extra = {"md": ["--steps", "4", "--interval", "2"], "relax": [], "calc": []}
    output = tmp_path / ("md" if command == "md" else "out.extxyz")
    argv = [command, str(tmp_path / "in.extxyz"), "-o", str(output), *extra[command]]
    assert main([*argv, "--batch-size", str(batch), *LJ]) == 0, capsys.readouterr()
    # one working batch, and for chunks the next one while it is being read
    assert alive["most"] <= 2 * batch + 1
    written = output / "final.extxyz" if command == "md" else output
    assert len(finished_indices(written)) == count
