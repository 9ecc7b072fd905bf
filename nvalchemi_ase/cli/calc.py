"""``nvalchemi-ase calc``: single points for every frame of every input, batched.

Energies in eV, forces in eV/Å, stress in eV/Å³ (ASE's Voigt order and sign,
for cells of rank 3). Results are appended to OUTPUT.partial.extxyz batch by
batch (what was computed before an error or Ctrl-C stays there) and renamed to
OUTPUT when all inputs are done; an existing OUTPUT is replaced only with
--overwrite, and an OUTPUT that is an input is refused. Batches are sized from
the model's memory estimate and the memory free on the device.
"""

from __future__ import annotations

import argparse

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the ``calc`` options."""
    from nvalchemi_ase.cli.common import (
        add_batching_options,
        add_model_options,
        add_overwrite_option,
    )

    parser.add_argument("files", nargs="+", help="structure files (globs, file@slice)")
    parser.add_argument(
        "-o",
        "--output",
        default="calc.extxyz",
        help="extxyz with energy, forces and stress per frame (default: calc.extxyz)",
    )
    add_overwrite_option(parser)
    add_model_options(parser)
    add_batching_options(parser)


def run(args: argparse.Namespace) -> int:
    """Evaluate all inputs and write and print the results."""
    from pathlib import Path

    from ase.calculators.singlepoint import SinglePointCalculator
    from ase.io import write

    from nvalchemi_ase.cli._table import RESULT_HEADER, format_table, result_row
    from nvalchemi_ase.cli.batching import plan_batches
    from nvalchemi_ase.cli.common import (
        build_calculator,
        expand_inputs,
        read_paths,
        say,
    )
    from nvalchemi_ase.cli.outputs import OutputFiles
    from nvalchemi_ase.cli.runs import RunState

    inputs = expand_inputs(args.files)
    outputs = OutputFiles(inputs, overwrite=args.overwrite)
    output = Path(args.output)
    staged = outputs.claim(output)  # before any work
    calc = build_calculator(args)  # configuration errors next, before reading
    sources = read_paths(inputs)
    properties = ["energy", "forces"] + (
        ["stress"] if "stress" in calc.implemented_properties else []
    )
    state = RunState(outputs, plan_batches(args, calc, sources))
    args.run_state = state
    rows: list[tuple[str, ...]] = []
    for chunk in state.plan.chunks:
        with state.batch(chunk):
            images = [source.atoms.copy() for _, source in chunk.items]
            results = calc.calculate_batch(images, properties)
            for atoms, result in zip(images, results, strict=True):
                atoms.calc = SinglePointCalculator(atoms, **result)
            write(staged, images, format="extxyz", append=True)
        rows.extend(
            result_row(source.label, atoms, result)
            for (_, source), atoms, result in zip(
                chunk.items, images, results, strict=True
            )
        )
    outputs.commit()
    say(args, format_table(RESULT_HEADER, rows))
    say(args, f"wrote {len(sources)} frames with results to {output}")
    return 0
