"""``nvalchemi-ase md``: batched molecular dynamics of every input structure.

Runs :func:`nvalchemi_ase.runners.imd`: consecutive inputs in batches sized
from the model's memory estimate and the memory free on the device, one
batched MD run each; inputs are read one frame at a time (once first, to check
every frame before any model call). Writes into ``--output-dir``: one ASE
trajectory per structure (``md_NNNNN.traj``, NNNNN the input position, a frame
every ``--interval`` steps, with energies and forces), a log (``md.log``: one
line per logged step for each batch), the final structures with each one's own
energy, forces and stress (``final.extxyz``, input order, ``info["source"]`` =
``file@frame``) and, with ``--plot``, ``md.png``. Times are given in fs,
temperatures in K, pressures in GPa, friction in 1/fs. A structure without
momenta starts from a Maxwell-Boltzmann draw of its own (seeded by --seed and
its input position); a Langevin batch's noise is seeded by --seed and the
batch's position.

A structure that fails (non-finite state, exploding forces or steps) stops
while the others go on; it is left out of final.extxyz and written, in its last
finite state, to failed.extxyz with a row (input file, frame, step, reason) in
failures.csv; the exit status is then 1.

Files are written as NAME.partial.EXT, batch by batch (what was computed before
an error, Ctrl-C or a killed job stays there; --resume continues from it: a
batch cut short is run again whole, so with the same options every number is
that of an uninterrupted run), and renamed to NAME.EXT when all batches are
done; existing outputs are replaced only with --overwrite, and an output that
is an input is refused.

Preemption: the batch in flight writes checkpoint.npz in the output folder
every --checkpoint-every steps (default 100), atomically; it is removed once
that batch's structures are in final.partial.extxyz. SIGTERM or SIGINT (a
scheduler's preemption, Ctrl-C) stops the run at the next step: the
checkpoint of that step is written, every file flushed and closed, one line
says where the run stopped, and the exit status is 75 (EX_TEMPFAIL, for a job
script to requeue on). --restart continues: finished structures are kept (as
--resume) and the batch in flight goes on from the checkpoint, so the final
structures and every trajectory frame are those of an uninterrupted run (a
run killed without warning continues from its last periodic checkpoint, the
frames written after it cut). On a fresh output folder --restart starts
afresh, so a job script can always pass it. md.log continues too (no header
or line twice: lines logged after the checkpoint are cut), and --plot shows
what this command ran (a continued batch from its checkpoint on).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence

    from nvalchemi_ase.cli.outputs import OutputFiles
    from nvalchemi_ase.md.schedules import PiecewiseLinear

__all__ = ["CHECKPOINT_NAME", "STOPS_ON_SIGNALS", "add_arguments", "run"]

#: The checkpoint of the batch in flight, in the output folder.
CHECKPOINT_NAME = "checkpoint.npz"

#: SIGTERM/SIGINT stop the run at a step boundary (exit status 75; cli.signals).
STOPS_ON_SIGNALS = True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the ``md`` options."""
    from nvalchemi_ase.cli.common import positive_float, positive_int
    from nvalchemi_ase.cli.runs import add_run_options

    parser.add_argument("files", nargs="+", help="structure files (globs, file@slice)")
    parser.add_argument(
        "--ensemble", choices=("nve", "nvt", "npt"), default="nvt", help="default: nvt"
    )
    parser.add_argument(
        "--thermostat",
        choices=("langevin", "nose-hoover"),
        default="langevin",
        help="NVT thermostat (default: langevin)",
    )
    parser.add_argument(
        "--temperature",
        type=temperature_argument,
        default=300.0,
        help="target and initial temperature, K (default: 300); structures without "
        "momenta start from a Maxwell-Boltzmann draw at it (at step 0). A ramp: "
        "START:END (K, linear over --steps, e.g. 300:1200) or STEP:K pairs "
        "interpolated linearly (e.g. 0:300,1000:1200,2000:300)",
    )
    parser.add_argument(
        "--timestep",
        type=positive_float,
        default=1.0,
        help="time step, fs (default: 1)",
    )
    parser.add_argument(
        "--steps", type=positive_int, default=1000, help="default: 1000"
    )
    parser.add_argument(
        "--interval",
        type=positive_int,
        default=10,
        help="steps between trajectory frames and log lines (default: 10)",
    )
    parser.add_argument(
        "--friction",
        type=positive_float,
        default=0.01,
        help="Langevin friction, 1/fs (default: 0.01)",
    )
    parser.add_argument(
        "--tdamp",
        type=positive_float,
        default=100.0,
        help="thermostat time constant, fs (Nose-Hoover, NPT; default: 100)",
    )
    parser.add_argument(
        "--pdamp",
        type=positive_float,
        default=1000.0,
        help="barostat time constant, fs (NPT; default: 1000)",
    )
    parser.add_argument(
        "--pressure",
        type=float,
        default=0.0,
        help="NPT target pressure, GPa (default: 0)",
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    parser.add_argument(
        "-o",
        "--output-dir",
        default="md-output",
        help="output folder (default: md-output)",
    )
    parser.add_argument(
        "--plot",
        action="store_true",
        help="write md.png: energy, temperature and pressure of every structure "
        "run by this command",
    )
    add_run_options(parser)


def run(args: argparse.Namespace) -> int:
    """Run MD batch by batch and write trajectories, logs and final structures."""
    from ase import units

    from nvalchemi_ase.cli.common import CommandError, say
    from nvalchemi_ase.cli.runs import run_structures, staged_outputs
    from nvalchemi_ase.runners import imd

    temperature = temperature_schedule(args.temperature, args.steps)
    kelvins = args.temperature if temperature is None else temperature.table.min()
    if kelvins < 0:
        raise CommandError(f"--temperature must be >= 0 K, got {args.temperature}")
    start_K = args.temperature if temperature is None else float(temperature(0))
    inputs, outputs = staged_outputs(args)
    folder = Path(args.output_dir)
    files = _Files(
        outputs, folder, plot=args.plot, ranks=_ranks(args), ensemble=args.ensemble
    )  # first
    dynamics, parameters = _dynamics(args)
    finished = run_structures(
        args,
        imd,
        inputs,
        outputs,
        files,
        lambda paths: _thermalized(paths, start_K, args.seed),
        dynamics=dynamics,
        timestep=args.timestep * units.fs,
        steps=args.steps,
        logfile=files.log,
        loginterval=args.interval,
        **parameters,
    )
    if finished is None:
        return 0  # not rank 0
    failed = finished.failed
    note = f"; {failed} failed (see {files.table_final})" if failed else ""
    say(
        args,
        f"{len(finished.inputs)} structures, {args.steps} steps of {args.timestep} "
        f"fs ({args.ensemble.upper()}){note}; outputs in {folder}/",
    )
    return 1 if failed else 0


class _Files:
    """Staged output paths of an MD run (claimed before any work).

    Under ``torchrun`` rank ``r > 0`` logs to ``md.rank<r>.log``: the runner
    writes it next to the staged log, and :meth:`stage_rank_logs` gives it
    its staged name before the outputs are moved into place.
    """

    def __init__(
        self,
        outputs: OutputFiles,
        folder: Path,
        *,
        plot: bool,
        ranks: int = 1,
        ensemble: str = "nvt",
    ) -> None:
        self.folder = folder
        self.ensemble = ensemble
        self.failed_final = folder / "failed.extxyz"
        self.table_final = folder / "failures.csv"
        #: The checkpoint of the batch in flight (not staged: the runner removes it).
        self.checkpoint = folder / CHECKPOINT_NAME
        self.output = outputs.claim(folder / "final.extxyz")
        self.log = outputs.claim(folder / "md.log")
        self.rank_logs = [
            outputs.claim(folder / f"md.rank{rank}.log") for rank in range(1, ranks)
        ]
        self.failed = outputs.claim(self.failed_final)
        self.table = outputs.claim(self.table_final)
        self.plot = outputs.claim(folder / "md.png") if plot else None

    def claim_trajectories(self, outputs: OutputFiles, count: int) -> str:
        """Claim one trajectory per input structure; the runner's staged template."""
        from nvalchemi_ase.cli.outputs import partial_name

        for index in range(count):
            outputs.claim(self.folder / f"md_{index:05d}.traj")
        return str(partial_name(self.folder / "md_{i:05d}.traj"))

    def finish(self, series: dict[int, Any] | None, labels: Sequence[str]) -> int:
        """Stage the rank logs, write the failure table and plot; failures."""
        from nvalchemi_ase.cli.outputs import write_failure_table

        self.stage_rank_logs()
        failed = write_failure_table(self.failed, self.table)
        if self.plot is not None and series:
            _plot(series, labels, self.plot, self.ensemble)
        return failed

    def stage_rank_logs(self) -> None:
        """Move the logs of ranks 1.. from the runner's names to their staged ones."""
        from nvalchemi_ase.runners.distributed import shard_path

        for rank, staged in enumerate(self.rank_logs, start=1):
            written = shard_path(self.log, rank)
            if written.exists():
                os.replace(written, staged)


def _ranks(args: argparse.Namespace) -> int:
    """Ranks of this run (1 unless launched by ``torchrun``)."""
    shard = getattr(args, "shard", None)
    return 1 if shard is None else int(shard.size)


def _thermalized(
    paths: Sequence[str], temperature_K: float, seed: int
) -> Iterator[Any]:
    """Yield the inputs one at a time, momenta drawn at ``temperature_K`` if missing.

    Each structure's draw is seeded by ``seed`` and its input position alone,
    so it does not depend on the batches (a resumed run draws the same).
    """
    import numpy as np

    from nvalchemi_ase.cli.batching import labelled_atoms

    for index, atoms in enumerate(labelled_atoms(paths)):
        if "momenta" not in atoms.arrays and temperature_K > 0:
            _thermalize(atoms, temperature_K, np.random.default_rng([seed, index]))
        yield atoms


def _thermalize(atoms: Any, temperature_K: float, rng: Any) -> None:
    from ase.md import velocitydistribution

    if hasattr(velocitydistribution, "thermalize_momenta"):
        velocitydistribution.thermalize_momenta(atoms, temperature_K, rng=rng)
    else:  # ASE < 3.29
        velocitydistribution.MaxwellBoltzmannDistribution(
            atoms, temperature_K=temperature_K, rng=rng
        )


def temperature_argument(text: str) -> float | tuple[tuple[float, float], ...]:
    """Argparse type of ``--temperature``: K, ``START:END`` or ``STEP:K,...``.

    Returns
    -------
    float or tuple of (float, float)
        A temperature, K; or the pairs given: one pair is a ramp (start K,
        end K) over the run, several are ``(step, K)`` points.
    """
    if ":" not in text:
        return float(text)
    try:
        pairs = tuple(
            (float(first), float(second))
            for first, second in (item.split(":") for item in text.split(","))
        )
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give K, START:END (a ramp over the run, K) or STEP:K pairs "
            "separated by commas"
        ) from None
    return pairs


def temperature_schedule(value: Any, steps: int) -> PiecewiseLinear | None:
    """``--temperature`` as a schedule (None for one temperature).

    Parameters
    ----------
    value : float or tuple of (float, float)
        What :func:`temperature_argument` returned.
    steps : int
        ``--steps``: a ``START:END`` ramp ends at the last step.

    Returns
    -------
    PiecewiseLinear or None
    """
    from nvalchemi_ase.cli.common import CommandError
    from nvalchemi_ase.md.schedules import piecewise_linear

    if not isinstance(value, tuple):
        return None
    points = [(0, value[0][0]), (steps, value[0][1])] if len(value) == 1 else value
    try:
        return piecewise_linear([(int(step), kelvin) for step, kelvin in points])
    except ValueError as error:
        raise CommandError(f"--temperature: {error}") from None


def _dynamics(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    """Return the ``nvalchemi_ase.md`` class name and its keyword arguments."""
    from ase import units

    temperature = temperature_schedule(args.temperature, args.steps)
    if temperature is None:
        temperature = args.temperature

    if args.ensemble == "nve":
        return "VelocityVerlet", {}
    if args.ensemble == "npt":
        return "IsotropicMTKNPT", {
            "temperature_K": temperature,
            "pressure_au": args.pressure * units.GPa,
            "tdamp": args.tdamp * units.fs,
            "pdamp": args.pdamp * units.fs,
        }
    if args.thermostat == "nose-hoover":
        return "NoseHooverChainNVT", {
            "temperature_K": temperature,
            "tdamp": args.tdamp * units.fs,
        }
    return "Langevin", {
        "temperature_K": temperature,
        "friction": args.friction / units.fs,
        "seed": args.seed,
    }


def _plot(
    series: dict[int, Any], labels: Sequence[str], path: Path, ensemble: str
) -> None:
    """Every structure run by this command in one figure.

    Structures share the steps of one grid (the union of their samples); a
    batch continued from a checkpoint (``--restart``) has samples only from
    its checkpoint on, NaN (a gap in its lines) before.
    """
    import numpy as np

    from nvalchemi_ase import plotting

    indices = sorted(series)
    steps = np.unique(np.concatenate([series[i]["step"] for i in indices]))
    arrays: dict[str, Any] = {"step": steps, "time_ps": np.full(len(steps), np.nan)}
    for column, index in enumerate(indices):
        rows = np.searchsorted(steps, series[index]["step"])
        arrays["time_ps"][rows] = series[index]["time_ps"]
        for key, values in series[index].items():
            if key in ("step", "time_ps"):
                continue
            grid = arrays.setdefault(key, np.full((len(steps), len(indices)), np.nan))
            grid[rows, column] = values
    plotting.plot_md(
        arrays,
        path,
        title=f"{ensemble.upper()} MD ({len(indices)} structures)",
        labels=[labels[i] for i in indices],
    )
