"""The command line: ``nvalchemi-ase`` / ``python -m nvalchemi_ase``."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from ase import Atoms
from ase.build import bulk, fcc111
from ase.cluster import Icosahedron
from ase.io import read, write

from nvalchemi_ase.cli.main import main

LJ = ["--model", "lj", "--dtype", "float64", "--device", "cpu", "--quiet"]


def mixed_argon(count: int) -> list[Atoms]:
    """Bulk (two sizes), slabs and clusters, rattled differently."""
    images = []
    for index in range(count):
        kind = index % 4
        if kind == 0:
            atoms = bulk("Ar", "fcc", a=5.26, cubic=True).repeat(2)
        elif kind == 1:
            atoms = bulk("Ar", "fcc", a=5.26)
        elif kind == 2:
            atoms = fcc111("Ar", size=(2, 2, 2), a=5.26, vacuum=None)
            atoms.pbc = (True, True, False)
            atoms.info.clear()
        else:
            atoms = Icosahedron("Ar", noshells=2, latticeconstant=5.26)
        atoms.rattle(0.04, seed=index)
        atoms.info["tag"] = index
        images.append(atoms)
    return images


@pytest.mark.slow
def test_relax_round_trip_keeps_input_order_and_results(tmp_path, capsys):
    inputs = mixed_argon(50)
    write(tmp_path / "in.extxyz", inputs)
    output = tmp_path / "relaxed.extxyz"
    code = main(
        [
            "relax",
            str(tmp_path / "in.extxyz"),
            "-o",
            str(output),
            "--fmax",
            "0.02",
            "--batch-size",
            "16",
            "--trajectories",
            str(tmp_path / "traj"),
            *LJ,
        ]
    )
    assert code == 0
    relaxed = read(output, ":")
    assert len(relaxed) == 50
    for index, (original, atoms) in enumerate(zip(inputs, relaxed, strict=True)):
        assert atoms.info["source"].endswith(f"in.extxyz@{index}")
        assert len(atoms) == len(original)
        np.testing.assert_array_equal(atoms.pbc, original.pbc)
        assert atoms.info["converged"]
        assert np.isfinite(atoms.get_potential_energy())
        assert np.linalg.norm(atoms.get_forces(), axis=1).max() < 0.02
    trajectories = sorted((tmp_path / "traj").glob("*.traj"))
    assert len(trajectories) == 50
    printed = subprocess.run(
        [
            sys.executable,
            "-m",
            "ase",
            "gui",
            "-t",
            "-g",
            "i, e, fmax",
            str(trajectories[7]),
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\n")
    rows = [line.split() for line in printed if line.strip()]
    frames = read(trajectories[7], ":")
    assert len(rows) == len(frames)
    assert float(rows[-1][1]) == pytest.approx(
        frames[-1].get_potential_energy(), abs=1e-6
    )


def test_calc_writes_results_and_a_table(tmp_path, capsys, lj_calc64):
    inputs = mixed_argon(6)
    write(tmp_path / "in.extxyz", inputs)
    output = tmp_path / "out.extxyz"
    assert (
        main(
            [
                "calc",
                str(tmp_path / "in.*"),
                "-o",
                str(output),
                "--model",
                "lj",
                "--dtype",
                "float64",
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    table = capsys.readouterr().out
    assert table.count("in.extxyz@") == 6
    frames = read(output, ":")
    expected = lj_calc64.calculate_batch(inputs, ["energy", "forces"])
    extxyz_digits = 1e-7  # extxyz stores 8 decimals
    for frame, result in zip(frames, expected, strict=True):
        assert frame.get_potential_energy() == pytest.approx(result["energy"], abs=1e-9)
        np.testing.assert_allclose(
            frame.get_forces(), result["forces"], atol=extxyz_digits
        )
    assert "stress" in frames[0].calc.results
    assert "stress" not in frames[3].calc.results  # the cluster has no cell


def test_md_writes_trajectories_log_plot_and_final_frames(tmp_path):
    write(tmp_path / "in.extxyz", mixed_argon(4)[:1] * 3)
    out = tmp_path / "md"
    assert (
        main(
            [
                "md",
                str(tmp_path / "in.extxyz"),
                "--ensemble",
                "nvt",
                "--temperature",
                "40",
                "--steps",
                "20",
                "--interval",
                "5",
                "-o",
                str(out),
                "--plot",
                *LJ,
            ]
        )
        == 0
    )
    assert len(read(out / "md_00001.traj", ":")) == 5
    assert len(read(out / "final.extxyz", ":")) == 3
    assert (out / "md.log").read_text().count("\n") == 6
    assert (out / "md.png").stat().st_size > 10_000


def _error_of(capsys, argv):
    code = main(argv)
    err = capsys.readouterr().err
    return code, err


def test_bad_inputs_give_one_line_errors(tmp_path, capsys):
    (tmp_path / "junk.extxyz").write_text("this is not a structure file\n")
    nan = bulk("Ar", "fcc", a=5.26, cubic=True)
    nan.positions[2, 0] = np.nan
    write(tmp_path / "good_and_nan.extxyz", [bulk("Ar", "fcc", a=5.26), nan])
    cases = [
        (
            ["calc", str(tmp_path / "missing.xyz"), "--model", "lj"],
            "missing.xyz: no such file",
        ),
        (
            ["calc", str(tmp_path / "junk.extxyz"), "--model", "lj"],
            "junk.extxyz: cannot read it",
        ),
        (
            ["calc", str(tmp_path / "good_and_nan.extxyz"), "--model", "nonsense"],
            "unknown model 'nonsense'",
        ),
        (
            ["relax", str(tmp_path / "good_and_nan.extxyz"), "--model", "lj"],
            "good_and_nan.extxyz@1: positions[2] is not finite",
        ),
    ]
    for argv, expected in cases:
        code, err = _error_of(capsys, argv)
        assert code == 2, argv
        assert expected in err, err
        assert err.count("\n") == 1
        assert "Traceback" not in err
    with pytest.raises(SystemExit) as exit_info:
        main(["md", str(tmp_path / "good_and_nan.extxyz"), "--steps", "-5"])
    assert exit_info.value.code == 2
    assert "must be a positive integer" in capsys.readouterr().err


def test_debug_shows_the_traceback(tmp_path):
    from nvalchemi_ase.cli.common import CommandError

    with pytest.raises(CommandError, match="no such file"):
        main(["calc", str(tmp_path / "missing.xyz"), "--model", "lj", "--debug"])


def test_partial_results_stay_on_disk_after_a_failure(tmp_path, capsys, monkeypatch):
    from nvalchemi_ase.optimize import FIRE

    write(tmp_path / "in.extxyz", mixed_argon(12))
    steps = []
    original = FIRE._advance

    def failing_later(self):
        steps.append(1)
        if len(steps) == 12:
            raise RuntimeError("simulated failure")
        return original(self)

    monkeypatch.setattr(FIRE, "_advance", failing_later)
    output = tmp_path / "relaxed.extxyz"
    argv = ["relax", str(tmp_path / "in.extxyz"), "-o", str(output), "--fmax", "0.01"]
    code, err = _error_of(capsys, [*argv, "--batch-size", "3", *LJ])
    assert code == 2
    assert "simulated failure" in err
    # results stay under the staged name until the run completes
    kept = read(tmp_path / "relaxed.partial.extxyz", ":")
    assert 0 < len(kept) < 12
    assert not output.exists()

    monkeypatch.setattr(FIRE, "_advance", original)
    code, err = _error_of(capsys, [*argv, "--batch-size", "3", "--resume", *LJ])
    assert code == 0, err
    relaxed = read(output, ":")
    assert [int(a.info["index"]) for a in relaxed] == list(range(12))
    assert all(a.info["converged"] for a in relaxed)
    by_index = {int(a.info["index"]): a for a in relaxed}
    for atoms in kept:  # kept, not computed again
        again = by_index[int(atoms.info["index"])]
        assert np.array_equal(again.positions, atoms.positions)
    assert not (tmp_path / "relaxed.partial.extxyz").exists()


@pytest.mark.slow  # two fresh interpreters
def test_help_is_fast_and_names_units():
    result = subprocess.run(
        [sys.executable, "-m", "nvalchemi_ase", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "eV/Å" in result.stdout
    for command in ("calc", "relax", "md", "demo"):
        assert command in result.stdout
    relax_help = subprocess.run(
        [sys.executable, "-m", "nvalchemi_ase", "relax", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "eV/Å" in relax_help
    assert "default: 0.05" in relax_help


@pytest.mark.slow
def test_demo_runs_and_writes_plots(tmp_path, capsys):
    out = tmp_path / "demo"
    assert (
        main(
            [
                "demo",
                "--model",
                "lj",
                "--device",
                "cpu",
                "--quiet",
                "-o",
                str(out),
                "--md-steps",
                "20",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "single points (one batched call" in text
    assert "converged" in text
    for name in ("relax.png", "md.png"):
        assert (out / name).stat().st_size > 10_000
    assert len(read(out / "relaxed.extxyz", ":")) == 3


def test_command_line_lets_waiting_openmp_threads_sleep(monkeypatch):
    import torch  # noqa: F401 - loaded, as in any process that computed something

    from nvalchemi_ase.cli import main as cli_main

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    cli_main._prefer_passive_openmp()  # torch is imported: too late, left alone
    assert "OMP_WAIT_POLICY" not in os.environ
    monkeypatch.delitem(sys.modules, "torch")
    cli_main._prefer_passive_openmp()
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # the user's choice wins
    cli_main._prefer_passive_openmp()
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"


def test_relax_cell_with_bfgs_gives_ases_cells(tmp_path, lj_calc64):
    from ase.filters import FrechetCellFilter
    from ase.optimize import BFGS as AseBFGS

    from nvalchemi_ase import NVAlchemiCalculator

    inputs = [bulk("Ar", "fcc", a=5.1), bulk("Ar", "fcc", a=5.5, cubic=True)]
    for atoms in inputs:
        atoms.rattle(0.02, seed=1)
    write(tmp_path / "in.extxyz", inputs)
    output = tmp_path / "relaxed.extxyz"
    arguments = ["relax", str(tmp_path / "in.extxyz"), "-o", str(output)]
    code = main([*arguments, "--cell", "--optimizer", "BFGS", "--fmax", "0.01", *LJ])
    assert code == 0
    for atoms, relaxed in zip(inputs, read(output, ":"), strict=True):
        atoms.calc = NVAlchemiCalculator(lj_calc64.model, device="cpu", dtype="float64")
        AseBFGS(FrechetCellFilter(atoms), logfile=None).run(fmax=0.01, steps=1000)
        np.testing.assert_allclose(relaxed.cell.array, atoms.cell.array, atol=1e-8)
        np.testing.assert_allclose(relaxed.positions, atoms.positions, atol=1e-8)
