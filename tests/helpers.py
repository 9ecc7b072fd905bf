"""Assertion helpers the test modules import (fixtures live in conftest.py)."""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from ase import Atoms

import nvalchemi_ase

#: The command line with a slowed-down model: each dynamics step and each
#: batched evaluation sleeps first, so a signal lands while the run writes.
#: ``SLOW_STEP_S`` in the environment sets the sleep per step (default 0.01 s).
SLOWED = """
import os, sys, time
from nvalchemi_ase.calculator import NVAlchemiCalculator
from nvalchemi_ase.dynamics.base import BatchedDynamics

def slowed(method, seconds):
    def call(*args, **kwargs):
        time.sleep(seconds)
        return method(*args, **kwargs)
    return call

step = float(os.environ.get("SLOW_STEP_S", "0.01"))
BatchedDynamics._advance = slowed(BatchedDynamics._advance, step)
NVAlchemiCalculator.calculate_batch = slowed(NVAlchemiCalculator.calculate_batch, 0.1)
from nvalchemi_ase.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


class ForkedRun:
    """A command-line run forked by the zygote (:mod:`tests.cli_zygote`).

    What :func:`signal_when` and the tests use of ``subprocess.Popen``:
    ``pid``, ``returncode``, ``poll``, ``send_signal``, ``kill``, ``wait``,
    ``communicate`` (standard error, written to a file, as text) and
    ``stderr`` (that file, opened for reading).
    """

    def __init__(self, zygote: subprocess.Popen, pid: int, stderr: Path) -> None:
        self._zygote = zygote
        self.pid = pid
        self.returncode: int | None = None
        self._stderr_path = stderr
        self.stderr = stderr.open()

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = _ask_zygote(self._zygote, {"poll": self.pid})["status"]
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            time.sleep(0.01)
        assert self.returncode is not None
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[None, str]:
        self.wait(timeout)
        return None, self._stderr_path.read_text()


_ZYGOTES: dict[str, subprocess.Popen] = {}


def _ask_zygote(zygote: subprocess.Popen, request: dict) -> dict:
    assert zygote.stdin is not None
    assert zygote.stdout is not None
    zygote.stdin.write(json.dumps(request) + "\n")
    zygote.stdin.flush()
    line = zygote.stdout.readline()
    if not line:
        raise RuntimeError(f"the command-line zygote ended ({zygote.poll()})")
    return json.loads(line)


def _zygote(package_root: str) -> subprocess.Popen:
    """This process's zygote for ``package_root`` (started at the first run)."""
    zygote = _ZYGOTES.get(package_root)
    if zygote is None or zygote.poll() is not None:
        zygote = subprocess.Popen(
            [sys.executable, "-m", "tests.cli_zygote"],
            cwd=package_root,
            env={**os.environ, "PYTHONPATH": package_root},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        _ZYGOTES[package_root] = zygote
        atexit.register(_end_zygote, zygote)
    return zygote


def _end_zygote(zygote: subprocess.Popen) -> None:
    if zygote.stdin is not None:
        zygote.stdin.close()  # its loop ends
    zygote.wait(timeout=60)


def spawn_forked(
    code: str, argv: list[str], cwd: Path, env: dict[str, str], stderr: Path
) -> ForkedRun:
    """Run the script ``code`` with ``argv`` in a process of its own, forked from
    the zygote (:mod:`tests.cli_zygote`) that imported this checkout's package,
    torch, nvalchemi and the command line once; standard error to ``stderr``."""
    package_root = str(Path(nvalchemi_ase.__file__).resolve().parents[1])
    stderr.write_text("")  # the child writes it; readable from the start
    zygote = _zygote(package_root)
    request = {"argv": argv, "cwd": str(cwd), "env": env, "stderr": str(stderr)}
    answer = _ask_zygote(zygote, {"spawn": {**request, "code": code}})
    return ForkedRun(zygote, int(answer["pid"]), stderr)


def spawn_slowed_cli(
    tmp_path: Path, argv: list[str], step_s: float = 0.01
) -> ForkedRun:
    """Start ``nvalchemi-ase ARGV`` with a slowed model (:data:`SLOWED`) in a process
    of its own (:func:`spawn_forked`) that imports this checkout's package; its
    standard error goes to a file."""
    package_root = str(Path(nvalchemi_ase.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": package_root, "SLOW_STEP_S": str(step_s)}
    return spawn_forked(SLOWED, argv, tmp_path, env, tmp_path / "slowed.stderr")


def signal_when(
    process: subprocess.Popen | ForkedRun,
    ready: Callable[[], bool],
    signum: int = signal.SIGKILL,
    timeout: float = 300.0,
) -> tuple[int, str]:
    """Send ``signum`` to ``process`` as soon as ``ready()``; fail if it ended first.

    Returns
    -------
    (int, str)
        The process's exit status and its standard error.
    """
    deadline = time.monotonic() + timeout
    try:
        while not ready():
            if process.poll() is not None:
                pytest.fail(
                    f"the run ended (status {process.returncode}) before the "
                    f"signal: {process.stderr.read() if process.stderr else ''}"
                )
            if time.monotonic() > deadline:
                pytest.fail("the run wrote nothing in time")
            time.sleep(0.02)
        process.send_signal(signum)
        _, err = process.communicate(timeout=120)
        return process.returncode, err or ""
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=60)
        if process.stderr is not None:
            process.stderr.close()


ROOT = Path(__file__).resolve().parents[1]


def snapshot(atoms: Atoms) -> dict:
    """Copy of everything a caller could see change on ``atoms``."""
    return {
        "arrays": {k: v.copy() for k, v in atoms.arrays.items()},
        "cell": atoms.cell.array.copy(),
        "pbc": atoms.pbc.copy(),
        "info": dict(atoms.info),
        "constraints": [c.todict() for c in atoms.constraints],
        "calc": atoms.calc,
    }


def assert_same_snapshot(before: dict, atoms: Atoms) -> None:
    """Assert ``atoms`` still matches the :func:`snapshot` taken ``before``."""
    after = snapshot(atoms)
    assert before["arrays"].keys() == after["arrays"].keys()
    for key, value in before["arrays"].items():
        np.testing.assert_array_equal(value, after["arrays"][key])
    np.testing.assert_array_equal(before["cell"], after["cell"])
    np.testing.assert_array_equal(before["pbc"], after["pbc"])
    assert before["info"] == after["info"]
    assert before["constraints"] == after["constraints"]
    assert before["calc"] is after["calc"]


def frames_by_index(path) -> dict[int, str]:
    """The text of each frame of a runner's extxyz output, by ``info["index"]``."""
    frames = {}
    lines = path.read_text().splitlines(keepends=True)
    start = 0
    while start < len(lines):
        count = int(lines[start])
        index = int(lines[start + 1].split("index=")[1].split()[0])
        frames[index] = "".join(lines[start : start + count + 2])
        start += count + 2
    return frames


def write_results(path, frames) -> None:
    """Write runner results to extxyz as a runner does (``failure`` only if set)."""
    from ase.io import write

    copies = []
    for frame in frames:
        copy = frame.copy()
        copy.calc = frame.calc
        if copy.info.get("failure") is None:
            copy.info.pop("failure", None)
        copies.append(copy)
    write(path, copies, format="extxyz")


def torchrun(*arguments: str, ranks: int = 2, cwd: Path = ROOT) -> str:
    """Run ``python -m torch.distributed.run`` with one thread per rank."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={ranks}",
        *arguments,
    ]
    done = subprocess.run(
        command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout
