"""``nvalchemi-ase md --temperature`` with a ramp: equal to the Python schedule."""

from __future__ import annotations

import numpy as np
import pytest
from ase import units
from ase.build import bulk
from ase.io import read, write

from nvalchemi_ase import NVAlchemiCalculator
from nvalchemi_ase.cli.main import main
from nvalchemi_ase.md import NoseHooverChainNVT
from tests.structures import thermalize

LJ = ["--model", "lj", "--dtype", "float64", "--device", "cpu", "--quiet"]
EXTXYZ_DIGITS = 1e-7  # extxyz stores 8 decimals


def _inputs():
    sizes = [(2, 2, 2), (1, 1, 2)]
    return [
        thermalize(bulk("Ar", "fcc", a=5.26, cubic=True).repeat(size), 30.0, seed)
        for seed, size in enumerate(sizes)
    ]


@pytest.mark.parametrize(
    ("argument", "points"),
    [
        ("20:80", [(0, 20.0), (30, 80.0)]),
        ("0:20,10:80,20:40", [(0, 20.0), (10, 80.0), (20, 40.0)]),
    ],
)
def test_md_temperature_ramp_equals_the_python_schedule(tmp_path, argument, points):
    inputs = _inputs()
    write(tmp_path / "in.extxyz", inputs)
    out = tmp_path / "md"
    argv = [
        "md",
        str(tmp_path / "in.extxyz"),
        "--ensemble",
        "nvt",
        "--thermostat",
        "nose-hoover",
        "--temperature",
        argument,
        "--steps",
        "30",
        "-o",
        str(out),
        *LJ,
    ]
    assert main(argv) == 0
    frames = read(out / "final.extxyz", ":")
    calc = NVAlchemiCalculator("lj", device="cpu", dtype="float64")
    for atoms in inputs:
        atoms.calc = calc
    NoseHooverChainNVT(
        inputs, 1 * units.fs, temperature_K=points, tdamp=100 * units.fs
    ).run(30)
    for frame, reference in zip(frames, inputs, strict=True):
        np.testing.assert_allclose(
            frame.positions, reference.positions, atol=EXTXYZ_DIGITS
        )


@pytest.mark.parametrize("argument", ["20:abc", "0:20,0:30", "-5:30"])
def test_bad_ramps_give_one_line_errors(tmp_path, capsys, argument):
    write(tmp_path / "in.extxyz", _inputs())
    argv = ["md", str(tmp_path / "in.extxyz"), f"--temperature={argument}"]
    try:
        code = main([*argv, "--steps", "3", "-o", str(tmp_path / "md"), *LJ])
    except SystemExit as stop:  # argparse's own error
        code = stop.code
    assert code != 0
    assert "--temperature" in capsys.readouterr().err
    assert not (tmp_path / "md" / "final.extxyz").exists()
