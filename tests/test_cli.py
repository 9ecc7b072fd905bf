"""The command line: ``python -m nvalchemi_ase``."""

from __future__ import annotations

import subprocess
import sys

import pytest

from nvalchemi_ase.cli.main import main


def test_demo_prints_one_row_per_structure_with_pressure_only_for_bulk(
    capsys, lj_calc64
):
    from nvalchemi_ase.cli.demo import demo_structures

    assert main(["demo", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    rows = [
        line
        for line in out.splitlines()
        if line.startswith("| ") and "formula" not in line
    ]
    assert len(rows) == 3
    cells = [[c.strip() for c in row.strip("|").split("|")] for row in rows]
    expected = lj_calc64.calculate_batch(demo_structures())
    for row, result in zip(cells, expected, strict=True):
        assert float(row[3]) == pytest.approx(result["energy"], abs=1e-6)
    assert cells[0][2] == "TTT"
    assert cells[0][6] != "-"
    assert cells[1][6] == "-"
    assert cells[2][6] == "-"


def test_help_is_fast_and_names_units():
    result = subprocess.run(
        [sys.executable, "-m", "nvalchemi_ase", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "eV/Å" in result.stdout
    assert "demo" in result.stdout


def test_errors_are_one_line_without_traceback(capsys):
    assert main(["demo", "--device", "cpu", "--dtype", "float16"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "dtype='float16' is not supported" in err
    assert "Traceback" not in err
