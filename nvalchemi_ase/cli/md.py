"""``nvalchemi-ase md``: batched molecular dynamics of every input structure.

Writes into ``--output-dir``: one ASE trajectory per structure
(``md_NNNNN.traj``, a frame every ``--interval`` steps, with energies and
forces), a log (``md.log``: one line per logged step for the batch), the final
structures with each one's own energy, forces and stress (``final.extxyz``,
input order, ``info["source"]`` = ``file@frame``) and, with ``--plot``,
``md.png``. Times are given in fs, temperatures in K, pressures in GPa,
friction in 1/fs.

A structure that fails (non-finite state, exploding forces or steps) stops
while the others go on; it is left out of final.extxyz and written, in its last
finite state, to failed.extxyz with a row (input file, frame, step, reason) in
failures.csv; the exit status is then 1.

Files are written as NAME.partial.EXT, batch by batch (what was computed before
an error or Ctrl-C stays there), and renamed to NAME.EXT when all batches are
done; existing outputs are replaced only with --overwrite, and an output that
is an input is refused. Batches are sized from the model's memory estimate and
the memory free on the device.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nvalchemi_ase.cli.batching import Chunk
    from nvalchemi_ase.cli.outputs import FailureLog, OutputFiles
    from nvalchemi_ase.cli.runs import RunState, StructureOutcome

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the ``md`` options."""
    from nvalchemi_ase.cli.common import (
        add_batching_options,
        add_model_options,
        add_overwrite_option,
        positive_float,
        positive_int,
    )

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
        type=float,
        default=300.0,
        help="target and initial temperature, K (default: 300); structures without "
        "momenta start from a Maxwell-Boltzmann draw at it",
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
    parser.add_argument("--plot", action="store_true", help="write md.png")
    add_overwrite_option(parser)
    add_model_options(parser)
    add_batching_options(parser)


def run(args: argparse.Namespace) -> int:
    """Run MD batch by batch and write trajectories, logs and final structures."""
    from nvalchemi_ase.cli.batching import plan_batches
    from nvalchemi_ase.cli.common import (
        CommandError,
        build_calculator,
        expand_inputs,
        read_paths,
        say,
    )
    from nvalchemi_ase.cli.outputs import FailureLog, OutputFiles
    from nvalchemi_ase.cli.runs import RunState

    if args.temperature < 0:
        raise CommandError(f"--temperature must be >= 0 K, got {args.temperature}")
    inputs = expand_inputs(args.files)
    outputs = OutputFiles(inputs, overwrite=args.overwrite)
    folder = Path(args.output_dir)
    files = _Files(
        final=outputs.claim(folder / "final.extxyz"),  # before any work
        log=outputs.claim(folder / "md.log"),
        failures=FailureLog(outputs, folder / "failed.extxyz", folder / "failures.csv"),
    )
    calc = build_calculator(args)  # configuration errors next, before reading
    sources = read_paths(inputs)
    files.trajectories = [
        outputs.claim(folder / f"md_{index:05d}.traj") for index in range(len(sources))
    ]
    state = RunState(outputs, plan_batches(args, calc, sources))
    files.plots = _claim_plots(args, outputs, folder, len(state.plan.chunks))
    args.run_state = state
    folder.mkdir(parents=True, exist_ok=True)
    for chunk in state.plan.chunks:
        with state.batch(chunk):
            _run_chunk(args, calc, chunk, state, files)
    outputs.commit()
    failed = files.failures.count
    note = f"; {failed} failed (see {files.failures.table})" if failed else ""
    say(
        args,
        f"{len(sources)} structures, {args.steps} steps of {args.timestep} fs "
        f"({args.ensemble.upper()}){note}; outputs in {folder}/",
    )
    return 1 if failed else 0


@dataclass
class _Files:
    """Staged output paths of an MD run."""

    final: Path
    log: Path
    failures: FailureLog
    trajectories: list[Path] = field(default_factory=list)
    plots: list[Path] | None = None


def _claim_plots(
    args: argparse.Namespace, outputs: OutputFiles, folder: Path, chunks: int
) -> list[Path] | None:
    """Staged PNG paths, one per batch (``md.png``, ``md_1.png``, ...), or None."""
    if not args.plot:
        return None
    return [
        outputs.claim(folder / f"md{'' if k == 0 else f'_{k}'}.png")
        for k in range(chunks)
    ]


def _run_chunk(
    args: argparse.Namespace,
    calc: Any,
    chunk: Chunk,
    state: RunState,
    files: _Files,
) -> None:
    import numpy as np

    from nvalchemi_ase.cli.common import show_progress
    from nvalchemi_ase.cli.runs import failed_structures, quiet_failure_warnings
    from nvalchemi_ase.dynamics.recorder import Recorder

    images = [source.atoms.copy() for _, source in chunk.items]
    rng = np.random.default_rng(args.seed + chunk.number - 1)
    for atoms in images:
        atoms.calc = calc
        if "momenta" not in atoms.arrays and args.temperature > 0:
            _thermalize(atoms, args.temperature, rng)
    dyn = _dynamics(args, images, rng)(
        trajectory=[files.trajectories[index] for index, _ in chunk.items],
        logfile=str(files.log),
        loginterval=args.interval,
        progress=show_progress(args),
    )
    state.dynamics = dyn
    recorder = Recorder(dyn, args.interval) if files.plots is not None else None
    try:
        with quiet_failure_warnings():
            dyn.run(args.steps)
    finally:
        dyn.close()
    failed = {f.position: f for f in failed_structures(dyn)}
    _write_final(calc, chunk, images, set(failed), files.final)
    for position, failure in failed.items():
        _record_failure(args, chunk, images[position], failure, files.failures)
    if recorder is not None and files.plots is not None:
        recorder.plot(
            files.plots[chunk.number - 1],
            title=f"{args.ensemble.upper()} MD ({len(images)} structures)",
        )


def _write_final(
    calc: Any, chunk: Chunk, images: list[Any], failed: set[int], path: Path
) -> None:
    """Append the final state of every structure that did not fail.

    Each frame gets its own energy, forces (and stress for cells of rank 3)
    from one batched evaluation of the final states, held by a
    ``SinglePointCalculator`` of its own.
    """
    from ase.calculators.singlepoint import SinglePointCalculator
    from ase.io import write

    keep = [k for k in range(len(images)) if k not in failed]
    if not keep:
        return
    properties = [
        p for p in ("energy", "forces", "stress") if p in calc.implemented_properties
    ]
    kept = [images[k] for k in keep]
    results = calc.calculate_batch(kept, properties)
    for k, atoms, result in zip(keep, kept, results, strict=True):
        atoms.calc = SinglePointCalculator(atoms, **result)
        atoms.info["source"] = chunk.items[k][1].label
    write(path, kept, format="extxyz", append=True)


def _record_failure(
    args: argparse.Namespace,
    chunk: Chunk,
    atoms: Any,
    failure: StructureOutcome,
    failures: FailureLog,
) -> None:
    """Write a failed structure to the failures files and report it."""
    from nvalchemi_ase.cli.runs import report

    source = chunk.items[failure.position][1]
    failures.record(source, atoms, failure.step, failure.reason)
    report(
        args.command,
        f"{source.label} failed at step {failure.step}: {failure.reason}; its last "
        f"finite state goes to {failures.structures}",
    )


def _thermalize(atoms: Any, temperature_K: float, rng: Any) -> None:
    from ase.md import velocitydistribution

    if hasattr(velocitydistribution, "thermalize_momenta"):
        velocitydistribution.thermalize_momenta(atoms, temperature_K, rng=rng)
    else:  # ASE < 3.29
        velocitydistribution.MaxwellBoltzmannDistribution(
            atoms, temperature_K=temperature_K, rng=rng
        )


def _dynamics(args: argparse.Namespace, images: list[Any], rng: Any) -> Any:
    """Bind the chosen integrator to the structures; keyword arguments follow."""
    import functools

    from ase import units

    from nvalchemi_ase import md

    timestep = args.timestep * units.fs
    if args.ensemble == "nve":
        return functools.partial(md.VelocityVerlet, images, timestep)
    if args.ensemble == "npt":
        return functools.partial(
            md.IsotropicMTKNPT,
            images,
            timestep,
            args.temperature,
            args.pressure * units.GPa,
            args.tdamp * units.fs,
            args.pdamp * units.fs,
        )
    if args.thermostat == "nose-hoover":
        return functools.partial(
            md.NoseHooverChainNVT,
            images,
            timestep,
            args.temperature,
            args.tdamp * units.fs,
        )
    return functools.partial(
        md.Langevin,
        images,
        timestep,
        args.temperature,
        args.friction / units.fs,
        seed=int(rng.integers(2**31 - 1)),
    )
