"""Assertion helpers the test modules import (fixtures live in conftest.py)."""

from __future__ import annotations

import numpy as np
from ase import Atoms


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
