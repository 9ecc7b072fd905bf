"""Data-parallel runners on torch.distributed (gloo, CPU, 2 ranks by torchrun).

References: the same runner in one process (float64, the LJ model): every
structure's result must be the one it gets alone, whatever rank ran it.
Ranks are started by ``torch.distributed.run`` (torchrun) in a subprocess,
as a user starts them: one launch (``tests/distributed_worker.py``) runs every
runner, the resumed run and both command lines, and the tests read its files.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from ase.io import read, write

from nvalchemi_ase import runners
from nvalchemi_ase.cli.main import main
from nvalchemi_ase.runners import (
    failed_path,
    finished_indices,
    irelax,
    read_results,
    relax,
    single_points,
)
from nvalchemi_ase.runners.distributed import (
    SINGLE,
    Shard,
    shard_files,
    shard_path,
    sharding,
)
from nvalchemi_ase.runners.files import Sink, merge_shards
from tests.distributed_worker import CLI, RESUMED, RUNS, cli_arguments
from tests.helpers import torchrun, write_results
from tests.structures import mixed

# float64, same engine per structure; only the order of sums in a batch differs.
ENERGY_ATOL = 1e-10  # eV
POSITION_ATOL = 1e-8  # Å (an optimizer path amplifies round-off a little)
FILE_ATOL = 1e-8  # extxyz columns are written with 8 decimals (Å, eV/Å)
COUNT = 100


def _assert_same_structures(got, expected, *, kind: str) -> None:
    assert [int(a.info["index"]) for a in got] == list(range(len(expected)))
    for index, (result, reference) in enumerate(zip(got, expected, strict=True)):
        assert result.info.get("failure") == reference.info.get("failure"), index
        for key in ("converged", "steps"):
            assert result.info.get(key) == reference.info.get(key), (index, key)
        atol = POSITION_ATOL + FILE_ATOL
        assert np.allclose(result.positions, reference.positions, atol=atol)
        assert result.get_potential_energy() == pytest.approx(
            reference.get_potential_energy(), abs=ENERGY_ATOL
        ), (kind, index)
        assert np.allclose(result.get_forces(), reference.get_forces(), atol=atol)


# -- the shard, the files and the merge (one process) ---------------------------


def test_a_shard_owns_every_size_th_index_and_numbers_inputs_globally():
    shard = Shard(rank=1, size=3)
    numbered = list(shard.numbered(iter("abcdefg")))
    assert numbered == [(1, "b"), (4, "e")]
    assert shard.owned_count(7) == 2
    assert [i for i, _ in SINGLE.numbered("abc")] == [0, 1, 2]
    seeds = {Shard(rank=r, size=2).seed(10, chunk) for r in (0, 1) for chunk in (0, 1)}
    assert seeds == {10, 11, 12, 13}  # distinct across ranks and chunks
    assert SINGLE.seed(10, 3) == 13  # the single-process run's seeds


def test_sharding_is_single_outside_a_launch_and_refuses_a_forced_one(monkeypatch):
    for name in ("WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    with sharding(None) as shard:
        assert shard is SINGLE
    with sharding(False) as shard:
        assert shard is SINGLE
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="torchrun"), sharding(True):
        pass


def _frames(calc, indices):
    results = single_points(mixed(max(indices) + 1), calc)
    return [results[i] for i in indices]


def test_merge_takes_every_complete_frame_once_in_input_order(lj_calc64, tmp_path):
    output = tmp_path / "out.extxyz"
    frames = _frames(lj_calc64, range(6))
    write_results(output, [frames[4]])  # an earlier, resumed run's
    write_results(shard_path(output, 0), [frames[2], frames[0]])
    write_results(shard_path(output, 1), [frames[5], frames[1], frames[4]])
    write_results(shard_path(output, 3), [frames[3]])  # a run with another world size
    with shard_path(output, 3).open("a") as handle:
        handle.write("7\ncut off mid-write")
    assert len(shard_files(output)) == 3
    assert sorted(finished_indices(output)) == list(range(6))
    merge_shards(output)
    merged = read(output, ":")
    assert [a.info["index"] for a in merged] == list(range(6))
    for atoms, reference in zip(merged, frames, strict=True):
        assert atoms.get_potential_energy() == reference.get_potential_energy()
    assert shard_files(output) == []


def test_an_existing_shard_file_is_refused_without_resume(lj_calc64, tmp_path):
    output = tmp_path / "out.extxyz"
    write_results(shard_path(output, 1), _frames(lj_calc64, [1]))
    with pytest.raises(FileExistsError, match="rank1"):
        Sink(output, resume=False)
    assert Sink(output, resume=True).done == {1}


def test_a_single_process_resume_merges_what_ranks_left(lj_calc64, tmp_path):
    """A distributed run killed, then resumed alone: nothing is computed twice."""
    structures = mixed(8)
    output = tmp_path / "out.extxyz"
    reference = relax(structures, lj_calc64, **RUNS["relax"])
    left = [reference[1].copy(), reference[3].copy()]
    for atoms, index in zip(left, (1, 3), strict=True):
        atoms.calc = reference[index].calc
        atoms.info["source"] = "left by rank 1"
    write_results(shard_path(output, 1), left)
    computed = [
        index
        for index, _ in irelax(
            structures, lj_calc64, output=output, resume=True, **RUNS["relax"]
        )
    ]
    assert sorted(computed) == [0, 2, 4, 5, 6, 7]
    merged = read_results(output)
    assert shard_files(output) == []
    assert [a.info.get("source") for a in merged].count("left by rank 1") == 2
    _assert_same_structures(merged, reference, kind="relax")


# -- two ranks under torchrun ---------------------------------------------------

#: What a killed two-rank relaxation left: each rank's finished indices.
KEPT = {0: [0, 4, 10], 1: [1, 7]}
CLI_INPUTS = {"cli-relax": 30, "cli-md": 12}  # structures of mixed(N)


@pytest.fixture(scope="module")
def references(lj_calc64):
    structures = mixed(COUNT)
    return {
        kind: getattr(runners, kind)(structures, lj_calc64, **RUNS[kind])
        for kind in RUNS
    }


def _leave_a_killed_run(output: Path, expected) -> None:
    """Shard files as a killed two-rank relaxation leaves them (one frame cut off)."""
    output.parent.mkdir(parents=True)
    for rank, indices in KEPT.items():
        frames = [expected[i].copy() for i in indices]
        for frame, index in zip(frames, indices, strict=True):
            frame.calc = expected[index].calc
            frame.info["source"] = "kept"
        write_results(shard_path(output, rank), frames)
    with shard_path(output, 1).open("a") as handle:
        handle.write("12\nLattice=")  # a frame cut off by the kill


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory, references):
    """Every job of ``tests.distributed_worker`` by two ranks, in one torchrun
    launch (a launch costs ~30 s of CPU before any work; see the worker).

    Returns the folder and what the launch printed.
    """
    folder = tmp_path_factory.mktemp("two_ranks")
    _leave_a_killed_run(folder / "relax-resumed" / "out.extxyz", references["relax"])
    (folder / "cli").mkdir()
    for job, count in CLI_INPUTS.items():
        name = CLI[job][1]
        write(folder / "cli" / name, mixed(count), format="extxyz")
    jobs = [*RUNS, *RESUMED, *CLI]
    printed = torchrun("-m", "tests.distributed_worker", ",".join(jobs), str(folder))
    return folder, printed


def _alone(job: str, folder: Path, monkeypatch) -> Path:
    """The command line of ``job`` in this process, on the launch's inputs."""
    monkeypatch.chdir(folder / "cli")
    assert main([*cli_arguments(job, "one"), "--quiet"]) == 0
    return folder / "cli"


@pytest.mark.slow  # two ranks started by torchrun
@pytest.mark.parametrize("kind", list(RUNS))
def test_two_ranks_write_and_return_what_one_process_does(
    kind, references, two_rank_runs
):
    output = two_rank_runs[0] / kind / "out.extxyz"
    written = read(output, ":")  # merged by rank 0, in input order
    _assert_same_structures(written, references[kind], kind=kind)
    for rank in (0, 1):  # every rank's list holds every structure
        returned = read(output.with_name(f"returned.rank{rank}.extxyz"), ":")
        _assert_same_structures(returned, references[kind], kind=kind)
    assert shard_files(output) == []
    assert not failed_path(output).exists()


@pytest.mark.slow
def test_two_ranks_resume_their_shards_of_a_killed_run(references, two_rank_runs):
    """Shard files as a killed two-rank run leaves them; resumed with two ranks."""
    expected = references["relax"]
    output = two_rank_runs[0] / "relax-resumed" / "out.extxyz"
    merged = read(output, ":")
    _assert_same_structures(merged, expected, kind="relax")
    sources = [i for i, a in enumerate(merged) if a.info.get("source") == "kept"]
    assert sources == sorted(i for kept in KEPT.values() for i in kept)  # not redone
    assert shard_files(output) == []


@pytest.mark.slow
def test_the_cli_under_torchrun_writes_what_it_writes_alone(two_rank_runs, monkeypatch):
    """``relax`` by two ranks (the launch's ``cli-relax`` job) and alone."""
    folder, printed = two_rank_runs
    here = _alone("cli-relax", folder, monkeypatch)
    assert printed.count("30/30 converged") == 1  # rank 0 prints, once
    one = read(here / "one/relaxed.extxyz", ":")
    two = read(here / "two/relaxed.extxyz", ":")
    _assert_same_structures(two, one, kind="cli relax")
    assert [a.info["source"] for a in two] == [a.info["source"] for a in one]
    names = sorted(p.name for p in (here / "one/traj").iterdir())
    assert names == sorted(p.name for p in (here / "two/traj").iterdir())
    for name in names:
        frames_one = read(here / "one/traj" / name, ":")
        frames_two = read(here / "two/traj" / name, ":")
        assert len(frames_one) == len(frames_two)
        assert np.allclose(
            frames_one[-1].positions, frames_two[-1].positions, atol=POSITION_ATOL
        )
    leftovers = [p.name for p in (here / "two").iterdir() if "partial" in p.name]
    assert leftovers == []


@pytest.mark.slow
def test_cli_md_under_torchrun_ends_where_it_ends_alone(two_rank_runs, monkeypatch):
    """NVE from the same seeded velocities: every final state equal; one log a rank."""
    here = _alone("cli-md", two_rank_runs[0], monkeypatch)
    one = read(here / "one/final.extxyz", ":")
    two = read(here / "two/final.extxyz", ":")
    assert [a.info["source"] for a in two] == [a.info["source"] for a in one]
    for alone, sharded in zip(one, two, strict=True):
        assert np.allclose(sharded.positions, alone.positions, atol=FILE_ATOL)
        assert np.allclose(sharded.get_momenta(), alone.get_momenta(), atol=FILE_ATOL)
        assert sharded.get_potential_energy() == pytest.approx(
            alone.get_potential_energy(), abs=ENERGY_ATOL
        )
    logs = sorted(p.name for p in (here / "two").glob("*.log"))
    assert logs == ["md.log", "md.rank1.log"]
    assert not list((here / "two").glob("*partial*"))
