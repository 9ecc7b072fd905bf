"""``nvalchemi-ase relax``: relax every frame of every input, many at a time.

Writes one multi-frame extxyz in input order: relaxed positions (and cell with
``--cell``), energy (eV), forces (eV/Å), stress (eV/Å³, cells of rank 3), and in
``info``: ``converged`` (bool), ``relax_steps`` (steps until converged, -1 if
not) and ``source`` (``file@frame``).

A structure that fails (non-finite or exploding forces or steps) stops while
the others of its batch go on; it is left out of OUTPUT and written, in its
last finite state, to STEM.failed.extxyz, with a row (input file, frame, step,
reason) in STEM.failures.csv; the exit status is then 1.

Files are written as NAME.partial.EXT, batch by batch (what was computed before
an error or Ctrl-C stays there), and renamed to NAME.EXT when all batches are
done; existing outputs are replaced only with --overwrite, and an output that
is an input is refused. Batches are sized from the model's memory estimate and
the memory free on the device.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nvalchemi_ase.cli.batching import Chunk
    from nvalchemi_ase.cli.outputs import FailureLog, OutputFiles
    from nvalchemi_ase.cli.runs import RunState, StructureOutcome

__all__ = ["OPTIMIZERS", "add_arguments", "run"]

OPTIMIZERS = ("FIRE", "FIRE2", "LBFGS", "BFGS")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the ``relax`` options."""
    from nvalchemi_ase.cli.common import (
        add_batching_options,
        add_model_options,
        add_overwrite_option,
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
        help="relaxed structures, input order (default: relaxed.extxyz); failed "
        "ones go to STEM.failed.extxyz and STEM.failures.csv next to it",
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
    add_overwrite_option(parser)
    add_model_options(parser)
    add_batching_options(parser)


def run(args: argparse.Namespace) -> int:
    """Relax all inputs batch by batch; write and print the results."""
    from nvalchemi_ase.cli._table import RESULT_HEADER, format_table
    from nvalchemi_ase.cli.batching import plan_batches
    from nvalchemi_ase.cli.common import (
        build_calculator,
        expand_inputs,
        read_paths,
        say,
    )
    from nvalchemi_ase.cli.outputs import FailureLog, OutputFiles
    from nvalchemi_ase.cli.runs import RunState

    inputs = expand_inputs(args.files)
    outputs = OutputFiles(inputs, overwrite=args.overwrite)
    output = Path(args.output)
    staged = outputs.claim(output)  # before any work
    failures = FailureLog(
        outputs,
        output.with_name(f"{output.stem}.failed.extxyz"),
        output.with_name(f"{output.stem}.failures.csv"),
    )
    calc = build_calculator(args)  # configuration errors next, before reading
    sources = read_paths(inputs)
    trajectories = _claim_trajectories(args, outputs, len(sources))
    state = RunState(outputs, plan_batches(args, calc, sources))
    plots = _claim_plots(args, outputs, output, len(state.plan.chunks))
    args.run_state = state
    staged.parent.mkdir(parents=True, exist_ok=True)
    rows: list[tuple[str, ...]] = []
    converged = 0
    for chunk in state.plan.chunks:
        with state.batch(chunk):
            chunk_rows, chunk_converged = _relax_chunk(
                args, calc, chunk, state, trajectories, staged, failures, plots
            )
        rows.extend(chunk_rows)
        converged += chunk_converged
    outputs.commit()
    say(args, format_table((*RESULT_HEADER, "converged"), rows))
    failed = (
        f"; {failures.count} failed (see {failures.structures}, {failures.table})"
        if failures.count
        else ""
    )
    say(
        args,
        f"{converged}/{len(sources)} converged to fmax {args.fmax} eV/Å{failed}; "
        f"wrote {output}",
    )
    return 1 if failures.count else 0


def _claim_trajectories(
    args: argparse.Namespace, outputs: OutputFiles, count: int
) -> list[Path] | None:
    """Staged trajectory paths, one per input structure, or None."""
    if not args.trajectories:
        return None
    folder = Path(args.trajectories)
    paths = [outputs.claim(folder / f"{index:05d}.traj") for index in range(count)]
    folder.mkdir(parents=True, exist_ok=True)
    return paths


def _claim_plots(
    args: argparse.Namespace, outputs: OutputFiles, output: Path, chunks: int
) -> list[Path] | None:
    """Staged PNG paths, one per batch (``STEM.png``, ``STEM_1.png``, ...), or None."""
    if not args.plot:
        return None
    return [
        outputs.claim(output.with_name(f"{output.stem}{'' if k == 0 else f'_{k}'}.png"))
        for k in range(chunks)
    ]


def _relax_chunk(
    args: argparse.Namespace,
    calc: Any,
    chunk: Chunk,
    state: RunState,
    trajectories: list[Path] | None,
    staged: Path,
    failures: FailureLog,
    plots: list[Path] | None,
) -> tuple[list[tuple[str, ...]], int]:
    """Relax one batch; write its results and failures; return rows and converged."""
    from ase.filters import FrechetCellFilter

    from nvalchemi_ase.cli.common import show_progress
    from nvalchemi_ase.cli.runs import failed_structures, quiet_failure_warnings
    from nvalchemi_ase.dynamics.recorder import Recorder

    optimizer_class = _optimizer_class(args.optimizer)
    images = [source.atoms.copy() for _, source in chunk.items]
    for atoms in images:
        atoms.calc = calc
    targets = [FrechetCellFilter(atoms) for atoms in images] if args.cell else images
    opt = optimizer_class(
        targets,
        logfile=None,
        trajectory=None
        if trajectories is None
        else [trajectories[index] for index, _ in chunk.items],
        progress=show_progress(args),
    )
    state.dynamics = opt
    recorder = Recorder(opt) if plots is not None else None
    try:
        with quiet_failure_warnings():
            opt.run(fmax=args.fmax, steps=args.steps)
    finally:
        opt.close()
    failed = {f.position: f for f in failed_structures(opt)}
    rows = _write_relaxed(
        args, calc, chunk, images, opt.converged_at_step, failed, staged
    )
    for position, failure in failed.items():
        rows[position] = _record_failure(args, chunk, images, failure, failures)
    if recorder is not None and plots is not None:
        recorder.plot(
            plots[chunk.number - 1],
            title=f"{args.optimizer} relaxation ({len(images)} structures)",
        )
    converged = sum(row[-1] == "yes" for row in rows)
    return rows, converged


def _optimizer_class(name: str) -> Any:
    from nvalchemi_ase import optimize
    from nvalchemi_ase.cli.common import CommandError

    optimizer_class = getattr(optimize, name, None)
    if optimizer_class is None:
        raise CommandError(f"--optimizer {name} is not available in this version")
    return optimizer_class


def _write_relaxed(
    args: argparse.Namespace,
    calc: Any,
    chunk: Chunk,
    images: list[Any],
    steps: Any,
    failed: dict[int, StructureOutcome],
    staged: Path,
) -> list[tuple[str, ...]]:
    """Evaluate and append the structures that did not fail; their table rows.

    Rows of failed structures are placeholders (filled by the caller).
    """
    from ase.calculators.singlepoint import SinglePointCalculator
    from ase.io import write

    from nvalchemi_ase.cli._table import result_row

    keep = [k for k in range(len(images)) if k not in failed]
    rows: list[tuple[str, ...]] = [()] * len(images)
    if not keep:
        return rows
    properties = [
        p for p in ("energy", "forces", "stress") if p in calc.implemented_properties
    ]
    kept = [images[k] for k in keep]
    results = calc.calculate_batch(kept, properties)  # each structure's own results
    for k, atoms, result in zip(keep, kept, results, strict=True):
        source, step = chunk.items[k][1], int(steps[k])
        atoms.calc = SinglePointCalculator(atoms, **result)
        atoms.info.update(converged=step >= 0, relax_steps=step, source=source.label)
        rows[k] = (*result_row(source.label, atoms, result), _yes_no(step >= 0))
    write(staged, kept, format="extxyz", append=True)
    return rows


def _record_failure(
    args: argparse.Namespace,
    chunk: Chunk,
    images: list[Any],
    failure: StructureOutcome,
    failures: FailureLog,
) -> tuple[str, ...]:
    """Write a failed structure to the failures files and report it; its row."""
    from nvalchemi_ase.cli.runs import report

    source = chunk.items[failure.position][1]
    atoms = images[failure.position]
    failures.record(source, atoms, failure.step, failure.reason)
    report(
        args.command,
        f"{source.label} failed at step {failure.step}: {failure.reason}; its last "
        f"finite state goes to {failures.structures}",
    )
    return (
        source.label,
        atoms.get_chemical_formula(),
        str(len(atoms)),
        *(("-",) * 4),
        "FAILED",
    )


def _yes_no(flag: bool) -> str:
    return "yes" if flag else "NO"
