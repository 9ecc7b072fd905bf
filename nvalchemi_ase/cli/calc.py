"""``nvalchemi-ase calc``: single points for every frame of every input, batched.

Runs :func:`nvalchemi_ase.runners.isingle_points`: consecutive inputs in
batches sized from the model's memory estimate and the memory free on the
device, one model call each; inputs are read one frame at a time (once first,
to check every frame before any model call). Energies in eV, forces in eV/Å,
stress in eV/Å³ (ASE's Voigt order and sign, for cells of rank 3); ``info``
``index`` (input position) and ``source`` (``file@frame``).

Results are appended to OUTPUT.partial.extxyz batch by batch (what was
computed before an error, Ctrl-C or a killed job stays there; --resume
continues from it) and renamed to OUTPUT when all inputs are done; an existing
OUTPUT is replaced only with --overwrite, and an OUTPUT that is an input is
refused.
"""

from __future__ import annotations

import argparse

#: SIGTERM/SIGINT end the run cleanly (exit status 75; see cli.signals).
STOPS_ON_SIGNALS = True

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the ``calc`` options."""
    from nvalchemi_ase.cli.common import (
        add_batching_options,
        add_model_options,
        add_overwrite_option,
        add_resume_option,
    )

    parser.add_argument("files", nargs="+", help="structure files (globs, file@slice)")
    parser.add_argument(
        "-o",
        "--output",
        default="calc.extxyz",
        help="extxyz with energy, forces and stress per frame (default: calc.extxyz)",
    )
    add_overwrite_option(parser)
    add_resume_option(parser)
    add_model_options(parser)
    add_batching_options(parser)


def run(args: argparse.Namespace) -> int:
    """Evaluate all inputs and write and print the results."""
    from pathlib import Path

    from ase.io import iread

    from nvalchemi_ase.cli._table import RESULT_HEADER, format_table, result_row
    from nvalchemi_ase.cli.batching import labelled_atoms, scan_inputs
    from nvalchemi_ase.cli.common import (
        build_calculator,
        expand_inputs,
        result_properties,
        say,
    )
    from nvalchemi_ase.cli.outputs import OutputFiles
    from nvalchemi_ase.cli.runs import RunState, on_root, resumed
    from nvalchemi_ase.runners import isingle_points, sort_output

    args.resume = args.resume or args.restart  # in-flight work starts again
    inputs = expand_inputs(args.files)
    outputs = OutputFiles(inputs, overwrite=args.overwrite, resume=args.resume)
    output = Path(args.output)
    staged = outputs.claim(output)  # before any work
    failed = outputs.claim(output.with_name(f"{output.stem}.failed.extxyz"))
    calc = build_calculator(args)  # configuration errors next, before reading
    scanned = scan_inputs(inputs, calc, args, skin=0.0)  # checked, none kept
    done = resumed(args, staged, failed, scanned)
    state = RunState(
        outputs, scanned, done=done, signals=getattr(args, "signals", None)
    )
    args.run_state = state
    staged.parent.mkdir(parents=True, exist_ok=True)
    with state.running():
        for _ in isingle_points(
            labelled_atoms(inputs),
            calc,
            properties=result_properties(calc),
            max_atoms=args.max_atoms,
            max_structures=scanned.budget.max_structures,
            output=staged,
            failures=failed,
            resume=args.resume,
        ):
            state.done += 1
    if not on_root(args):
        return 0  # rank 0 moves the merged output into place and prints
    sort_output(staged)  # in input order already; a no-op check
    with state.finishing():  # a signal now waits: the run is complete
        outputs.commit()
    if not getattr(args, "quiet", False):
        rows = [
            result_row(str(atoms.info["source"]), atoms, atoms.calc.results)
            for atoms in iread(output, index=":")
        ]
        say(args, format_table(RESULT_HEADER, rows))
    say(args, f"wrote {len(scanned)} frames with results to {output}")
    return 0
