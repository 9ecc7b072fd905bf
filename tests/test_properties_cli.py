"""``nvalchemi-ase eos|elastic|phonons``: per-material JSON, table, plots, summary."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
from ase.build import bulk
from ase.io import read, write

from nvalchemi_ase.cli.main import main
from nvalchemi_ase.properties import elastic_constants, equation_of_state
from tests.structures import A_AR

LJ = ["--model", "lj", "--dtype", "float64", "--device", "cpu", "--quiet"]


@pytest.fixture
def inputs(tmp_path):
    """Two frames in one file and one single-frame file; the second frame is bad."""
    broken = bulk("Ar", "fcc", a=A_AR)
    broken.pbc = (True, True, False)  # not bulk: fails alone
    write(tmp_path / "argon.extxyz", [bulk("Ar", "fcc", a=A_AR, cubic=True), broken])
    write(tmp_path / "hcp.extxyz", bulk("Ar", "hcp", a=3.72, c=6.07))
    return [str(tmp_path / "argon.extxyz"), str(tmp_path / "hcp.extxyz")]


def _rows(path):
    with path.open(encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


def test_eos_writes_one_result_per_material_and_isolates_failures(
    tmp_path, inputs, lj_calc64
):
    prefix = tmp_path / "out" / "run"
    code = main(["eos", *inputs, "--file-prefix", str(prefix), *LJ])
    assert code == 1  # one material failed
    rows = _rows(tmp_path / "out" / "run-eos-results.csv")
    assert [r["material"] for r in rows] == ["argon-0", "argon-1", "hcp"]
    assert [r["status"] for r in rows] == ["ok", "FAILED", "ok"]
    data = json.loads((tmp_path / "out" / "run-argon-0-eos.json").read_text())
    assert data["source"].endswith("argon.extxyz@0")
    assert data["units"]["B"] == "GPa"
    (expected,) = equation_of_state(bulk("Ar", "fcc", a=A_AR, cubic=True), lj_calc64)
    assert data["B"] == pytest.approx(expected.B, rel=1e-10)
    assert float(rows[0]["B/GPa"]) == pytest.approx(expected.B, abs=1e-3)
    failed = json.loads((tmp_path / "out" / "run-argon-1-eos.json").read_text())
    assert "periodic" in failed["error"]
    assert failed["v0"] is None
    assert (tmp_path / "out" / "run-argon-0-eos.png").stat().st_size > 0
    assert not (tmp_path / "out" / "run-argon-1-eos.png").exists()
    scan = read(tmp_path / "out" / "run-argon-0-eos.extxyz", ":")
    assert [a.get_potential_energy() for a in scan] == pytest.approx(
        expected.energies, rel=1e-10
    )
    assert not (tmp_path / "out" / "run-argon-1-eos.extxyz").exists()
    summary = json.loads((tmp_path / "out" / "run-eos-summary.json").read_text())
    assert summary["materials"] == 3
    assert [f["material"] for f in summary["failed"]] == ["argon-1"]
    assert summary["model"]["class"] == "LennardJonesModelWrapper"
    assert {"read_s", "compute_s", "write_s", "total_s"} <= set(summary["timings"])
    assert str(tmp_path / "out" / "run-hcp-eos.json") in summary["outputs"]
    assert not list((tmp_path / "out").glob("*.partial.*"))
    # a second run refuses to replace the outputs without --overwrite
    assert main(["eos", *inputs, "--file-prefix", str(prefix), *LJ]) == 2
    assert main(["eos", *inputs, "--file-prefix", str(prefix), "--overwrite", *LJ]) == 1


def test_elastic_writes_c_per_material(tmp_path, inputs, lj_calc64):
    code = main(
        ["elastic", inputs[1], "--clamped", "--file-prefix", f"{tmp_path}/", *LJ]
    )
    assert code == 0
    data = json.loads((tmp_path / "hcp-elastic.json").read_text())
    (expected,) = elastic_constants(
        bulk("Ar", "hcp", a=3.72, c=6.07), lj_calc64, relax_ions=False
    )
    np.testing.assert_allclose(data["C"], expected.C, atol=1e-6)  # extxyz digits
    assert data["units"]["C"] == "GPa"
    (row,) = _rows(tmp_path / "elastic-results.csv")
    assert float(row["C11"]) == pytest.approx(expected.C[0, 0], abs=0.01)


def test_phonons_write_json_phonopy_yaml_and_plot(tmp_path, inputs):
    pytest.importorskip("phonopy")
    code = main(
        [
            "phonons",
            inputs[1],
            "--mesh",
            "4",
            "4",
            "4",
            "--band-npoints",
            "20",
            "--file-prefix",
            f"{tmp_path}/",
            *LJ,
        ]
    )
    assert code == 0
    data = json.loads((tmp_path / "hcp-phonons.json").read_text())
    assert "force_constants" not in data  # in the phonopy file instead
    assert np.array(data["band_frequencies"]).shape == (20, 6)
    assert (tmp_path / "hcp-phonons.png").stat().st_size > 0
    import phonopy

    loaded = phonopy.load(str(tmp_path / "hcp-phonopy.yaml"), produce_fc=False)
    assert loaded.force_constants.shape[1:] == (16, 3, 3)  # the supercell's
    loaded.run_qpoints([[0.0, 0.0, 0.0]])
    np.testing.assert_allclose(
        loaded.qpoints.frequencies[0], data["gamma_frequencies"], atol=1e-5
    )


def test_phonons_take_one_supercell_integer_as_n_n_n(tmp_path, inputs):
    pytest.importorskip("phonopy")
    results = {}
    for supercell in (["2"], ["2", "2", "2"]):
        out = tmp_path / "x".join(supercell)
        argv = ["phonons", inputs[1], "--supercell", *supercell, "--no-dos"]
        argv += ["--band-path", "none", "--file-prefix", f"{out}/", *LJ]
        assert main(argv) == 0
        results[len(supercell)] = json.loads((out / "hcp-phonons.json").read_text())
    assert results[1]["supercell_matrix"] == (2 * np.eye(3, dtype=int)).tolist()
    assert results[1]["supercell_matrix"] == results[3]["supercell_matrix"]
    assert results[1]["gamma_frequencies"] == results[3]["gamma_frequencies"]


def test_shape_relaxation_runs_from_the_command_line(tmp_path, inputs):
    code = main(
        ["eos", inputs[1], "--relax", "shape", "--file-prefix", f"{tmp_path}/", *LJ]
    )
    assert code == 0
    assert list(tmp_path.glob("*.json"))
