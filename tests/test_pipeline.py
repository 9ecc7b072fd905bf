"""``optimizer | md``: relax on rank 0, MD on rank 1 (nvalchemi's DistributedPipeline).

Reference: the single-process ``optimizer + md`` on the same structures
(float64, LJ, deterministic velocity Verlet). Ranks are started by
``torch.distributed.run`` (gloo, CPU, 2 ranks) in a subprocess, as a user
starts them (:func:`tests.helpers.torchrun`).
"""

from __future__ import annotations

import re
import shutil
from typing import Any

import numpy as np
import pytest
from ase.constraints import FixAtoms
from ase.io import read

from nvalchemi_ase import NVAlchemiCalculator, md, optimize
from nvalchemi_ase.compose import FINISHED
from nvalchemi_ase.dynamics.checkpoint import CheckpointError, read_checkpoint
from nvalchemi_ase.pipeline import RelaxThenMDPipeline
from tests.helpers import torchrun
from tests.pipeline_worker import (
    JOIN,
    PIPE,
    THERMOSTAT_K,
    TIMESTEP,
    build,
    images,
    integrator,
    state,
)

# float64, each structure's forces independent of the batch it is in: the
# pipeline and the fused run agree to round-off.
ENERGY_ATOL = 1e-10  # eV
POSITION_ATOL = 1e-8  # Å
MOMENTUM_ATOL = 1e-8  # amu Å / ASE time unit
FORCE_ATOL = 1e-8  # eV/Å
STRESS_ATOL = 1e-10  # eV/Å³
# Rank 0's sampler batches these as [s1, s2, s0], the fused run as given:
# the same order up to s0, which relaxes in one step; s1 and s2 overlap in MD.
ORDER = [1, 0, 2]


def _fused(
    optimizer: str,
    order: list[int],
    stage: str = "VelocityVerlet",
    targets: list[float] | None = None,
    **files: Any,
) -> dict[str, np.ndarray]:
    """The single-process ``optimizer + md``, with each structure's hand-over step."""
    calc = NVAlchemiCalculator("lj", device="cpu", dtype="float64")
    structures = images(calc, order)
    fused = getattr(optimize, optimizer)(structures, logfile=None).then(
        integrator(stage, structures, targets), **PIPE, **files
    )
    history = []
    fused.attach(lambda: history.append(fused.stage.copy()))
    assert fused.run(1000)
    stages = np.array(history)  # (steps + 1, B)
    handed_over = [int(np.flatnonzero(column >= 1)[0]) for column in stages.T]
    return state(structures, fused.stage, handed_over)


def _job(
    optimizer: str,
    order: list[int],
    folder,
    loginterval: int | None = None,
    options: tuple[str, ...] = (),
) -> list[str]:
    """The worker's arguments for ``optimizer | md`` on two ranks into ``folder``.

    With ``loginterval`` the pipeline also writes ``pipe_{i}.traj`` and
    ``pipe.log`` (and ``pipe.rank1.log``) into ``folder``; ``options`` are the
    worker's others (``kick=I``).
    """
    indices = ",".join(str(index) for index in order)
    files = [] if loginterval is None else [str(loginterval)]
    return [optimizer, indices, str(folder), *files, *options]


def _launch(*jobs: list[str]) -> str:
    """Run ``jobs`` in one torchrun launch; its error output ("" if it succeeded).

    One launch runs many jobs: each start-up (torchrun and two interpreters
    importing torch and nvalchemi) costs more CPU than a job here.
    """
    arguments = [argument for job in jobs for argument in (JOIN, *job)][1:]
    try:
        torchrun("-m", "tests.pipeline_worker", *arguments)
    except AssertionError as error:
        return str(error) or "the launch failed"
    return ""


def _ranks(folder, launch_error: str = "") -> list[dict]:
    """What each rank's ``Atoms`` held after the job that wrote into ``folder``."""
    files = [folder / f"rank{rank}.npz" for rank in (0, 1)]
    assert all(path.exists() for path in files), launch_error
    return [dict(np.load(path)) for path in files]


def _assert_same(got: dict, expected: dict) -> None:
    np.testing.assert_allclose(got["energies"], expected["energies"], atol=ENERGY_ATOL)
    for key, atol in (
        ("positions", POSITION_ATOL),
        ("momenta", MOMENTUM_ATOL),
        ("forces", FORCE_ATOL),
    ):
        np.testing.assert_allclose(got[key], expected[key], atol=atol, err_msg=key)


# The run every restart test stops and continues: FIRE | Langevin with its
# noise on (seeded), frames and log lines every 2 steps, and the structure at
# position 1 kicked: it relaxes in one step and fails at its first MD step
# (step 2). The others reach MD at steps 30 and 39 and finish at step 54.
# FIRE writes its own trajectories (appended to) and log as well.
RESUMED = ("kick=1", "md=SeededLangevin", "own")
RESUMED_LOGINTERVAL = 2
#: The first launch's jobs: name -> (optimizer, order, loginterval, options).
#: ``killed`` dies (SIGKILL at step 35, checkpoints every 4 steps): it is last.
FIRST_LAUNCH = {
    "files-FIRE2-1": ("FIRE2", ORDER, 1, ()),
    "files-FIRE-3": ("FIRE", ORDER, 3, ()),
    "thermostat-Langevin": ("FIRE", ORDER, None, ("md=Langevin",)),
    "thermostat-NVTBerendsen": ("FIRE", ORDER, None, ("md=NVTBerendsen",)),
    "blow-up": ("FIRE2", [0, 1, 2], None, ("kick=1",)),
    "uninterrupted": ("FIRE", ORDER, RESUMED_LOGINTERVAL, RESUMED),
    # stopped by run(7), checkpoints every 3 steps (the MD batch is empty then:
    # the kicked structure failed at step 2, the next arrives at step 30);
    # then run() again, refused
    "stopped": (
        "FIRE",
        ORDER,
        RESUMED_LOGINTERVAL,
        (*RESUMED, "restart=ckpt.npz", "interval=3", "steps=7", "again"),
    ),
    "killed": (
        "FIRE",
        ORDER,
        RESUMED_LOGINTERVAL,
        (*RESUMED, "restart=ckpt.npz", "interval=4", "die=35"),
    ),
}


@pytest.fixture(scope="module")
def first_launch(tmp_path_factory) -> tuple[dict, str]:
    """Every job of :data:`FIRST_LAUNCH` in one launch: their folders by name,
    and the launch's error output (the killed job ends it with an error)."""
    folders = {name: tmp_path_factory.mktemp(name) for name in FIRST_LAUNCH}
    jobs = [
        _job(optimizer, order, folders[name], loginterval, options)
        for name, (optimizer, order, loginterval, options) in FIRST_LAUNCH.items()
    ]
    return folders, _launch(*jobs)


def _launched(first_launch, name: str) -> tuple:
    """A job of the first launch: its folder and both ranks' results."""
    folders, error = first_launch
    return folders[name], _ranks(folders[name], error)


@pytest.mark.slow  # two ranks started by torchrun (one launch for the file's jobs)
@pytest.mark.parametrize(("optimizer", "loginterval"), [("FIRE2", 1), ("FIRE", 3)])
def test_two_ranks_give_every_rank_and_file_what_the_fused_run_gives(
    optimizer, loginterval, tmp_path, first_launch
):
    """Relaxed on rank 0, sent to rank 1 at the fused run's step, MD, results back;
    each structure's trajectory holds the fused run's frames, and each rank logs."""
    files = {"trajectory": str(tmp_path / "fused_{i}.traj"), "loginterval": loginterval}
    expected = _fused(optimizer, ORDER, **files)
    assert len(set(expected["relax_steps"].tolist())) == 3  # three hand-over steps
    folder, ranks = _launched(first_launch, f"files-{optimizer}-{loginterval}")
    for got in ranks:  # rank 0, rank 1
        assert bool(got["done"])
        assert got["stage"].tolist() == [FINISHED] * 3
        assert got["relax_steps"].tolist() == expected["relax_steps"].tolist()
        _assert_same(got, expected)
    for index in range(len(ORDER)):
        _assert_same_frames(
            read(folder / f"pipe_{index}.traj", ":"),
            read(tmp_path / f"fused_{index}.traj", ":"),
            # the fused run's copies of a finished structure keep the stress of
            # its last frame step (stale when loginterval > 1)
            stress=loginterval == 1,
        )
    assert sorted(path.name for path in folder.glob(".*")) == []  # no temporaries
    iterations = int(ranks[0]["nsteps"])
    for name, header in (("pipe.log", "Step"), ("pipe.rank1.log", "Time[ps]")):
        lines = (folder / name).read_text().splitlines()
        assert lines[0].split()[0] == header
        assert len(lines) == 1 + iterations // loginterval


def _assert_same_frames(got: list, expected: list, *, stress: bool) -> None:
    """Frame by frame: positions, momenta, energy, forces (and stress)."""
    assert len(got) == len(expected)
    for number, (mine, theirs) in enumerate(zip(got, expected, strict=True)):
        where = f"frame {number}"
        assert mine.get_potential_energy() == pytest.approx(
            theirs.get_potential_energy(), abs=ENERGY_ATOL
        ), where
        for key, atol in (
            ("positions", POSITION_ATOL),
            ("momenta", MOMENTUM_ATOL),
            ("forces", FORCE_ATOL),
        ):
            np.testing.assert_allclose(
                getattr(mine, f"get_{key}")(),
                getattr(theirs, f"get_{key}")(),
                atol=atol,
                err_msg=f"{where}: {key}",
            )
        assert ("stress" in mine.calc.results) == ("stress" in theirs.calc.results)
        if stress and "stress" in theirs.calc.results:
            np.testing.assert_allclose(
                mine.get_stress(), theirs.get_stress(), atol=STRESS_ATOL, err_msg=where
            )


@pytest.mark.slow  # two ranks started by torchrun (the first launch)
@pytest.mark.parametrize("stage", ["Langevin", "NVTBerendsen"])
def test_a_thermostat_stage_takes_each_structures_own_target(stage, first_launch):
    """``FIRE | Langevin`` (no friction) and ``FIRE | NVTBerendsen``, one target
    temperature per structure: each structure is admitted into rank 1's batch
    with its own target and ends where the fused run ends (Berendsen's path
    depends on the target, so a target given to the wrong structure fails)."""
    expected = _fused("FIRE", ORDER, stage)
    _, ranks = _launched(first_launch, f"thermostat-{stage}")
    for got in ranks:
        assert bool(got["done"])
        assert got["stage"].tolist() == [FINISHED] * 3
        assert got["relax_steps"].tolist() == expected["relax_steps"].tolist()
        _assert_same(got, expected)
    if stage == "NVTBerendsen":  # the targets matter: swapped, the run differs
        swapped = _fused("FIRE", ORDER, stage, targets=THERMOSTAT_K[::-1])
        assert np.abs(swapped["momenta"] - ranks[1]["momenta"]).max() > 100 * (
            MOMENTUM_ATOL
        )


def _per_structure(result: dict, sizes: list[int]) -> list[dict]:
    """Split a :func:`~tests.pipeline_worker.state` into one dict per structure."""
    ends = np.cumsum(sizes)
    return [
        {
            "energy": result["energies"][index],
            "relax_steps": int(result["relax_steps"][index]),
            **{
                key: result[key][end - size : end]
                for key in ("positions", "momenta", "forces")
            },
        }
        for index, (size, end) in enumerate(zip(sizes, ends, strict=True))
    ]


@pytest.mark.slow  # two ranks started by torchrun (the first launch)
def test_a_structure_that_blows_up_in_md_costs_that_structure_only(first_launch):
    """One structure enters MD with an atom moving ~2.9 Å per step: the guard on
    rank 1 stops it at its first MD step, both ranks report it by input index,
    step and reason, and the others finish where the fused run without it ends
    (nvalchemi's FIRE2 and NVE: bit for bit independent of the batch here)."""
    _, got = _launched(first_launch, "blow-up")
    sizes = [len(atoms) for atoms in images(None, [0, 1, 2])]
    reference = _per_structure(_fused("FIRE2", [0, 2]), [sizes[0], sizes[2]])
    for rank in got:
        assert bool(rank["done"])  # the failed structure counts as finished
        assert rank["stage"].tolist() == [FINISHED] * 3
        (index, step), reason = rank["failures"].tolist()[0], str(rank["reasons"][0])
        assert len(rank["failures"]) == 1
        assert index == 1
        assert step == int(rank["relax_steps"][1]) + 1  # its first MD step
        assert "max_displacement" in reason, reason
        mine = _per_structure(rank, sizes)
        for position, original in enumerate([0, 2]):
            assert mine[original]["relax_steps"] == reference[position]["relax_steps"]
            assert mine[original]["energy"] == pytest.approx(
                reference[position]["energy"], abs=ENERGY_ATOL
            )
            for key, atol in (
                ("positions", POSITION_ATOL),
                ("momenta", MOMENTUM_ATOL),
                ("forces", FORCE_ATOL),
            ):
                np.testing.assert_allclose(
                    mine[original][key], reference[position][key], atol=atol
                )
        # the failed structure keeps its last good state: where it was handed over
        assert np.isfinite(mine[1]["positions"]).all()
    # one warning, by input index (the MD batch's own warning, naming its
    # row, is silenced), on the rank whose part failed
    warned = [rank["warned"].tolist() for rank in got]
    assert warned[0] == []
    assert len(warned[1]) == 1
    assert warned[1][0].startswith(
        f"optimizer | md, VelocityVerlet on rank 1: images[1] failed at step {step}:"
    ), warned[1]


# -- one process -------------------------------------------------------------


def _parts(calc):
    structures = images(calc, [0, 1, 2])
    relax = optimize.FIRE2(structures, logfile=None)
    return structures, relax, md.VelocityVerlet(structures, TIMESTEP)


def test_or_builds_the_pipeline_with_the_fused_defaults(lj_calc64):
    _, relax, integrate = _parts(lj_calc64)
    pipeline = relax | integrate
    assert isinstance(pipeline, RelaxThenMDPipeline)
    assert (pipeline.fmax, pipeline.md_steps) == (0.05, None)
    assert pipeline.todict()["type"] == "relax-then-md-pipeline"


def test_run_outside_torchrun_says_how_to_start_it(lj_calc64, monkeypatch):
    for name in ("WORLD_SIZE", "MASTER_ADDR", "RANK"):
        monkeypatch.delenv(name, raising=False)
    _, relax, integrate = _parts(lj_calc64)
    with pytest.raises(RuntimeError, match=r"distributed\.run --nproc_per_node=2"):
        relax.pipe(integrate, md_steps=5).run()


def test_the_pipeline_checks_its_parts(lj_calc64):
    structures, relax, integrate = _parts(lj_calc64)
    with pytest.raises(TypeError, match=r"relax \| md needs an nvalchemi_ase"):
        relax | relax
    with pytest.raises(ValueError, match="md_steps must be >= 1"):
        relax.pipe(integrate, md_steps=0)
    with pytest.raises(ValueError, match="and FIRE2 was given restart="):
        optimize.FIRE2(structures, logfile=None, restart="never-written.npz") | (
            integrate
        )
    structures[0].set_constraint(FixAtoms([0]))
    with pytest.raises(ValueError, match=r"ASE constraints \(structures \[0\]"):
        optimize.FIRE2(structures, logfile=None) | md.VelocityVerlet(
            structures, TIMESTEP
        )


def test_the_pipeline_checks_its_files(lj_calc64, tmp_path):
    from ase.io.trajectory import Trajectory

    structures, relax, integrate = _parts(lj_calc64)
    stale = tmp_path / "md_0.traj"
    stale.write_text("an earlier run")
    pipeline = relax.pipe(integrate, trajectory=str(tmp_path / "md_{i}.traj"))
    assert not stale.exists()  # replaced, as ASE's dynamics do
    assert pipeline.loginterval == 1
    with pytest.raises(ValueError, match="loginterval must be >= 1"):
        relax.pipe(integrate, loginterval=0)
    with pytest.raises(ValueError, match=r"\{i\}"):
        relax.pipe(integrate, trajectory=str(tmp_path / "md.traj"))
    with Trajectory(tmp_path / "open.traj", "w") as opened:
        one = structures[:1]
        with pytest.raises(ValueError, match="not into open Trajectory objects"):
            optimize.FIRE2(one, logfile=None).pipe(
                md.VelocityVerlet(one, TIMESTEP), trajectory=[opened]
            )


def test_the_pipeline_needs_an_md_batch_that_resizes_in_place(lj_calc64, tmp_path):
    structures, relax, _ = _parts(lj_calc64)
    scheduled = md.Langevin(
        structures, TIMESTEP, temperature_K=[(0, 30.0), (50, 60.0)], friction=0.01
    )
    with pytest.raises(ValueError, match="this Langevin cannot resize in place"):
        relax | scheduled
    with_file = md.VelocityVerlet(
        structures, TIMESTEP, trajectory=str(tmp_path / "own_{i}.traj")
    )
    with pytest.raises(ValueError, match="trajectory= of the pipeline"):
        relax | with_file


# -- checkpoints (restart=) ----------------------------------------------------

# A continued run repeats the uninterrupted run's arithmetic (float64).
RESUME_ATOL = {"positions": 1e-10, "momenta": 1e-10, "forces": 1e-10}
RESUME_ENERGY_ATOL = 1e-10  # eV
RESUME_STRESS_ATOL = 1e-12  # eV/Å³


def _resumed_job(folder, *options: str) -> list[str]:
    return _job("FIRE", ORDER, folder, RESUMED_LOGINTERVAL, (*RESUMED, *options))


@pytest.fixture(scope="module")
def uninterrupted(first_launch):
    """The run without checkpoints: its folder and both ranks' results."""
    return _launched(first_launch, "uninterrupted")


@pytest.fixture(scope="module")
def stopped(first_launch):
    """The run stopped by ``run(7)``: its folder and both ranks' results."""
    return _launched(first_launch, "stopped")


@pytest.fixture(scope="module")
def continued(first_launch, stopped, tmp_path_factory) -> dict:
    """The second launch: the stopped run continued in a moved folder and the
    killed run continued in its own, with what their folders held before."""
    folders, first_error = first_launch
    moved = tmp_path_factory.mktemp("continued") / "moved"
    shutil.copytree(stopped[0], moved)  # a run's folder may move between launches
    killed = folders["killed"]
    manifest = read_checkpoint(killed / "ckpt.npz")
    rank0 = read_checkpoint(killed / manifest.meta["rank_files"][0])
    before = {
        "first_error": first_error,
        "stopped_step": read_checkpoint(moved / "ckpt.npz").meta["nsteps"],
        "killed_step": manifest.meta["nsteps"],
        "killed_logged": len((killed / "pipe.log").read_text().splitlines()),
        # the optimizer's own frames: in its files, and counted by the checkpoint
        "killed_relax_frames": [
            len(read(killed / f"relax_{index}.traj", ":"))
            for index in range(len(ORDER))
        ],
        "killed_relax_counted": rank0.group("extra/tag")["optimizer_frames"].tolist(),
    }
    # as if rank 0 had written its next file and was killed before the
    # manifest named it: never read, removed
    last = killed / "ckpt.rank0.step32.npz"
    if last.exists():
        shutil.copy(last, killed / "ckpt.rank0.step36.npz")
    error = _launch(
        _resumed_job(moved, "restart=ckpt.npz", "interval=3"),
        _resumed_job(killed, "restart=ckpt.npz", "interval=4"),
    )
    return {
        **before,
        "moved": (moved, _ranks(moved, error)),
        "killed": (killed, _ranks(killed, error)),
    }


@pytest.fixture(scope="module")
def launched_again(continued) -> dict:
    """The third launch (one job: the pipeline starts its own process group):
    the finished, continued job once more, and the files it held before."""
    folder = continued["moved"][0]
    outputs = ("rank0.npz", "rank1.npz")  # the worker's, written again
    written = {
        p.name: p.read_bytes() for p in folder.iterdir() if p.name not in outputs
    }
    error = _launch(_resumed_job(folder, "restart=ckpt.npz", "interval=3"))
    return {"written": written, "ranks": _ranks(folder, error)}


def _assert_same_frames_resumed(mine: list, theirs: list, what: str) -> None:
    """Frame by frame as the uninterrupted run's: count, energy, positions,
    momenta, forces and stress."""
    assert len(mine) == len(theirs), what
    for number, (a, b) in enumerate(zip(mine, theirs, strict=True)):
        where = f"{what}, frame {number}"
        assert a.get_potential_energy() == pytest.approx(
            b.get_potential_energy(), abs=RESUME_ENERGY_ATOL
        ), where
        for key, atol in RESUME_ATOL.items():
            np.testing.assert_allclose(
                getattr(a, f"get_{key}")(),
                getattr(b, f"get_{key}")(),
                atol=atol,
                err_msg=f"{where}: {key}",
            )
        assert ("stress" in a.calc.results) == ("stress" in b.calc.results), where
        if "stress" in b.calc.results:
            np.testing.assert_allclose(
                a.get_stress(), b.get_stress(), atol=RESUME_STRESS_ATOL, err_msg=where
            )


def _clock_masked(path) -> list[str]:
    """The lines of an ASE optimizer log with their ``HH:MM:SS`` masked."""
    return [
        re.sub(r"\b\d\d:\d\d:\d\d\b", "hh:mm:ss", line)
        for line in path.read_text().splitlines()
    ]


def _assert_same_run(folder, ranks: list[dict], reference) -> None:
    """Both ranks' results and every file as the uninterrupted run's."""
    expected_folder, expected_ranks = reference
    for got, expected in zip(ranks, expected_ranks, strict=True):
        assert set(got) == set(expected)
        for key in ("done", "nsteps", "failures", "reasons", "stage", "relax_steps"):
            np.testing.assert_array_equal(got[key], expected[key], err_msg=key)
        np.testing.assert_allclose(
            got["energies"], expected["energies"], atol=RESUME_ENERGY_ATOL
        )
        for key, atol in RESUME_ATOL.items():
            np.testing.assert_allclose(got[key], expected[key], atol=atol, err_msg=key)
    for index in range(len(ORDER)):
        for name in (f"pipe_{index}.traj", f"relax_{index}.traj"):
            _assert_same_frames_resumed(
                read(folder / name, ":"), read(expected_folder / name, ":"), name
            )
    for name in ("pipe.log", "pipe.rank1.log"):
        assert (folder / name).read_text() == (expected_folder / name).read_text()
    # the optimizer's own log, but for its wall-clock column
    assert _clock_masked(folder / "relax.log") == _clock_masked(
        expected_folder / "relax.log"
    )
    # the finished job's hidden frame files are gone; its checkpoint stays
    assert sorted(path.name for path in folder.glob(".*")) == []
    manifest = read_checkpoint(folder / "ckpt.npz")
    assert manifest.meta["nsteps"] == int(expected_ranks[0]["nsteps"])
    assert sorted(path.name for path in folder.glob("ckpt.rank*")) == sorted(
        manifest.meta["rank_files"]
    )


@pytest.mark.slow  # three torchrun launches (shared with the file's other tests)
def test_a_stopped_run_continued_ends_as_the_uninterrupted_run(
    uninterrupted, stopped, continued, launched_again
):
    """``run(7)`` then ``run()`` again in a new launch (restart=): every rank's
    results, frames and log lines as without the stop; the structure that
    failed before the stop stays quarantined (reported once, by input index,
    step and reason; not in the MD batch again)."""
    for rank in stopped[1]:
        assert not bool(rank["done"])
        assert int(rank["nsteps"]) == 7
        assert rank["failures"].tolist() == [[1, 2]]
        # run() again in the same process would start the stages over
        assert "runs once per pipeline object" in str(rank["again"])
    assert continued["stopped_step"] == 7
    folder, ranks = continued["moved"]
    for rank in ranks:
        assert rank["failures"].tolist() == [[1, 2]]
        assert "max_displacement" in str(rank["reasons"][0])
    _assert_same_run(folder, ranks, uninterrupted)
    # launched once more, the finished job changes no file and ends at once
    for rank in launched_again["ranks"]:
        assert bool(rank["done"])
        assert int(rank["nsteps"]) == int(uninterrupted[1][0]["nsteps"])
    for name, content in launched_again["written"].items():
        assert (folder / name).read_bytes() == content, name
    _assert_same_run(folder, launched_again["ranks"], uninterrupted)


@pytest.mark.slow  # three torchrun launches (shared with the file's other tests)
def test_a_killed_run_continues_from_its_last_checkpoint(uninterrupted, continued):
    """Both ranks SIGKILLed at step 35 (MD batch in use, checkpoints every 4
    steps): the launch continues from step 32 (the MD batch restored with its
    thermostat's noise counters), the frames and log lines written after it
    are cut (and a rank file the manifest does not name is removed), and
    everything ends as the uninterrupted run."""
    assert continued["first_error"]  # torchrun reports the killed ranks
    assert continued["killed_step"] == 32
    # lines after the checkpoint
    assert continued["killed_logged"] > 1 + 32 // RESUMED_LOGINTERVAL
    folder, ranks = continued["killed"]
    _assert_same_run(folder, ranks, uninterrupted)


@pytest.mark.slow  # three torchrun launches (shared with the file's other tests)
def test_the_optimizers_own_trajectories_continue_as_the_uninterrupted_run(
    uninterrupted, continued
):
    """FIRE's own ``trajectory=`` (``append_trajectory=True``) under the
    pipeline's ``restart=``: the stopped run and the killed run, continued,
    leave each structure's file as the uninterrupted run's, frame by frame:
    the frames written before the checkpoint kept, those the killed run wrote
    after it cut, none written twice, none missing."""
    expected_folder, expected_ranks = uninterrupted
    # as ASE's optimizer writes: frame 0, then one per step up to the step at
    # which the structure converged (and was handed over)
    for index, steps in enumerate(expected_ranks[0]["relax_steps"].tolist()):
        frames = read(expected_folder / f"relax_{index}.traj", ":")
        assert len(frames) == steps + 1, index
    # the killed run wrote frames after its checkpoint (cut when it continued)
    assert continued["killed_relax_frames"] != continued["killed_relax_counted"]
    assert all(
        written >= counted
        for written, counted in zip(
            continued["killed_relax_frames"],
            continued["killed_relax_counted"],
            strict=True,
        )
    )
    for name in ("moved", "killed"):
        folder = continued[name][0]
        for index in range(len(ORDER)):
            file = f"relax_{index}.traj"
            _assert_same_frames_resumed(
                read(folder / file, ":"),
                read(expected_folder / file, ":"),
                f"{name}: {file}",
            )


def test_the_optimizers_own_trajectories_continue_only_by_appended_paths(
    lj_calc64, tmp_path
):
    """With ``restart=`` the optimizer's own trajectories must be paths it
    appends to: without ``append_trajectory=True`` the script that continues
    would remove the frames before the checkpoint as it creates the optimizer,
    and an open Trajectory cannot be cut back; both refused on the first run
    already. An appending optimizer's files are not touched by the pipeline."""
    from ase.io.trajectory import Trajectory

    structures, _, integrate = _parts(lj_calc64)
    restart = tmp_path / "ckpt.npz"
    template = str(tmp_path / "relax_{i}.traj")
    replacing = optimize.FIRE2(structures, logfile=None, trajectory=template)
    with pytest.raises(ValueError, match="without append_trajectory=True"):
        replacing.pipe(integrate, restart=restart)
    replacing.pipe(integrate)  # without restart= nothing is continued
    one = structures[:1]
    with Trajectory(tmp_path / "open.traj", "w") as opened:
        into_open = optimize.FIRE2(one, logfile=None, trajectory=[opened])
        with pytest.raises(ValueError, match="was given an open Trajectory"):
            into_open.pipe(md.VelocityVerlet(one, TIMESTEP), restart=restart)
    earlier = tmp_path / "relax_0.traj"
    with Trajectory(earlier, "w") as writer:
        writer.write(structures[0])
    content = earlier.read_bytes()
    appending = optimize.FIRE2(
        structures, logfile=None, trajectory=template, append_trajectory=True
    )
    pipeline = appending.pipe(integrate, restart=restart)
    assert not pipeline.continued
    assert earlier.read_bytes() == content
    assert not restart.exists()


@pytest.mark.slow  # the first launch
def test_a_checkpoint_of_another_job_is_refused(stopped, tmp_path):
    """The stopped run's checkpoint continues the same job only: other settings,
    other inputs or a checkpoint of another kind are refused, naming the
    field, before any file is touched."""
    folder = stopped[0]
    arguments = ["FIRE", ",".join(map(str, ORDER)), str(folder), "2", *RESUMED]
    arguments.append("restart=ckpt.npz")
    before = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    _, same, _ = build(arguments)
    assert same.continued
    assert same.nsteps == 7
    assert [(f.index, f.step) for f in same.failures] == [(1, 2)]
    with pytest.raises(CheckpointError, match="setting 'md_steps' is 15 in the"):
        build(arguments, md_steps=16)
    with pytest.raises(CheckpointError, match=r"setting 'fmax' is 0\.01 in the"):
        build(arguments, fmax=0.02)
    with pytest.raises(CheckpointError, match=r"setting 'md\.friction' is 0\.05"):
        build([*arguments[:4], "kick=1", "md=Langevin", "own", "restart=ckpt.npz"])
    with pytest.raises(CheckpointError, match=r"images\[1\] is not the structure"):
        build([*arguments[:4], "md=SeededLangevin", "own", "restart=ckpt.npz"])
    with pytest.raises(CheckpointError, match="setting 'optimizer_trajectory' is"):
        build([*arguments[:4], "kick=1", "md=SeededLangevin", "restart=ckpt.npz"])
    single = tmp_path / "single.npz"
    calc = NVAlchemiCalculator("lj", device="cpu", dtype="float64")
    optimize.FIRE(images(calc, [0]), logfile=None, restart=single).run(steps=1)
    _, relax, integrate = _parts(calc)
    with pytest.raises(CheckpointError, match=r"not a checkpoint of optimizer \| md"):
        relax.pipe(integrate, restart=single)
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == before


def test_continue_from_takes_a_checkpoint_into_a_built_object(lj_calc64, tmp_path):
    """``continue_from(path)``, how each rank continues its part: a built object
    takes a checkpoint as ``restart=`` would and ends bit for bit as the run
    never stopped; a checkpoint of other structures is refused."""
    reference = images(lj_calc64, [0, 1, 2])
    md.VelocityVerlet(reference, TIMESTEP).run(6)
    first = md.VelocityVerlet(images(lj_calc64, [0, 1, 2]), TIMESTEP)
    first.run(3)
    first.write_checkpoint(tmp_path / "md.npz")
    structures = images(lj_calc64, [0, 1, 2])
    again = md.VelocityVerlet(structures, TIMESTEP)
    again.continue_from(tmp_path / "md.npz")
    assert again.nsteps == 3
    again.run(3)
    for mine, theirs in zip(structures, reference, strict=True):
        np.testing.assert_allclose(mine.positions, theirs.positions, atol=1e-10)
        np.testing.assert_allclose(mine.get_momenta(), theirs.get_momenta(), atol=1e-10)
    other = md.VelocityVerlet(images(lj_calc64, [0, 2]), TIMESTEP)
    with pytest.raises(CheckpointError, match="'n_structures' is 3 in the"):
        other.continue_from(tmp_path / "md.npz")
