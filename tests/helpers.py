"""Assertion helpers the test modules import (fixtures live in conftest.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from ase import Atoms

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
