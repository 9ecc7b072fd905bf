"""Acceptance: a CLI run stopped by SIGTERM/SIGINT is requeued with ``--restart``.

``md`` is stopped by a signal in a process of its own (forked from an
interpreter that has imported the command line, ``tests/cli_zygote.py``) while
a batch is in flight (its model slowed down so that the signal lands
mid-batch); it must write the checkpoint of the step it stopped at, flush its
files and exit with :data:`~nvalchemi_ase.cli.signals.REQUEUE_STATUS` and one
line on stderr.
Rerun with ``--restart``, it must end with the final structures and every
trajectory frame of an uninterrupted run, bit for bit (float64 on CPU: the
continued batch resumes the very engine state, neighbour list and step
counter, see :mod:`nvalchemi_ase.dynamics.checkpoint`).
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import numpy as np
import pytest
from ase.io import read, write

from nvalchemi_ase.cli.main import main
from nvalchemi_ase.cli.signals import REQUEUE_STATUS, SignalInterrupt, StopSignals
from nvalchemi_ase.runners import finished_indices
from tests.helpers import signal_when, spawn_slowed_cli
from tests.test_cli import mixed_argon

LJ = ["--model", "lj", "--dtype", "float64", "--device", "cpu", "--quiet"]
COUNT = 9
MD = [
    "--ensemble",
    "nvt",  # Langevin: seeded noise per batch, momenta drawn per structure
    "--temperature",
    "40",
    "--steps",
    "40",
    "--interval",
    "5",
    "--checkpoint-every",
    "7",  # neither the frame interval nor a divisor of the stop step
    "--batch-size",
    "3",
    *LJ,
]


@pytest.fixture(scope="module")
def md_reference(tmp_path_factory) -> tuple[Path, Path]:
    """The inputs and the output folder of an uninterrupted ``md`` run."""
    root = tmp_path_factory.mktemp("md-reference")
    inputs = root / "in.extxyz"
    write(inputs, mixed_argon(COUNT))
    folder = root / "reference"
    assert main(["md", str(inputs), "-o", str(folder), *MD]) == 0
    return inputs, folder


def _assert_same_md_outputs(ours: Path, reference: Path) -> None:
    """Same final structures (text) and every trajectory frame (bits) as the run."""
    assert (ours / "final.extxyz").read_text() == (
        reference / "final.extxyz"
    ).read_text()
    for index in range(COUNT):
        name = f"md_{index:05d}.traj"
        have, want = read(ours / name, ":"), read(reference / name, ":")
        assert len(have) == len(want) == 9, name  # steps 0, 5, ..., 40
        for a, b in zip(have, want, strict=True):
            np.testing.assert_array_equal(a.positions, b.positions)
            np.testing.assert_array_equal(a.get_momenta(), b.get_momenta())
            np.testing.assert_array_equal(a.get_forces(), b.get_forces())
            assert a.get_potential_energy() == b.get_potential_energy()
    # the continued batch logs neither its header nor a step twice
    assert (ours / "md.log").read_text() == (reference / "md.log").read_text()
    assert not list(ours.glob("*.partial.*"))
    assert not (ours / "checkpoint.npz").exists()


def _own_lines(err: str) -> list[str]:
    """Standard error without warp's note that this machine has no CUDA driver."""
    return [line for line in err.splitlines() if not line.startswith("Warp CUDA")]


def _in_second_batch(folder: Path):
    """Ready once the second batch (inputs 3-5) has written its first frame."""
    staged = folder / "final.partial.extxyz"
    trajectory = folder / "md_00003.partial.traj"

    def ready() -> bool:
        written = len(finished_indices(staged)) if staged.exists() else 0
        return written >= 3 and trajectory.exists() and trajectory.stat().st_size > 0

    return ready


@pytest.mark.slow  # ~25 s each: a stopped MD run, then the continued one
@pytest.mark.parametrize(
    "signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"]
)
def test_md_stopped_by_signal_restarts_to_the_uninterrupted_run(
    signum, md_reference, tmp_path, capsys
):
    inputs, reference = md_reference
    folder = tmp_path / "md"
    argv = ["md", str(inputs), "-o", str(folder), *MD, "--restart"]
    process = spawn_slowed_cli(tmp_path, argv, step_s=0.05)
    status, err = signal_when(process, _in_second_batch(folder), signum)

    assert status == REQUEUE_STATUS, err
    lines = _own_lines(err)
    assert len(lines) == 1, err
    name = signal.Signals(signum).name
    assert lines[0].startswith(f"nvalchemi-ase md: interrupted by {name} at step ")
    assert f"checkpoint written to {folder / 'checkpoint.npz'}" in lines[0]
    assert "3 of 9 structures finished" in lines[0]
    assert lines[0].endswith("rerun the same command with --restart to continue")
    assert (folder / "checkpoint.npz").exists()
    assert not (folder / "final.extxyz").exists()
    assert sorted(finished_indices(folder / "final.partial.extxyz")) == [0, 1, 2]

    assert main(argv) == 0, capsys.readouterr().err  # the same command: requeued
    _assert_same_md_outputs(folder, reference)


@pytest.mark.slow  # ~25 s: a killed MD run, then the continued one
def test_md_killed_restarts_from_its_last_periodic_checkpoint(
    md_reference, tmp_path, capsys
):
    inputs, reference = md_reference
    folder = tmp_path / "md"
    argv = ["md", str(inputs), "-o", str(folder), *MD, "--restart", "--plot"]
    process = spawn_slowed_cli(tmp_path, argv, step_s=0.05)
    in_flight = _in_second_batch(folder)
    checkpoint = folder / "checkpoint.npz"
    seen: list[float] = []

    def past_a_checkpoint() -> bool:
        # a few steps past the second batch's first checkpoint (step 7): the
        # frames written after it are in the files and must be cut
        if not seen and in_flight() and checkpoint.exists():
            seen.append(time.monotonic())
        return bool(seen) and time.monotonic() - seen[0] > 0.3

    status, _ = signal_when(process, past_a_checkpoint, signal.SIGKILL)
    assert status == -signal.SIGKILL
    assert checkpoint.exists()
    assert main(argv) == 0, capsys.readouterr().err
    _assert_same_md_outputs(folder, reference)
    assert (folder / "md.png").stat().st_size > 0  # the continued batch from step 7


def test_md_restart_on_a_fresh_folder_runs_from_the_start(md_reference, tmp_path):
    inputs, reference = md_reference
    folder = tmp_path / "fresh"
    assert main(["md", str(inputs), "-o", str(folder), *MD, "--restart"]) == 0
    _assert_same_md_outputs(folder, reference)


def test_md_checkpoint_left_behind_is_not_silently_dropped(
    md_reference, tmp_path, capsys
):
    inputs, _ = md_reference
    folder = tmp_path / "md"
    folder.mkdir()
    (folder / "checkpoint.npz").write_bytes(b"from an interrupted run")
    code = main(["md", str(inputs), "-o", str(folder), *MD])
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "holds the checkpoint of an interrupted run; pass --restart" in err
    assert (folder / "checkpoint.npz").read_bytes() == b"from an interrupted run"


@pytest.mark.slow  # ~20 s: two runs and a stopped one
def test_calc_stopped_by_sigterm_flushes_and_restarts(tmp_path, capsys):
    inputs = tmp_path / "in.extxyz"
    count = 30
    write(inputs, mixed_argon(count))
    settings = ["--batch-size", "2", *LJ]
    reference = tmp_path / "reference.extxyz"
    assert main(["calc", str(inputs), "-o", str(reference), *settings]) == 0

    output = tmp_path / "calc.extxyz"
    staged = tmp_path / "calc.partial.extxyz"
    argv = ["calc", str(inputs), "-o", str(output), *settings, "--restart"]
    process = spawn_slowed_cli(tmp_path, argv)
    ready = lambda: staged.exists() and len(finished_indices(staged)) >= 4  # noqa: E731
    status, err = signal_when(process, ready, signal.SIGTERM)
    assert status == REQUEUE_STATUS, err
    lines = _own_lines(err)
    assert len(lines) == 1, err
    assert lines[0].startswith("nvalchemi-ase calc: interrupted by SIGTERM; ")
    assert f"results so far in {staged}" in err
    assert "rerun the same command with --restart to continue" in err
    kept = len(finished_indices(staged))
    assert 4 <= kept < count

    assert main(argv) == 0, capsys.readouterr().err
    assert output.read_text() == reference.read_text()


@pytest.mark.slow  # ~30 s: two relaxations and a stopped one
def test_relax_stopped_by_sigterm_restarts_to_the_uninterrupted_run(tmp_path, capsys):
    inputs = tmp_path / "in.extxyz"
    count = 16
    write(inputs, mixed_argon(count))
    settings = [
        "--optimizer",
        "BFGS",
        "--fmax",
        "0.01",
        "--batch-size",
        "4",
        "--checkpoint-every",
        "3",
        *LJ,
    ]
    reference = tmp_path / "reference.extxyz"
    reference_frames = tmp_path / "reference-traj"
    first = ["relax", str(inputs), "-o", str(reference), *settings]
    assert main([*first, "--trajectories", str(reference_frames)]) == 0

    output = tmp_path / "relaxed.extxyz"
    staged = tmp_path / "relaxed.partial.extxyz"
    checkpoint = tmp_path / "relaxed.checkpoint.npz"
    frames = tmp_path / "traj"
    argv = ["relax", str(inputs), "-o", str(output), *settings, "--restart"]
    argv += ["--trajectories", str(frames)]
    process = spawn_slowed_cli(tmp_path, argv)
    ready = lambda: staged.exists() and len(finished_indices(staged)) >= 4  # noqa: E731
    status, err = signal_when(process, ready, signal.SIGTERM)
    assert status == REQUEUE_STATUS, err
    lines = _own_lines(err)
    assert len(lines) == 1, err
    assert lines[0].startswith("nvalchemi-ase relax: interrupted by SIGTERM at step ")
    assert f"checkpoint written to {checkpoint}" in lines[0]
    assert checkpoint.exists()
    assert 4 <= len(finished_indices(staged)) < count

    assert main(argv) == 0, capsys.readouterr().err
    assert not checkpoint.exists()
    # the structures in flight went on from the checkpoint: the run's bytes
    assert output.read_text() == reference.read_text()
    for index in range(count):
        name = f"{index:05d}.traj"
        have, want = read(frames / name, ":"), read(reference_frames / name, ":")
        assert len(have) == len(want), name
        for a, b in zip(have, want, strict=True):
            np.testing.assert_array_equal(a.positions, b.positions)
            assert a.get_potential_energy() == b.get_potential_energy()


def test_handlers_are_installed_for_the_command_only():
    numbers = (signal.SIGTERM, signal.SIGINT)
    before = {number: signal.getsignal(number) for number in numbers}
    signals = StopSignals()
    with signals.installed():
        assert signal.getsignal(signal.SIGTERM) == signals._handle
        with signals.deferring():
            signal.raise_signal(signal.SIGTERM)  # asks for a stop, raises nothing
            assert signals()
            assert signals.received == "SIGTERM"
            with pytest.raises(SignalInterrupt):  # a second one: at once
                signal.raise_signal(signal.SIGINT)
        with pytest.raises(SignalInterrupt):  # outside a deferring run: at once
            signal.raise_signal(signal.SIGINT)
    assert {number: signal.getsignal(number) for number in numbers} == before


def test_checkpoint_every_default_is_the_dynamics_default():
    from nvalchemi_ase.cli.common import CHECKPOINT_EVERY
    from nvalchemi_ase.dynamics.checkpoint import DEFAULT_RESTART_INTERVAL

    assert CHECKPOINT_EVERY == DEFAULT_RESTART_INTERVAL


def test_md_help_documents_restart_checkpoints_and_the_exit_status(capsys):
    from nvalchemi_ase.cli.main import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["md", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--restart" in text
    assert "--checkpoint-every N" in text
    assert "(default: 100," in text
    assert f"exits with status {REQUEUE_STATUS}" in text
