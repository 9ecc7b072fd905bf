"""The command line never loses or destroys data, and sizes batches from memory."""

from __future__ import annotations

import argparse
import csv

import numpy as np
import pytest
import torch
from ase import Atoms, units
from ase.build import bulk, fcc111, molecule
from ase.io import read, write
from ase.neighborlist import neighbor_list

from nvalchemi_ase import NVAlchemiCalculator
from nvalchemi_ase.cli.main import main
from nvalchemi_ase.models import memory

LJ = ["--model", "lj", "--dtype", "float64", "--device", "cpu", "--quiet"]


def argon(repeat: int, seed: int) -> Atoms:
    """Rattled fcc argon: 4 atoms per repeat³."""
    atoms = bulk("Ar", "fcc", a=5.26, cubic=True).repeat(repeat)
    atoms.rattle(0.04, seed=seed)
    return atoms


def _run(capsys, argv):
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _one_line(err: str) -> str:
    assert err.count("\n") == 1, err
    assert "Traceback" not in err
    return err


# -- results belong to their own structure ---------------------------------------


def test_md_final_frames_carry_each_structures_own_results(tmp_path, capsys):
    inputs = [argon(2, 0), argon(1, 1), argon(3, 2)]  # 32, 4 and 108 atoms
    write(tmp_path / "in.extxyz", inputs)
    out = tmp_path / "md"
    argv = ["md", str(tmp_path / "in.extxyz"), "-o", str(out), "--steps", "6"]
    code, _, err = _run(capsys, [*argv, "--temperature", "30", "--interval", "3", *LJ])
    assert code == 0, err
    frames = read(out / "final.extxyz", ":")
    assert [len(f) for f in frames] == [32, 4, 108]
    single = NVAlchemiCalculator("lj", device="cpu", dtype="float64")
    for index, frame in enumerate(frames):
        assert frame.info["source"].endswith(f"in.extxyz@{index}")
        alone = frame.copy()
        alone.calc = single
        assert frame.get_potential_energy() == pytest.approx(
            alone.get_potential_energy(), abs=1e-6
        )
        np.testing.assert_allclose(frame.get_forces(), alone.get_forces(), atol=1e-6)
        np.testing.assert_allclose(frame.get_stress(), alone.get_stress(), atol=1e-8)
    energies = [f.get_potential_energy() for f in frames]
    assert len(set(np.round(energies, 6))) == 3


# -- one structure failing costs that structure only ------------------------------


def _nan_forces_for(monkeypatch, natoms: int) -> None:
    """Every LJ evaluation gives NaN forces to the structures of ``natoms`` atoms."""
    from nvalchemi_ase._quiet import import_quietly

    wrapper = import_quietly("nvalchemi.models.lj").LennardJonesModelWrapper
    original = wrapper.forward

    def forward(self, batch, *args, **kwargs):
        outputs = original(self, batch, *args, **kwargs)
        counts = batch.num_nodes_per_graph
        rows = counts[batch.batch_idx.long()] == natoms
        forces = outputs["forces"].clone()
        forces[rows] = float("nan")
        outputs["forces"] = forces
        return outputs

    monkeypatch.setattr(wrapper, "forward", forward)


def test_relax_keeps_the_batch_when_one_structure_diverges(
    tmp_path, capsys, monkeypatch
):
    # optimizers take ASE's steps whatever the force (a close pair is pushed
    # apart, as ASE's FIRE does), so the diverging structure here is one whose
    # forces the model returns non-finite: the 5-atom cell
    inputs = [argon(2, 0), argon(1, 1), argon(1, 2), argon(1, 3)]
    bad = inputs[2]
    bad.append("Ar")
    bad.positions[-1] = bad.cell.sum(axis=0) * 0.5 + [0.3, 0.2, 0.1]
    write(tmp_path / "in.extxyz", inputs)
    output = tmp_path / "relaxed.extxyz"
    _nan_forces_for(monkeypatch, len(bad))
    code, _, err = _run(
        capsys, ["relax", str(tmp_path / "in.extxyz"), "-o", str(output), *LJ]
    )
    assert code == 1, err
    relaxed = read(output, ":")
    assert [a.info["source"].rsplit("@", 1)[1] for a in relaxed] == ["0", "1", "3"]
    assert all(a.info["converged"] for a in relaxed)
    (failed,) = read(tmp_path / "relaxed.failed.extxyz", ":")
    assert failed.info["source"].endswith("in.extxyz@2")
    assert np.isfinite(failed.positions).all()
    with open(tmp_path / "relaxed.failures.csv", newline="") as handle:
        (row,) = list(csv.DictReader(handle))
    assert row["input_file"].endswith("in.extxyz")
    assert (row["frame"], row["step"]) == ("2", "0")
    assert "force" in row["reason"]
    assert "in.extxyz@2 failed at step 0" in _one_line(err)
    assert "images[" not in err


def test_md_keeps_the_batch_when_one_structure_explodes(tmp_path, capsys):
    inputs = [argon(2, 0), argon(2, 1), argon(2, 2)]
    for atoms in inputs:
        atoms.set_momenta(np.zeros((len(atoms), 3)))
    towards = inputs[1].positions[1] - inputs[1].positions[0]
    speed = 4.0 / units.fs  # 4 Å/fs: far beyond any physical step
    momenta = inputs[1].get_momenta()
    momenta[0] = inputs[1].get_masses()[0] * speed * towards / np.linalg.norm(towards)
    inputs[1].set_momenta(momenta)
    write(tmp_path / "in.extxyz", inputs)
    out = tmp_path / "md"
    code, _, err = _run(
        capsys,
        [
            "md",
            str(tmp_path / "in.extxyz"),
            "-o",
            str(out),
            "--ensemble",
            "nve",
            "--steps",
            "5",
            "--interval",
            "1",
            *LJ,
        ],
    )
    assert code == 1, err
    final = read(out / "final.extxyz", ":")
    assert [a.info["source"].rsplit("@", 1)[1] for a in final] == ["0", "2"]
    (failed,) = read(out / "failed.extxyz", ":")
    assert failed.info["source"].endswith("in.extxyz@1")
    assert np.isfinite(failed.positions).all()
    with open(out / "failures.csv", newline="") as handle:
        (row,) = list(csv.DictReader(handle))
    assert row["frame"] == "1"
    assert "in.extxyz@1 failed at step" in _one_line(err)


def test_an_error_inside_a_batch_names_input_frames(tmp_path, capsys, monkeypatch):
    from nvalchemi_ase.optimize import FIRE

    write(tmp_path / "in.extxyz", [argon(1, k) for k in range(4)])
    original = FIRE._advance
    steps = []

    def failing(self):
        steps.append(1)
        if len(steps) == 2:
            raise RuntimeError("FIRE, step 2: something broke in images[1]")
        return original(self)

    monkeypatch.setattr(FIRE, "_advance", failing)
    output = tmp_path / "relaxed.extxyz"
    code, _, err = _run(
        capsys,
        [
            "relax",
            str(tmp_path / "in.extxyz"),
            "-o",
            str(output),
            "--fmax",
            "1e-4",
            "--batch-size",
            "2",
            *LJ,
        ],
    )
    assert code == 2
    err = _one_line(err)
    assert "in a batch of 2 structures, 8 atoms (" in err
    assert "in.extxyz@0, " in err
    assert "something broke in " in err
    assert "something broke in images[1]" not in err
    assert err.count("in.extxyz@1") == 2  # in the batch, and as images[1]
    assert "relaxed.partial.extxyz" not in err  # nothing finished yet
    assert "no results were written" in err
    assert not output.exists()


def test_frame_labels_are_frames_of_the_file_for_slices(tmp_path):
    from nvalchemi_ase.cli.common import read_sources

    write(tmp_path / "in.extxyz", [argon(1, k) for k in range(5)])
    labels = [s.label for s in read_sources([f"{tmp_path / 'in.extxyz'}@2:"])]
    assert [label.rsplit("@", 1)[1] for label in labels] == ["2", "3", "4"]
    labels = [s.label for s in read_sources([f"{tmp_path / 'in.extxyz'}@-2"])]
    assert labels[0].endswith("@3")


# -- outputs: never the input, never silently replaced -----------------------------


def test_an_output_that_is_an_input_is_refused_before_any_work(
    tmp_path, capsys, monkeypatch
):
    import nvalchemi_ase.cli.common as common

    def no_work(args):
        raise AssertionError("the model was built")

    monkeypatch.setattr(common, "build_calculator", no_work)
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "in.extxyz", [argon(1, 0), argon(1, 1)])
    (tmp_path / "sub").mkdir()
    (tmp_path / "md").mkdir()
    write(tmp_path / "md" / "final.extxyz", [argon(1, 2)])
    before = {p: p.read_bytes() for p in tmp_path.rglob("*.extxyz")}
    cases = [
        ["relax", "in.extxyz", "-o", "in.extxyz"],
        ["relax", "in.extxyz@1", "-o", str(tmp_path / "sub" / ".." / "in.extxyz")],
        ["calc", "in*", "-o", "./in.extxyz"],
        ["md", "md/final.extxyz", "-o", "md"],
    ]
    for argv in cases:
        code, _, err = _run(capsys, [*argv, *LJ])
        assert code == 2, argv
        assert "is the input" in _one_line(err)
    assert {p: p.read_bytes() for p in tmp_path.rglob("*.extxyz")} == before


def test_a_rerun_never_destroys_earlier_results(tmp_path, capsys, monkeypatch):
    write(tmp_path / "in.extxyz", [argon(1, k) for k in range(4)])
    output = tmp_path / "calc.extxyz"
    argv = ["calc", str(tmp_path / "in.extxyz"), "-o", str(output), *LJ]
    assert _run(capsys, argv)[0] == 0
    first = output.read_bytes()

    code, _, err = _run(capsys, argv)  # same command again: refused
    assert code == 2
    assert "exists" in _one_line(err)
    assert "--overwrite" in err
    assert output.read_bytes() == first

    calls = []
    original = NVAlchemiCalculator.calculate_batch

    def failing_second(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("simulated failure")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(NVAlchemiCalculator, "calculate_batch", failing_second)
    code, _, err = _run(capsys, [*argv, "--overwrite", "--batch-size", "2"])
    assert code == 2
    assert "calc.partial.extxyz" in _one_line(err)
    assert output.read_bytes() == first  # the earlier output survives
    assert len(read(tmp_path / "calc.partial.extxyz", ":")) == 2

    output.rename(tmp_path / "kept.extxyz")
    code, _, err = _run(capsys, argv)  # the partial results are not discarded
    assert code == 2
    assert "interrupted run" in _one_line(err)
    assert len(read(tmp_path / "calc.partial.extxyz", ":")) == 2

    monkeypatch.setattr(NVAlchemiCalculator, "calculate_batch", original)
    assert _run(capsys, [*argv, "--overwrite", "--batch-size", "3"])[0] == 0
    assert len(read(output, ":")) == 4
    assert not (tmp_path / "calc.partial.extxyz").exists()


def test_ctrl_c_prints_one_line_and_exits_130(tmp_path, capsys, monkeypatch):
    from nvalchemi_ase.optimize import FIRE

    write(tmp_path / "in.extxyz", [argon(1, k) for k in range(4)])
    original = FIRE._advance
    steps = []

    def interrupted_later(self):
        steps.append(1)
        if len(steps) == 3:
            raise KeyboardInterrupt
        return original(self)

    monkeypatch.setattr(FIRE, "_advance", interrupted_later)
    output = tmp_path / "relaxed.extxyz"
    argv = ["relax", str(tmp_path / "in.extxyz"), "-o", str(output), *LJ]
    code, _, err = _run(capsys, [*argv, "--batch-size", "1"])
    assert code == 130
    err = _one_line(err)
    finished = len(read(tmp_path / "relaxed.partial.extxyz", ":"))
    assert 0 < finished < 4
    assert f"interrupted; {finished} of 4 structures finished" in err
    assert "relaxed.partial.extxyz" in err
    assert "--resume" in err
    assert not output.exists()

    monkeypatch.setattr(FIRE, "_advance", original)
    code, _, err = _run(capsys, [*argv, "--batch-size", "1"])  # no silent restart
    assert code == 2
    assert "--resume" in _one_line(err)
    code, _, err = _run(capsys, [*argv, "--batch-size", "1", "--resume"])
    assert code == 0, err
    assert [int(a.info["index"]) for a in read(output, ":")] == [0, 1, 2, 3]


def test_ctrl_c_before_any_batch_is_one_line_too(tmp_path, capsys, monkeypatch):
    import nvalchemi_ase.cli.common as common

    def interrupt(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(common, "build_calculator", interrupt)
    write(tmp_path / "in.extxyz", [argon(1, 0)])
    code, _, err = _run(
        capsys, ["calc", str(tmp_path / "in.extxyz"), "-o", str(tmp_path / "o.xyz")]
    )
    assert code == 130
    assert "interrupted" in _one_line(err)


# -- memory -------------------------------------------------------------------------


def test_batches_from_memory_stay_below_the_available_memory(
    tmp_path, capsys, monkeypatch, lj_calc64
):
    from nvalchemi_ase.cli.batching import budget_for

    args = argparse.Namespace(batch_size=None, max_atoms=None)
    budget = budget_for(args, lj_calc64)
    available = memory.available_memory("cpu")
    assert budget.max_bytes is not None
    assert 0 < budget.max_bytes < available
    assert budget.max_structures == 512

    images = [argon(r, k) for k, r in enumerate([1, 2, 3, 2, 1, 3, 2])]
    write(tmp_path / "in.extxyz", images)
    estimate = memory.memory_estimate(lj_calc64.model, torch.float64, "cpu")
    small = 2.5 * estimate.bytes_for(108, 0)  # budget: one 108-atom structure
    monkeypatch.setattr(memory, "available_memory", lambda device: int(small))
    batches = []
    original = NVAlchemiCalculator.calculate_batch

    def recording(self, images, *args, **kwargs):
        batches.append([len(atoms) for atoms in images])
        return original(self, images, *args, **kwargs)

    monkeypatch.setattr(NVAlchemiCalculator, "calculate_batch", recording)
    output = tmp_path / "calc.extxyz"
    code, _, err = _run(
        capsys, ["calc", str(tmp_path / "in.extxyz"), "-o", str(output), *LJ]
    )
    assert code == 0, err
    assert batches == [[4, 32], [108], [32, 4], [108], [32]]
    assert all(estimate.bytes_for(sum(b), 0) <= 0.5 * small for b in batches)
    order = [int(a.info["index"]) for a in read(output, ":")]
    assert order == list(range(len(images)))


def test_a_structure_too_large_for_memory_is_refused_before_any_model_call(
    tmp_path, capsys, monkeypatch
):
    def no_model(self, *args, **kwargs):
        raise AssertionError("the model was called")

    monkeypatch.setattr(NVAlchemiCalculator, "_run_model", no_model)
    monkeypatch.setattr(memory, "available_memory", lambda device: 2_000_000)
    write(tmp_path / "in.extxyz", [argon(1, 0), argon(3, 1)])
    for command in ("calc", "relax", "md"):
        code, _, err = _run(
            capsys,
            [command, str(tmp_path / "in.extxyz"), "-o", str(tmp_path / command), *LJ],
        )
        assert code == 2, command
        err = _one_line(err)
        assert "in.extxyz@1 (108 atoms) needs about 3.1 MB" in err
        assert "2.0 MB available" in err
        assert "--max-atoms" in err
    # --max-atoms replaces the memory rule
    with pytest.raises(AssertionError, match="the model was called"):
        main(
            [
                "calc",
                str(tmp_path / "in.extxyz"),
                "-o",
                str(tmp_path / "x.extxyz"),
                "--max-atoms",
                "200",
                *LJ,
            ]
        )


@pytest.mark.parametrize(
    "error",
    [
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        RuntimeError("[enforce fail] DefaultCPUAllocator: can't allocate memory"),
        RuntimeError("Warp: Failed to allocate 4294967296 bytes on device 'cuda:0'"),
    ],
)
def test_out_of_memory_names_the_batch_and_suggests_max_atoms(
    tmp_path, capsys, monkeypatch, error
):
    write(tmp_path / "in.extxyz", [argon(2, 0), argon(1, 1), argon(2, 2), argon(1, 3)])

    def out_of_memory(self, *args, **kwargs):
        raise error

    monkeypatch.setattr(NVAlchemiCalculator, "calculate_batch", out_of_memory)
    code, _, err = _run(
        capsys,
        ["calc", str(tmp_path / "in.extxyz"), "-o", str(tmp_path / "o.extxyz"), *LJ],
    )
    assert code == 2
    err = _one_line(err)
    assert "out of memory on cpu in a batch of 4 structures, 72 atoms (" in err
    assert "in.extxyz@0, " in err
    assert "in.extxyz@2 and 1 more)" in err
    assert "rerun with --max-atoms 36" in err


def test_count_edges_matches_a_full_neighbour_list():
    slab = fcc111("Cu", size=(3, 3, 4), vacuum=None)
    slab.pbc = (True, True, False)
    for atoms, cutoff in [
        (bulk("Si", "diamond", a=5.43, cubic=True).repeat(2), 5.0),
        (bulk("Ar", "fcc", a=5.26), 8.5),  # cell much smaller than the cutoff
        (slab, 5.0),
        (molecule("CH3CH2OH"), 3.0),
    ]:
        assert memory.count_edges(atoms, cutoff) == len(
            neighbor_list("i", atoms, cutoff)
        )
    assert memory.count_edges(molecule("H2O"), None) == 0.0
    big = argon(6, 0)  # 864 atoms: sampled
    exact = len(neighbor_list("i", big, 8.5))
    assert memory.count_edges(big, 8.5) == pytest.approx(exact, rel=0.05)


def test_memory_estimates_measured_declared_and_default(lj_calc64):
    lj = memory.memory_estimate(lj_calc64.model, torch.float64, "cpu")
    assert lj.basis.startswith("measured")
    assert lj.cutoff == 8.5
    assert 20e3 < lj.bytes_for(1, 0) < 40e3  # bytes per atom, 9.5 Å list
    assert lj.atoms_within(10 * lj.bytes_per_atom) == 10
    lj32 = memory.memory_estimate(lj_calc64.model, torch.float32, "cpu")
    assert lj32.bytes_per_atom == lj.bytes_per_atom  # never scaled down

    class Unknown:
        pass

    default = memory.memory_estimate(Unknown(), torch.float64, "cpu")
    assert default.bytes_per_edge == 2 * memory.DEFAULT_ESTIMATE.bytes_per_edge
    assert default.cutoff is None

    declared = Unknown()
    declared.memory_estimate = memory.MemoryEstimate(1e3, 2e3)
    assert memory.memory_estimate(declared, torch.float32, "cpu").bytes_for(2, 3) == 8e3
    declared.memory_estimate = lambda dtype, device: memory.MemoryEstimate(
        5.0, 0.0, basis=f"{dtype} {device}"
    )
    assert memory.memory_estimate(declared, torch.float32, "cpu").basis == (
        "torch.float32 cpu"
    )
    declared.memory_estimate = 12
    with pytest.raises(TypeError, match="MemoryEstimate"):
        memory.memory_estimate(declared, torch.float32, "cpu")


def test_available_memory_reads_the_host():
    free = memory.available_memory("cpu")
    with open("/proc/meminfo") as handle:
        total = int(
            next(line for line in handle if line.startswith("MemTotal")).split()[1]
        )
    assert 0 < free <= total * 1024


def test_help_names_memory_defaults_and_overwrite(capsys):
    for command in ("calc", "relax", "md"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "default: from memory" in text
        assert "--overwrite" in text
        assert ".partial." in text
