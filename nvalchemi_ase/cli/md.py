"""``nvalchemi-ase md``: batched molecular dynamics of every input structure.

Writes into ``--output-dir``: one ASE trajectory per structure
(``md_NNNNN.traj``, a frame every ``--interval`` steps, with energies and
forces), a log (``md.log``: one line per logged step for the batch), the final
structures (``final.extxyz``) and, with ``--plot``, ``md.png``. Times are given
in fs, temperatures in K, pressures in GPa, friction in 1/fs.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nvalchemi_ase.cli.common import Source

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the ``md`` options."""
    from nvalchemi_ase.cli.common import (
        add_batching_options,
        add_model_options,
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
    add_model_options(parser)
    add_batching_options(parser)


def run(args: argparse.Namespace) -> int:
    """Run MD batch by batch and write trajectories, logs and final structures."""
    from ase.io import write

    from nvalchemi_ase.cli.common import batches, build_calculator, read_sources, say

    if args.temperature < 0:
        from nvalchemi_ase.cli.common import CommandError

        raise CommandError(f"--temperature must be >= 0 K, got {args.temperature}")
    calc = build_calculator(args)  # configuration errors first, before reading
    sources = read_sources(args.files)
    folder = Path(args.output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / "final.extxyz"
    final.unlink(missing_ok=True)
    (folder / "md.log").unlink(missing_ok=True)
    for number, chunk in enumerate(batches(sources, args.batch_size, args.max_atoms)):
        images = _run_chunk(args, calc, chunk, folder, number)
        write(final, images, format="extxyz", append=True)
    say(
        args,
        f"{len(sources)} structures, {args.steps} steps of {args.timestep} fs "
        f"({args.ensemble.upper()}); outputs in {folder}/",
    )
    return 0


def _run_chunk(
    args: argparse.Namespace,
    calc: Any,
    chunk: list[tuple[int, Source]],
    folder: Path,
    number: int,
) -> list[Any]:
    import numpy as np
    from ase.calculators.singlepoint import SinglePointCalculator

    from nvalchemi_ase.cli.common import show_progress
    from nvalchemi_ase.dynamics.recorder import Recorder

    images = [source.atoms.copy() for _, source in chunk]
    rng = np.random.default_rng(args.seed + number)
    for atoms in images:
        atoms.calc = calc
        if "momenta" not in atoms.arrays and args.temperature > 0:
            _thermalize(atoms, args.temperature, rng)
    dyn = _dynamics(args, images, rng)(
        trajectory=[folder / f"md_{index:05d}.traj" for index, _ in chunk],
        logfile=str(folder / "md.log"),
        loginterval=args.interval,
        progress=show_progress(args),
    )
    recorder = Recorder(dyn, args.interval) if args.plot else None
    dyn.run(args.steps)
    for (_, source), atoms in zip(chunk, images, strict=True):
        result = {k: v for k, v in atoms.calc.results.items()}
        atoms.calc = SinglePointCalculator(atoms, **result)
        atoms.info["source"] = source.label
    if recorder is not None:
        suffix = "" if number == 0 else f"_{number}"
        recorder.plot(
            folder / f"md{suffix}.png",
            title=f"{args.ensemble.upper()} MD ({len(images)} structures)",
        )
    return images


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
