"""``nvalchemi-ase relax``: relax every frame of every input, many at a time.

Writes one multi-frame extxyz in input order: relaxed positions (and cell with
``--cell``), energy (eV), forces (eV/Å), stress (eV/Å³, cells of rank 3), and in
``info``: ``converged`` (bool), ``relax_steps`` (steps until converged, -1 if
not) and ``source`` (``file@frame``). Chunks are appended as they finish, so
what was computed before an error stays on disk.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nvalchemi_ase.cli.common import Source

__all__ = ["OPTIMIZERS", "add_arguments", "run"]

OPTIMIZERS = ("FIRE", "FIRE2", "LBFGS", "BFGS")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the ``relax`` options."""
    from nvalchemi_ase.cli.common import (
        add_batching_options,
        add_model_options,
        positive_float,
        positive_int,
    )

    parser.add_argument("files", nargs="+", help="structure files (globs, file@slice)")
    parser.add_argument(
        "--fmax",
        type=positive_float,
        default=0.05,
        help="convergence threshold on the largest force, eV/Å (default: 0.05)",
    )
    parser.add_argument(
        "--optimizer", choices=OPTIMIZERS, default="FIRE", help="default: FIRE"
    )
    parser.add_argument(
        "--steps",
        type=positive_int,
        default=1000,
        help="step limit per batch (default: 1000)",
    )
    parser.add_argument(
        "--cell",
        action="store_true",
        help="relax the cell too (ASE's FrechetCellFilter; FIRE2, LBFGS, BFGS)",
    )
    parser.add_argument(
        "-o",
        "--output",
        default="relaxed.extxyz",
        help="relaxed structures, input order (default: relaxed.extxyz)",
    )
    parser.add_argument(
        "--trajectories",
        metavar="DIR",
        default=None,
        help="also write one ASE trajectory per structure into DIR (NNNNN.traj)",
    )
    parser.add_argument(
        "--plot",
        action="store_true",
        help="write energy and fmax against step as PNG next to the output",
    )
    add_model_options(parser)
    add_batching_options(parser)


def run(args: argparse.Namespace) -> int:
    """Relax all inputs batch by batch; write and print the results."""
    from nvalchemi_ase.cli._table import RESULT_HEADER, format_table, result_row
    from nvalchemi_ase.cli.common import batches, build_calculator, read_sources, say

    calc = build_calculator(args)  # configuration errors first, before reading
    sources = read_sources(args.files)
    output = Path(args.output)
    output.unlink(missing_ok=True)
    trajectory_dir = Path(args.trajectories) if args.trajectories else None
    if trajectory_dir is not None:
        trajectory_dir.mkdir(parents=True, exist_ok=True)
    rows: list[tuple[str, ...]] = []
    converged = 0
    for number, chunk in enumerate(batches(sources, args.batch_size, args.max_atoms)):
        images, results = _relax_chunk(
            args, calc, chunk, trajectory_dir, output, number
        )
        converged += sum(bool(atoms.info["converged"]) for atoms in images)
        rows.extend(
            (*result_row(source.label, atoms, result), _yes_no(atoms.info["converged"]))
            for (_, source), atoms, result in zip(chunk, images, results, strict=True)
        )
    say(args, format_table((*RESULT_HEADER, "converged"), rows))
    say(
        args,
        f"{converged}/{len(sources)} converged to fmax {args.fmax} eV/Å; "
        f"wrote {output}",
    )
    return 0


def _relax_chunk(
    args: argparse.Namespace,
    calc: Any,
    chunk: list[tuple[int, Source]],
    trajectory_dir: Path | None,
    output: Path,
    number: int,
) -> tuple[list[Any], list[dict[str, Any]]]:
    from ase.calculators.singlepoint import SinglePointCalculator
    from ase.filters import FrechetCellFilter
    from ase.io import write

    from nvalchemi_ase import optimize
    from nvalchemi_ase.cli.common import CommandError, show_progress
    from nvalchemi_ase.dynamics.recorder import Recorder

    optimizer_class = getattr(optimize, args.optimizer, None)
    if optimizer_class is None:
        raise CommandError(
            f"--optimizer {args.optimizer} is not available in this version"
        )
    images = [source.atoms.copy() for _, source in chunk]
    for atoms in images:
        atoms.calc = calc
    targets = [FrechetCellFilter(atoms) for atoms in images] if args.cell else images
    trajectory = (
        [trajectory_dir / f"{index:05d}.traj" for index, _ in chunk]
        if trajectory_dir is not None
        else None
    )
    opt = optimizer_class(
        targets, logfile=None, trajectory=trajectory, progress=show_progress(args)
    )
    recorder = Recorder(opt) if args.plot else None
    opt.run(fmax=args.fmax, steps=args.steps)
    steps = opt.converged_at_step
    properties = [
        p for p in ("energy", "forces", "stress") if p in calc.implemented_properties
    ]
    results = calc.calculate_batch(images, properties)
    for (_, source), atoms, result, step in zip(
        chunk, images, results, steps, strict=True
    ):
        atoms.calc = SinglePointCalculator(atoms, **result)
        atoms.info.update(
            converged=bool(step >= 0), relax_steps=int(step), source=source.label
        )
    write(output, images, format="extxyz", append=True)
    if recorder is not None:
        suffix = "" if number == 0 else f"_{number}"
        recorder.plot(
            output.with_name(f"{output.stem}{suffix}.png"),
            title=f"{args.optimizer} relaxation ({len(images)} structures)",
        )
    return images, results


def _yes_no(flag: bool) -> str:
    return "yes" if flag else "NO"
