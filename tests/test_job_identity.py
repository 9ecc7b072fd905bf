"""Job identity: resume and restart continue only the job that wrote the files.

Every case of the adversarial battery that got another job's results back
(outputs of other inputs, fewer inputs, another model, checkpoints of another
model or of other cells) is refused here with a message naming the structure,
the field and how to start afresh; an unchanged job resumes exactly as before.
The digests are checked against their own definition: a structure hashed
alone or within a chunk gives the same digest, and changing one field of one
structure changes that field's digest only.
"""

from __future__ import annotations

import io
import itertools
import json
import zipfile
from pathlib import Path

import numpy as np
import pytest
from ase.build import bulk
from ase.constraints import FixAtoms
from ase.io import read

from nvalchemi_ase import NVAlchemiCalculator
from nvalchemi_ase.cli.main import main
from nvalchemi_ase.dynamics.checkpoint import CheckpointError, read_checkpoint
from nvalchemi_ase.identity import (
    MD_FIELDS,
    STRUCTURE_FIELDS,
    JobMismatchError,
    decode,
    encode,
    model_digest,
    structure_digests,
)
from nvalchemi_ase.md import VelocityVerlet
from nvalchemi_ase.models.builtin import lennard_jones
from nvalchemi_ase.runners import (
    RunStopped,
    irelax,
    md,
    read_results,
    relax,
    single_points,
)
from nvalchemi_ase.runners.files import scan_frames
from tests.structures import mixed

LJ64 = {"device": "cpu", "dtype": "float64"}
CLI_LJ = ["--model", "lj", "--dtype", "float64", "--device", "cpu", "--quiet"]


@pytest.fixture(scope="module")
def calc():
    return NVAlchemiCalculator("lj", **LJ64)


def _argon(count: int, a: float = 5.26, seed: int = 0, stdev: float = 0.05) -> list:
    """Argon cells of 4-12 atoms (different sizes), rattled."""
    images = []
    for index in range(count):
        atoms = bulk("Ar", "fcc", a=a, cubic=True) * (1, 1, 1 + index % 3)
        atoms.rattle(stdev, seed=seed + index)
        images.append(atoms)
    return images


def _stop_after(calls: int):
    asked = itertools.count(1)
    return lambda: next(asked) == calls


# ----------------------------------------------------------------------------
# The digests
# ----------------------------------------------------------------------------


def test_digest_of_a_structure_does_not_depend_on_its_chunk():
    images = mixed(12, seed=3, largest=20)
    images[1].set_constraint(FixAtoms([0]))
    images[2].info["charge"] = 1
    together = structure_digests(images, MD_FIELDS)
    alone = np.concatenate([structure_digests([a], MD_FIELDS) for a in images])
    np.testing.assert_array_equal(together, alone)
    assert len({tuple(row) for row in together.tolist()}) == len(images)
    np.testing.assert_array_equal(decode(encode(together[3])), together[3])


@pytest.mark.parametrize(
    ("field", "change"),
    [
        ("atomic_numbers", lambda a: a.numbers.__setitem__(0, 8)),
        (
            "positions",
            lambda a: a.positions.__setitem__((1, 2), a.positions[1, 2] + 1e-12),
        ),
        ("cell", lambda a: a.set_cell(a.cell.array * 1.05)),
        ("pbc", lambda a: a.set_pbc((True, True, False))),
        ("charges", lambda a: a.set_initial_charges(np.full(len(a), 0.1))),
        ("charge_spin", lambda a: a.info.__setitem__("spin", 2)),
        ("constraints", lambda a: a.set_constraint(FixAtoms([1]))),
        ("momenta", lambda a: a.set_momenta(np.ones((len(a), 3)))),
        ("masses", lambda a: a.set_masses(np.full(len(a), 2.0))),
    ],
)
def test_changing_one_field_changes_that_digest_only(field, change):
    images = _argon(3)
    before = structure_digests(images, MD_FIELDS)
    change(images[1])
    after = structure_digests(images, MD_FIELDS)
    changed = np.argwhere(before != after)
    expected = {field} | ({"masses"} if field == "atomic_numbers" else set())
    assert sorted(changed.tolist()) == sorted(
        [1, MD_FIELDS.index(name)] for name in expected
    )  # another element has other default masses


def test_model_digest_tells_parameters_weights_and_dtype_apart():
    argon, other = lennard_jones(), lennard_jones(epsilon=0.02)
    assert model_digest(argon, "float64") == model_digest(lennard_jones(), "float64")
    assert model_digest(argon, "float64") != model_digest(other, "float64")
    assert model_digest(argon, "float64") != model_digest(argon, "float32")


# ----------------------------------------------------------------------------
# Runner outputs (resume=True)
# ----------------------------------------------------------------------------


def test_unchanged_single_points_resume_to_the_same_numbers(tmp_path, calc):
    images = _argon(10)
    output = tmp_path / "out.extxyz"
    first = single_points(images, calc, output=output)
    text = output.read_bytes()
    again = single_points(images, calc, output=output, resume=True)
    assert output.read_bytes() == text  # nothing written twice
    for a, b in zip(read_results(output), again, strict=True):  # read back
        assert a.get_potential_energy() == b.get_potential_energy()
        np.testing.assert_array_equal(a.get_forces(), b.get_forces())
    for a, b in zip(first, again, strict=True):  # to the file's digits
        assert a.get_potential_energy() == b.get_potential_energy()
        np.testing.assert_allclose(a.get_forces(), b.get_forces(), atol=1e-8)


def test_resume_on_the_output_of_other_inputs_is_refused(tmp_path, calc):
    output = tmp_path / "out.extxyz"
    single_points(_argon(10), calc, output=output)
    text = output.read_bytes()
    with pytest.raises(
        JobMismatchError, match=r"input 0 .*'positions'.*another output"
    ):
        single_points(_argon(10, seed=100), calc, output=output, resume=True)
    assert output.read_bytes() == text


def test_one_changed_structure_is_named_by_index(tmp_path, calc):
    images = _argon(10)
    output = tmp_path / "out.extxyz"
    single_points(images, calc, output=output)
    images[7] = images[7].copy()
    images[7].set_cell(images[7].cell.array * 1.05, scale_atoms=True)
    with pytest.raises(
        JobMismatchError, match=r"input 7 .*inputs\[7\].*'cell'"
    ) as info:
        single_points(images, calc, output=output, resume=True)
    assert (info.value.index, info.value.field) == (7, "positions")


def test_fewer_inputs_than_the_output_holds_return_only_theirs(tmp_path, calc):
    output = tmp_path / "out.extxyz"
    full = single_points(_argon(10), calc, output=output)
    fewer = single_points(_argon(6), calc, output=output, resume=True)
    assert [int(a.info["index"]) for a in fewer] == list(range(6))
    for a, b in zip(fewer, full[:6], strict=True):
        assert a.get_potential_energy() == b.get_potential_energy()


def test_resume_with_another_model_is_refused(tmp_path, calc):
    output = tmp_path / "out.extxyz"
    single_points(_argon(3), calc, output=output)  # epsilon 0.0104
    other = NVAlchemiCalculator(lennard_jones(epsilon=0.02), **LJ64)
    with pytest.raises(JobMismatchError, match=r"another model .*parameters") as info:
        single_points(_argon(6), other, output=output, resume=True)
    assert info.value.field == "model"


def test_relaxation_resume_with_other_parameters_is_refused(tmp_path, calc):
    output = tmp_path / "relaxed.extxyz"
    relax(_argon(4), calc, fmax=0.05, output=output)
    with pytest.raises(JobMismatchError, match=r"another run .*fmax"):
        relax(_argon(4), calc, fmax=0.01, output=output, resume=True)
    finished = relax(_argon(4), calc, fmax=0.05, output=output, resume=True)
    assert len(finished) == 4  # the finished job again: nothing to compute


def test_md_resume_with_other_inputs_is_refused(tmp_path, calc):
    output = tmp_path / "md.extxyz"
    settings = {"dynamics": "VelocityVerlet", "timestep": 2.0, "steps": 3}
    md(_argon(3), calc, output=output, **settings)
    with pytest.raises(JobMismatchError, match=r"input 0 .*'cell'"):
        md(_argon(3, a=5.5), calc, output=output, resume=True, **settings)


def test_damaged_frame_in_the_middle_is_recomputed_alone(tmp_path, calc):
    images = _argon(6)
    reference = single_points(images, calc)
    output = tmp_path / "out.extxyz"
    single_points(images, calc, output=output)
    spans = scan_frames(output).spans
    start = spans[2][0]
    text = output.read_bytes()
    damaged = text[:start] + b"garbage\n" + text[start + 5 :]  # frame 2's header
    output.write_bytes(damaged)
    with pytest.warns(UserWarning, match=r"frame 2 .*damaged"):
        again = single_points(images, calc, output=output, resume=True)
    for a, b in zip(again, reference, strict=True):
        assert a.get_potential_energy() == pytest.approx(
            b.get_potential_energy(), rel=1e-12
        )
    frames = scan_frames(output)
    assert sorted(frames.indices) == list(range(6))
    assert frames.indices[:5] == [0, 1, 3, 4, 5]  # later frames kept, not redone
    assert (tmp_path / "out.extxyz.damaged").exists()


# ----------------------------------------------------------------------------
# Checkpoints (restart=)
# ----------------------------------------------------------------------------


def test_restart_with_another_model_is_refused(tmp_path, calc):
    path = tmp_path / "vv.npz"
    images = _argon(3)
    for atoms in images:
        atoms.calc = calc
    VelocityVerlet(images, 2.0, restart=path).run(4)
    other = _argon(3)
    model = lennard_jones(epsilon=0.02)
    with pytest.raises(CheckpointError, match=r"'model' \(parameters\)"):
        VelocityVerlet(other, 2.0, restart=path, model=model, **LJ64)
    same = _argon(3)
    for atoms in same:
        atoms.calc = calc
    assert VelocityVerlet(same, 2.0, restart=path).nsteps == 4


def test_restart_with_larger_cells_is_refused(tmp_path, calc):
    path = tmp_path / "vv.npz"
    images = _argon(3)
    for atoms in images:
        atoms.calc = calc
    VelocityVerlet(images, 2.0, restart=path).run(4)
    larger = _argon(3)
    larger[1].set_cell(larger[1].cell.array * 1.05, scale_atoms=True)
    for atoms in larger:
        atoms.calc = calc
    with pytest.raises(CheckpointError, match=r"images\[1\] .*'positions', 'cell'"):
        VelocityVerlet(larger, 2.0, restart=path)


def test_runner_md_restart_with_other_inputs_is_refused(tmp_path, calc):
    settings = {
        "dynamics": "VelocityVerlet",
        "timestep": 2.0,
        "steps": 20,
        "output": tmp_path / "md.extxyz",
        "restart": tmp_path / "md.npz",
        "restart_interval": 2,
    }
    with pytest.raises(RunStopped):
        md(_argon(3), calc, stop=_stop_after(5), **settings)
    assert (tmp_path / "md.npz").exists()
    with pytest.raises(CheckpointError, match=r"images\[0\] .*'cell'"):
        md(_argon(3, a=5.5), calc, **settings)
    finished = md(_argon(3), calc, **settings)  # the same inputs continue
    assert len(finished) == 3


def test_runner_relax_restart_with_larger_cells_is_refused(tmp_path, calc):
    settings = {
        "fmax": 0.005,
        "steps": 200,
        "output": tmp_path / "relaxed.extxyz",
        "restart": tmp_path / "relax.npz",
        "restart_interval": 2,
    }
    images = _argon(4, stdev=0.1)
    with pytest.raises(RunStopped):
        list(irelax(images, calc, stop=_stop_after(5), **settings))
    larger = [atoms.copy() for atoms in images]
    for atoms in larger:
        atoms.set_cell(atoms.cell.array * 1.05, scale_atoms=True)
    with pytest.raises(CheckpointError, match=r"inputs\[0\] .*'positions', 'cell'"):
        relax(larger, calc, **settings)
    other = NVAlchemiCalculator(lennard_jones(epsilon=0.02), **LJ64)
    with pytest.raises(CheckpointError, match=r"model"):
        relax(images, other, **settings)
    assert len(relax(images, calc, **settings)) == 4


def test_checkpoint_declaring_a_huge_array_is_refused_before_allocating(tmp_path):
    path = tmp_path / "forged.npz"
    buffer = io.BytesIO()
    header = {"descr": "<f8", "fortran_order": False, "shape": (10**12, 3)}
    np.lib.format.write_array_header_1_0(buffer, header)
    buffer.write(np.zeros(6).tobytes())
    meta = io.BytesIO()
    np.save(meta, np.array(json.dumps({"format": "nvalchemi_ase.checkpoint"})))
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("meta.npy", meta.getvalue())
        archive.writestr("batch/positions.npy", buffer.getvalue())
    with pytest.raises(CheckpointError, match=r"'batch/positions' declares shape"):
        read_checkpoint(path)


def test_restart_checkpoint_carries_the_starting_structures(tmp_path, calc):
    path = tmp_path / "vv.npz"
    images = _argon(3)
    for atoms in images:
        atoms.calc = calc
    dyn = VelocityVerlet(images, 2.0, restart=path, restart_interval=2)
    dyn.run(4)
    saved = read_checkpoint(path).arrays["structures/identity"]
    np.testing.assert_array_equal(saved, structure_digests(_argon(3), MD_FIELDS))
    # continued and written again: still the structures the run started from
    again = _argon(3)
    for atoms in again:
        atoms.calc = calc
    VelocityVerlet(again, 2.0, restart=path, restart_interval=2).run(4)
    np.testing.assert_array_equal(
        read_checkpoint(path).arrays["structures/identity"], saved
    )


# ----------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------


def _partial_of(final: Path, staged: Path, frames: int) -> None:
    """What a kill -9 after ``frames`` structures leaves: their frames, staged."""
    spans = scan_frames(final).spans
    staged.write_bytes(final.read_bytes()[: spans[frames - 1][1]])
    final.unlink()


def test_cli_relax_resume_refuses_another_model_or_a_rewritten_input(tmp_path, capsys):
    from ase.io import write

    inputs = tmp_path / "in.extxyz"
    write(inputs, _argon(6))
    output = tmp_path / "relaxed.extxyz"
    staged = tmp_path / "relaxed.partial.extxyz"
    argv = ["relax", str(inputs), "-o", str(output), "--fmax", "0.05", *CLI_LJ]
    assert main(argv) == 0
    finished = output.read_bytes()
    _partial_of(output, staged, 3)
    kept = staged.read_bytes()

    other_model = [*argv, "--model", "lj:epsilon=0.02", "--resume"]
    assert main(other_model) == 2
    err = capsys.readouterr().err
    assert "another model" in err
    assert "--overwrite" in err
    assert staged.read_bytes() == kept

    write(inputs, _argon(6, seed=50))  # rewritten under the same name
    assert main([*argv, "--resume"]) == 2
    err = capsys.readouterr().err
    assert "'positions'" in err
    assert f"{inputs}@0" in err
    assert staged.read_bytes() == kept

    write(inputs, _argon(6))
    assert main([*argv, "--resume"]) == 0, capsys.readouterr().err
    resumed = read(output, ":")
    assert [a.info["index"] for a in resumed] == list(range(6))
    assert output.read_bytes()[: len(kept)] == finished[: len(kept)]


def test_cli_resume_of_a_finished_job_is_a_no_op_that_says_so(tmp_path, capsys):
    from ase.io import write

    inputs = tmp_path / "in.extxyz"
    write(inputs, _argon(4))
    output = tmp_path / "out.extxyz"
    argv = ["calc", str(inputs), "-o", str(output), *CLI_LJ]
    assert main(argv) == 0
    text = output.read_bytes()
    capsys.readouterr()
    assert main([*argv, "--resume"]) == 0  # a requeued job script
    assert "already finished" in capsys.readouterr().err
    assert output.read_bytes() == text
    assert not (tmp_path / "out.partial.extxyz").exists()
    # another model on the finished output: refused, the output untouched
    assert main([*argv, "--resume", "--model", "lj:epsilon=0.02"]) == 2
    assert "another model" in capsys.readouterr().err
    assert output.read_bytes() == text
    assert not (tmp_path / "out.partial.extxyz").exists()


def test_job_keys_are_not_in_what_read_results_returns(tmp_path, calc):
    output = tmp_path / "out.extxyz"
    single_points(_argon(2), calc, output=output)
    assert "job_model=" in output.read_text()
    for atoms in read_results(output):
        assert not {"job_input", "job_model", "job_run"} & set(atoms.info)
    assert STRUCTURE_FIELDS[0] == "atomic_numbers"


def test_a_list_of_inputs_is_checked_before_any_work(tmp_path, calc):
    """The changed input comes last: nothing else is relaxed before the refusal."""
    images = _argon(6, stdev=0.1)
    output = tmp_path / "relaxed.extxyz"
    relax(images, calc, fmax=0.05, output=output)
    frames = scan_frames(output)
    last = max(frames.indices[:3])
    output.write_bytes(output.read_bytes()[: frames.spans[2][1]])  # 3 finished
    kept = output.read_bytes()
    changed = [atoms.copy() for atoms in images]
    changed[last].positions[0, 0] += 0.01
    with pytest.raises(JobMismatchError, match=rf"input {last} .*'positions'"):
        relax(changed, calc, fmax=0.05, output=output, resume=True)
    assert output.read_bytes() == kept
