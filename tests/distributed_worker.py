"""One rank of the distributed tests (``torchrun -m tests.distributed_worker``).

``python -m torch.distributed.run --standalone --nproc_per_node=N -m
tests.distributed_worker JOBS FOLDER [COUNT]`` runs each job of ``JOBS``
(comma-separated) in turn, in one launch:

- a runner of :data:`RUNS` (``relax``, ``single_points``, ``md``), with a
  calculator of its own, over :func:`tests.structures.mixed` with the LJ model
  in float64 on the CPU, streaming to ``FOLDER/JOB/out.extxyz``, and writes
  what the list function returned on this rank to
  ``FOLDER/JOB/returned.rankR.extxyz`` (every rank gets every structure);
  ``relax-resumed`` is ``relax`` with ``resume=True`` (into
  ``FOLDER/relax-resumed``, where the test left a killed run's shard files);
- a command line of :data:`CLI` (``cli-relax``, ``cli-md``): the
  ``nvalchemi-ase`` main function (what ``torchrun -m nvalchemi_ase`` calls)
  in ``FOLDER/cli``, writing under ``two``.

The test compares each with a single-process run. One launch runs every job:
each start-up (torchrun and two interpreters importing torch and nvalchemi,
~30 s of CPU) costs more than a run here; the default process group the first
job starts is kept for the later ones, as in a user's script.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

#: Keyword arguments of each runner in these tests (shared with the test).
RUNS = {
    "relax": {"optimizer": "FIRE", "fmax": 0.02, "steps": 400, "max_atoms": 160},
    "single_points": {"properties": ("energy", "forces", "stress"), "max_atoms": 160},
    "md": {
        "dynamics": "VelocityVerlet",
        "timestep": 5.0,  # ASE time units (~0.5 fs)
        "steps": 10,
        "max_atoms": 160,
    },
}
#: Runner jobs that resume a killed run: the runner each runs.
RESUMED = {"relax-resumed": "relax"}

_LJ = ["--model", "lj", "--device", "cpu", "--dtype", "float64"]
#: Command lines run in ``FOLDER/cli`` (inputs ``relax.extxyz``, ``md.extxyz``
#: there), ``{out}`` the output folder: ``two`` under torchrun, ``one`` alone.
CLI = {
    "cli-relax": [
        "relax",
        "relax.extxyz",
        *_LJ,
        "--fmax",
        "0.02",
        "-o",
        "{out}/relaxed.extxyz",
        "--trajectories",
        "{out}/traj",
    ],
    "cli-md": [
        "md",
        "md.extxyz",
        *_LJ,
        "--ensemble",
        "nve",
        "--steps",
        "20",
        "--interval",
        "5",
        "-o",
        "{out}",
    ],
}


def cli_arguments(job: str, out: str) -> list[str]:
    """The command line of ``job`` writing under ``out``."""
    return [argument.replace("{out}", out) for argument in CLI[job]]


def _run_runner(job: str, folder: Path, count: int) -> None:
    from nvalchemi_ase import NVAlchemiCalculator, runners
    from tests.helpers import write_results
    from tests.structures import mixed

    kind = RESUMED.get(job, job)
    (folder / job).mkdir(parents=True, exist_ok=True)
    calc = NVAlchemiCalculator("lj", device="cpu", dtype="float64")
    returned = getattr(runners, kind)(
        mixed(count),
        calc,
        output=folder / job / "out.extxyz",
        resume=job in RESUMED,
        **RUNS[kind],
    )
    rank = os.environ.get("RANK", "0")
    write_results(folder / job / f"returned.rank{rank}.extxyz", returned)


def _run_cli(job: str, folder: Path) -> None:
    from nvalchemi_ase.cli.main import main

    here = Path.cwd()
    os.chdir(folder / "cli")
    try:
        code = main(cli_arguments(job, "two"))
    finally:
        os.chdir(here)
    if code != 0:
        raise SystemExit(f"{job}: exit status {code}")


def main() -> None:
    jobs, folder = sys.argv[1].split(","), Path(sys.argv[2])
    count = int(sys.argv[3]) if len(sys.argv) > 3 else 100
    for job in jobs:
        if job in CLI:
            _run_cli(job, folder)
        else:
            _run_runner(job, folder, count)
        sys.stdout.flush()


if __name__ == "__main__":
    main()
