"""One rank of the stage-pipeline test (``torchrun -m tests.pipeline_worker``).

``python -m torch.distributed.run --standalone --nproc_per_node=2 -m
tests.pipeline_worker OPTIMIZER ORDER FOLDER [LOGINTERVAL] [kick=I]`` takes the
structures of :func:`images` in ``ORDER`` (input indices, e.g. ``1,0,2``) with
the LJ model (float64, CPU), runs ``OPTIMIZER(images) | VelocityVerlet(images, ...)``
(``optimizer.pipe(md, **PIPE)``) and writes what this rank's ``Atoms`` hold
afterwards to ``FOLDER/rank{R}.npz``; the test compares it with the
single-process ``optimizer + md``. With ``LOGINTERVAL`` the pipeline also
writes ``FOLDER/pipe_{i}.traj`` and ``FOLDER/pipe.log`` (``pipe.rank1.log``).
With ``kick=I`` structure ``I`` (position in ``ORDER``) enters MD with one atom
at :data:`KICK` momentum, which moves it further than the failure guard allows
in its first MD step; the failures go to the npz file too. With ``md=NAME``
the MD stage is :func:`integrator`'s ``NAME`` instead of velocity Verlet.
With ``own`` the optimizer writes its own trajectories and log too
(``FOLDER/relax_{i}.traj``, appended to, and ``FOLDER/relax.log``).

Checkpoints: ``restart=NAME`` gives the pipeline ``restart=FOLDER/NAME``
(``interval=K``: ``restart_interval=K``), ``steps=N`` runs ``run(N)`` instead
of ``run(1000)`` (a stop), and ``die=N`` kills both ranks (``SIGKILL``, each
itself) when they have taken step ``N``, before its frames (a kill between
checkpoints). With ``again`` the job calls ``run`` a second time and keeps
what it raised (``again`` in the npz file; "" if nothing). The npz file
also holds the structure-failure warnings the rank saw (``warned``).

Several jobs in one launch: their argument lists joined by ``+``
(``FIRE2 1,0,2 A 1 + FIRE 1,0,2 B 3 + ...``) run one after another, each
into its own folder; the launch then starts the default process group
itself (as a user's script does) and each pipeline only adds its group to
it (one job alone: the pipeline starts and ends the group). A start-up
(torchrun and two interpreters importing torch and nvalchemi) costs more CPU
than a job here. A job with ``die=N`` must come last.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import numpy as np
from ase import units

#: Hand-over threshold (eV/Å) and MD steps per structure, shared with the test.
PIPE = {"fmax": 0.01, "md_steps": 15}
#: Velocity Verlet time step, ASE time units.
TIMESTEP = 2 * units.fs
#: Thermostat targets of the structures by position in ORDER, K (one each).
THERMOSTAT_K = [10.0, 40.0, 80.0]
#: Momentum of the kicked atom, amu Å / ASE time: ~2.9 Å in one 2 fs step of
#: argon, over the failure guard's 2 Å per step.
KICK = 600.0


def images(calc, order):
    """Two rattled argon crystals and an Ar55 cluster, thermalized (30 K)."""
    from tests.structures import cluster, rattled_bulk, thermalize

    structures = [
        rattled_bulk(repeat=2, seed=1, stdev=0.002),  # relaxed after one step
        rattled_bulk(repeat=2, seed=2, stdev=0.12),
        cluster(),
    ]
    for index, atoms in enumerate(structures):
        thermalize(atoms, 30.0, seed=index)
        atoms.calc = calc
    return [structures[index] for index in order]


def integrator(name, structures, targets=None):
    """The MD stage ``name`` over ``structures``: deterministic, one target each.

    ``Langevin`` runs without friction (no noise: the pipeline's MD batch and
    the fused run's draw different noise), with one temperature per
    structure still handed over; ``NVTBerendsen`` couples each structure to
    its own temperature within a few steps (taut 10 fs); ``SeededLangevin``
    is Langevin with friction, its noise seeded (the pipeline's own noise: a
    continued run must draw the same). ``targets``: other temperatures (K, one
    per structure) than :data:`THERMOSTAT_K`.
    """
    from nvalchemi_ase import md

    if targets is None:
        targets = THERMOSTAT_K[: len(structures)]
    if name == "VelocityVerlet":
        return md.VelocityVerlet(structures, TIMESTEP)
    if name == "Langevin":
        return md.Langevin(
            structures, TIMESTEP, temperature_K=targets, friction=0.0, seed=7
        )
    if name == "SeededLangevin":
        return md.Langevin(
            structures, TIMESTEP, temperature_K=targets, friction=0.05, seed=11
        )
    if name == "NVTBerendsen":
        return md.NVTBerendsen(
            structures, TIMESTEP, temperature_K=targets, taut=10 * units.fs
        )
    raise ValueError(f"no MD stage {name!r} here")


def state(structures, stage, relax_steps) -> dict[str, np.ndarray]:
    """What the test compares, as flat arrays (atoms of all structures stacked)."""
    return {
        "positions": np.concatenate([a.positions for a in structures]),
        "momenta": np.concatenate([a.get_momenta() for a in structures]),
        "forces": np.concatenate([a.get_forces() for a in structures]),
        "energies": np.array([a.get_potential_energy() for a in structures]),
        "stage": np.asarray(stage),
        "relax_steps": np.asarray(relax_steps),
    }


def build(arguments, **changes):
    """The structures, pipeline and ``run`` steps of a worker's command line.

    ``arguments``: ``OPTIMIZER ORDER FOLDER [options]`` (see the module
    docstring); ``changes``: other keywords for ``pipe`` (a test builds
    another job in one process).
    """
    from nvalchemi_ase import NVAlchemiCalculator, optimize

    optimizer = getattr(optimize, arguments[0])
    order = [int(index) for index in arguments[1].split(",")]
    folder = Path(arguments[2])
    files: dict = {}
    kicked = None
    stage = "VelocityVerlet"
    steps, die = 1000, None
    own: dict = {}
    for option in arguments[3:]:
        name, _, value = option.partition("=")
        if name == "own":
            own = {
                "trajectory": str(folder / "relax_{i}.traj"),
                "append_trajectory": True,
                "logfile": str(folder / "relax.log"),
            }
        elif name == "kick":
            kicked = int(value)
        elif name == "md":
            stage = value
        elif name == "restart":
            files["restart"] = str(folder / value)
        elif name == "interval":
            files["restart_interval"] = int(value)
        elif name == "steps":
            steps = int(value)
        elif name == "die":
            die = int(value)
        elif name == "again":
            pass  # run_job's
        else:
            files |= {
                "trajectory": str(folder / "pipe_{i}.traj"),
                "logfile": str(folder / "pipe.log"),
                "loginterval": int(option),
            }
    calc = NVAlchemiCalculator("lj", device="cpu", dtype="float64")
    structures = images(calc, order)
    if kicked is not None:
        momenta = structures[kicked].get_momenta()
        momenta[0] = [KICK, 0.0, 0.0]
        structures[kicked].set_momenta(momenta)
    relax = optimizer(structures, **({"logfile": None} | own))
    dynamics = integrator(stage, structures)
    pipeline = relax.pipe(dynamics, **(PIPE | files | changes))
    if die is not None:
        for part in (relax, dynamics):
            part.attach(_killer(part, die))
    return structures, pipeline, steps


#: Separates the jobs of one launch on the command line.
JOIN = "+"


def split_jobs(arguments: list[str]) -> list[list[str]]:
    """The jobs of a command line: argument lists separated by :data:`JOIN`."""
    jobs: list[list[str]] = [[]]
    for argument in arguments:
        if argument == JOIN:
            jobs.append([])
        else:
            jobs[-1].append(argument)
    return jobs


def main() -> None:
    jobs = split_jobs(sys.argv[1:])
    if len(jobs) == 1:  # the pipeline starts and ends the process group
        run_job(jobs[0])
        return
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        for job in jobs:
            run_job(job)
    finally:
        dist.destroy_process_group()


def run_job(arguments: list[str]) -> None:
    """Run one job and write this rank's ``Atoms`` to ``FOLDER/rank{R}.npz``."""
    import warnings

    from nvalchemi_ase.dynamics.failures import StructureFailedWarning

    structures, pipeline, steps = build(arguments)
    folder = Path(arguments[2])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", StructureFailedWarning)
        done = pipeline.run(steps)
    warned = [
        str(w.message) for w in caught if issubclass(w.category, StructureFailedWarning)
    ]
    again = {}
    if "again" in arguments:
        try:
            pipeline.run(steps)
            again["again"] = ""
        except RuntimeError as error:
            again["again"] = str(error)
    rank = os.environ.get("RANK", "0")
    result = state(structures, pipeline.stage, pipeline.relax_steps)
    failures = np.array(
        [(f.index, f.step) for f in pipeline.failures], dtype=np.int64
    ).reshape(-1, 2)
    reasons = np.array([f.reason for f in pipeline.failures], dtype=str)
    np.savez(
        folder / f"rank{rank}.npz",
        done=done,
        nsteps=pipeline.nsteps,
        failures=failures,
        reasons=reasons,
        warned=np.array(warned, dtype=str),
        **again,
        **result,
    )


def _killer(part, step):
    """Observer: SIGKILL this process when ``part`` takes step ``step``."""

    def kill():
        if part.nsteps == step:
            os.kill(os.getpid(), signal.SIGKILL)

    return kill


if __name__ == "__main__":
    main()
