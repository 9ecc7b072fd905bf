"""Every file written reads back, whatever ``info``/``arrays`` ASE accepts hold.

Newlines, quotes, unicode, ``=`` in keys, empty strings, ``None`` and strings
that look like numbers once made extxyz outputs that ``ase.io.read`` and
``read_results`` could not parse (or read as something else); the command
line then did all the work and exited 2 without its final file.
"""

from __future__ import annotations

import io

import ase.io
import numpy as np
import pytest
from ase import Atoms
from ase.build import bulk
from ase.calculators.singlepoint import SinglePointCalculator

from nvalchemi_ase import NVAlchemiCalculator
from nvalchemi_ase.io_safe import ENCODED_KEY, decoded_frame, encoded_frame

#: float64 LJ through the same path: the numbers written are the numbers read.
ENERGY_TOL = 1e-12  # eV (extxyz writes 17 significant digits)
COLUMN_TOL = 1e-8  # Å, eV/Å: extxyz columns have 8 decimals

HOSTILE_INFO = {
    "comment": "line one\nline two \"quoted\" 'single' Å 日本 = x",
    "a=b": 1,
    "key with space": "value",
    "back": "back\\slash",
    "tab": "a\tb",
    "carriage": "a\rb",
    "empty": "",
    "none": None,
    "looks_numeric": "1.0",
    "looks_bool": "T",
    "nested": {"k": [1, 2], "s": "x\ny"},
    "plain": "kept",
    "number": 3.5,
}


def _hostile(atoms: Atoms) -> Atoms:
    atoms = atoms.copy()
    atoms.info.update(HOSTILE_INFO)
    atoms.arrays["label"] = np.array([f"atom {i}\n" for i in range(len(atoms))])
    atoms.arrays["weird=name"] = np.arange(len(atoms), dtype=float)
    return atoms


def _structures() -> list[Atoms]:
    structures = []
    for k in range(3):
        atoms = bulk("Ar", "fcc", a=5.26, cubic=True).repeat((1, 1, 1 + k))
        atoms.rattle(0.02, seed=k)
        structures.append(_hostile(atoms))
    return structures


def _assert_same_metadata(read: Atoms, written: Atoms) -> None:
    for key, value in HOSTILE_INFO.items():
        assert read.info[key] == value, key
    assert list(read.arrays["label"]) == list(written.arrays["label"])
    np.testing.assert_array_equal(
        read.arrays["weird=name"], written.arrays["weird=name"]
    )


def test_ase_alone_cannot_read_these_back():
    """The reason for encoding: without it the frame does not parse."""
    atoms = _structures()[0]
    text = io.StringIO()
    ase.io.write(text, atoms, format="extxyz")
    text.seek(0)
    with pytest.raises(Exception):  # noqa: B017 (ASE's parse errors vary)
        ase.io.read(text, format="extxyz")


def test_encoded_frame_round_trips_through_ase():
    atoms = _structures()[1]
    atoms.calc = SinglePointCalculator(
        atoms, energy=-1.25, forces=np.arange(3 * len(atoms)).reshape(-1, 3) * 0.1
    )
    text = io.StringIO()
    ase.io.write(text, encoded_frame(atoms), format="extxyz")
    assert "label" in atoms.arrays  # the caller's frame is untouched
    text.seek(0)
    read = ase.io.read(text, format="extxyz")  # plain ASE: parses
    assert ENCODED_KEY in read.info
    assert read.info["plain"] == "kept"  # what survives stays in the open
    assert read.info["number"] == 3.5
    np.testing.assert_allclose(read.positions, atoms.positions, atol=COLUMN_TOL)
    assert read.get_potential_energy() == -1.25
    np.testing.assert_allclose(read.get_forces(), atoms.get_forces(), atol=COLUMN_TOL)
    _assert_same_metadata(decoded_frame(read), atoms)


def test_ordinary_frames_are_written_as_before():
    atoms = bulk("Cu", cubic=True)
    atoms.info.update(source="in.extxyz@3", index=4, note="two words")
    assert encoded_frame(atoms) is atoms


def test_single_points_output_reads_back(tmp_path):
    from nvalchemi_ase.runners import read_results, single_points

    structures = _structures()
    output = tmp_path / "out.extxyz"
    returned = single_points(structures, "lj", output=output)
    frames = ase.io.read(output, ":")
    assert len(frames) == len(structures)
    reference = NVAlchemiCalculator("lj", device="cpu").calculate_batch(structures)
    for read, written, expected in zip(
        read_results(output), structures, reference, strict=True
    ):
        _assert_same_metadata(read, written)
        assert read.get_potential_energy() == pytest.approx(
            expected["energy"], abs=ENERGY_TOL
        )
    assert [a.info["comment"] for a in returned] == [HOSTILE_INFO["comment"]] * 3


def test_relaxation_trajectories_read_back(tmp_path):
    from nvalchemi_ase.runners import relax

    structures = _structures()
    relax(structures, "lj", steps=3, trajectory=str(tmp_path / "r_{i}.traj"))
    for index, written in enumerate(structures):
        frames = ase.io.read(tmp_path / f"r_{index}.traj", ":")
        assert frames
        assert frames[-1].info["comment"] == written.info["comment"]
        assert frames[-1].info["none"] is None


@pytest.mark.parametrize("command", ["calc", "relax"])
def test_cli_finishes_and_its_output_reads_back(tmp_path, command):
    from nvalchemi_ase.cli.main import main
    from nvalchemi_ase.runners import read_results

    structures = _structures()
    for atoms in structures:
        del atoms.arrays["label"], atoms.arrays["weird=name"]  # .traj drops them
    source = tmp_path / "in.traj"
    ase.io.write(source, structures)
    output = tmp_path / f"{command}.extxyz"
    argv = [command, str(source), "--model", "lj", "--device", "cpu", "-o", str(output)]
    assert main(argv) == 0  # this process: a fresh interpreter adds ~12 s of CPU
    assert output.exists()
    assert not list(tmp_path.glob("*.partial.*"))
    read = read_results(output)
    assert len(ase.io.read(output, ":")) == len(structures)
    for atoms in read:
        assert atoms.info["comment"] == HOSTILE_INFO["comment"]
        assert atoms.info["a=b"] == 1
        assert atoms.info["empty"] == ""
