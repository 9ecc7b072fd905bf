"""``nvalchemi-ase surface|defect``: JSON, CSV, extxyz, plots, summary, failures."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
from ase.build import bulk
from ase.io import read, write

from nvalchemi_ase.cli.main import main
from nvalchemi_ase.properties import defect_formation_energies, surface_energies
from tests.structures import A_AR

LJ = ["--model", "lj", "--dtype", "float64", "--device", "cpu", "--quiet"]


@pytest.fixture
def inputs(tmp_path):
    """A good and a non-bulk frame in one file (the second fails alone)."""
    broken = bulk("Ar", "fcc", a=A_AR, cubic=True)
    broken.pbc = (True, True, False)
    write(tmp_path / "argon.extxyz", [bulk("Ar", "fcc", a=A_AR, cubic=True), broken])
    return [str(tmp_path / "argon.extxyz")]


def _rows(path):
    with path.open(encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


def test_surface_command_writes_results_slabs_and_plots(tmp_path, inputs, lj_calc64):
    out = tmp_path / "out/"
    args = ["surface", *inputs, "--miller", "111", "1,0,0", "--layers", "2"]
    code = main([*args, "--clamped", "--file-prefix", f"{out}/", *LJ])
    assert code == 1  # one material failed
    rows = _rows(out / "surface-results.csv")
    assert [r["status"] for r in rows] == ["ok", "FAILED"]
    (expected,) = surface_energies(
        bulk("Ar", "fcc", a=A_AR, cubic=True),
        lj_calc64,
        miller=[(1, 1, 1), (1, 0, 0)],
        layers=2,
        relax=False,
    )
    data = json.loads((out / "argon-0-surface.json").read_text())
    np.testing.assert_allclose(
        data["surface_energies_si"], expected.surface_energies_si, rtol=1e-10
    )
    assert data["units"]["surface_energies"] == "eV/Å^2"
    assert float(rows[0]["γ(111)/J/m²"]) == pytest.approx(
        expected.surface_energies_si[0], abs=1e-4
    )
    slabs = read(out / "argon-0-surface-slabs.extxyz", index=":")
    assert [len(s) for s in slabs] == list(expected.slab_natoms)
    np.testing.assert_allclose(
        [s.get_potential_energy() for s in slabs], expected.slab_energies, rtol=1e-10
    )
    np.testing.assert_array_equal(slabs[0].info["miller"], [1, 1, 1])
    assert (out / "argon-0-surface.png").stat().st_size > 0
    assert not (out / "argon-1-surface.png").exists()
    summary = json.loads((out / "surface-summary.json").read_text())
    assert [f["material"] for f in summary["failed"]] == ["argon-1"]
    assert "periodic" in summary["failed"][0]["reason"]


def test_defect_command_writes_results_and_structures(tmp_path, inputs, lj_calc64):
    out = tmp_path / "out/"
    code = main(
        [
            "defect",
            *inputs,
            "--defects",
            "vacancy",
            "substitution:Kr",
            "--chemical-potential",
            "Kr=-0.05",
            "--supercell",
            "2",
            "--fmax",
            "0.01",
            "--file-prefix",
            f"{out}/",
            *LJ,
        ]
    )
    assert code == 1
    (expected,) = defect_formation_energies(
        bulk("Ar", "fcc", a=A_AR, cubic=True),
        lj_calc64,
        defects=("vacancy", "substitution:Kr"),
        chemical_potentials={"Kr": -0.05},
        fmax=0.01,
    )
    data = json.loads((out / "argon-0-defect.json").read_text())
    assert data["defects"] == ["V_Ar", "Kr_Ar"]
    np.testing.assert_allclose(
        data["formation_energies"], expected.formation_energies, rtol=1e-8
    )
    assert data["chemical_potentials"]["Kr"] == -0.05
    structures = read(out / "argon-0-defect-structures.extxyz", index=":")
    assert [s.info["defect"] for s in structures] == ["V_Ar", "Kr_Ar"]
    assert [len(s) for s in structures] == [31, 32]
    rows = _rows(out / "defect-results.csv")
    assert rows[0]["E_f/eV"].startswith("V_Ar=")
    assert rows[1]["status"] == "FAILED"
    assert (out / "argon-0-defect.png").stat().st_size > 0


def test_defect_command_errors_name_the_fix(tmp_path, capsys):
    write(tmp_path / "nacl.extxyz", bulk("NaCl", "rocksalt", a=5.6, cubic=True))
    args = [str(tmp_path / "nacl.extxyz"), "--file-prefix", f"{tmp_path}/o/", *LJ]
    assert main(["defect", *args, "--clamped"]) == 2
    assert "--chemical-potential Na=VALUE in eV/atom" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["defect", *args, "--defects", "antisite"])
    with pytest.raises(SystemExit):
        main(["surface", *args, "--miller", "000"])
