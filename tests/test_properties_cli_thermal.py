"""``nvalchemi-ase kappa|qha``: per-material JSON, table, plots, summary (LJ)."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
from ase.build import bulk
from ase.io import write

from nvalchemi_ase.cli.main import main
from tests.structures import A_AR

LJ = ["--model", "lj", "--dtype", "float64", "--device", "cpu", "--quiet"]
SMOOTH_LJ = ["--model", "lj:cutoff=9.0,switch_width=2.0", *LJ[2:]]


def _rows(path):
    with path.open(encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


@pytest.fixture
def inputs(tmp_path):
    """fcc argon and a slab (not bulk: fails alone)."""
    slab = bulk("Ar", "fcc", a=A_AR)
    slab.pbc = (True, True, False)
    write(tmp_path / "argon.extxyz", [bulk("Ar", "fcc", a=A_AR, cubic=True), slab])
    return [str(tmp_path / "argon.extxyz")]


def test_kappa_writes_json_csv_plot_and_isolates_failures(tmp_path, inputs, lj_calc64):
    pytest.importorskip("phono3py")
    from nvalchemi_ase.properties import thermal_conductivity

    prefix = tmp_path / "out" / "run"
    options = ["--mesh", "3", "3", "3", "--temperatures", "20", "40", "--no-relax"]
    code = main(["kappa", *inputs, "--file-prefix", str(prefix), *options, *LJ])
    assert code == 1  # the slab failed
    rows = _rows(tmp_path / "out" / "run-kappa-results.csv")
    assert [r["status"] for r in rows] == ["ok", "FAILED"]
    data = json.loads((tmp_path / "out" / "run-argon-0-kappa.json").read_text())
    assert data["units"]["kappa"] == "W/(m K)"
    (expected,) = thermal_conductivity(
        bulk("Ar", "fcc", a=A_AR, cubic=True),
        lj_calc64,
        mesh=(3, 3, 3),
        temperatures=(20.0, 40.0),
        relax=False,
    )
    np.testing.assert_allclose(data["kappa"], expected.kappa, rtol=1e-10)
    assert data["max_force_sum"] < 1e-10
    assert (tmp_path / "out" / "run-argon-0-kappa.png").stat().st_size > 0
    failed = json.loads((tmp_path / "out" / "run-argon-1-kappa.json").read_text())
    assert "periodic" in failed["error"]
    summary = json.loads((tmp_path / "out" / "run-kappa-summary.json").read_text())
    assert summary["command"] == "nvalchemi-ase kappa"
    assert [f["material"] for f in summary["failed"]] == ["argon-1"]


def test_kappa_refuses_a_bad_supercell_before_any_work(tmp_path, inputs, capsys):
    pytest.importorskip("phono3py")
    code = main(["kappa", *inputs, "--supercell", "2", "2", *LJ])
    assert code == 2
    assert "--supercell takes 1, 3 or 9" in capsys.readouterr().err


def test_qha_writes_json_csv_and_plot(tmp_path):
    pytest.importorskip("phonopy")
    write(tmp_path / "fcc.extxyz", bulk("Ar", "fcc", a=A_AR))
    prefix = f"{tmp_path / 'out'}/"
    options = [
        "--n-volumes", "5", "--strain", "0.05", "--supercell", "2",
        "--mesh", "5", "5", "5", "--t-max", "50", "--t-step", "10",
    ]  # fmt: skip
    code = main(
        ["qha", str(tmp_path / "fcc.extxyz"), "--file-prefix", str(prefix),
         *options, *SMOOTH_LJ]
    )  # fmt: skip
    assert code == 0
    (row,) = _rows(tmp_path / "out" / "qha-results.csv")
    assert row["status"] == "ok"
    assert float(row["T max/K"]) == 50.0
    data = json.loads((tmp_path / "out" / "fcc-qha.json").read_text())
    assert data["units"]["thermal_expansion"] == "1/K"
    assert data["temperatures"] == [0.0, 10.0, 20.0, 30.0, 40.0, 50.0]
    volumes = np.array(data["volume_temperature"])
    assert (np.diff(volumes) > 0).all()
    assert float(row["V(T max)/Å³"]) == pytest.approx(volumes[-1], abs=1e-3)
    assert (tmp_path / "out" / "fcc-qha.png").stat().st_size > 0
