"""``nvalchemi-ase calc``: single points for every frame of every input, batched.

Energies in eV, forces in eV/Å, stress in eV/Å³ (ASE's Voigt order and sign,
for cells of rank 3). Results are written as extxyz, chunk by chunk, so what was
computed before an error stays on disk.
"""

from __future__ import annotations

import argparse

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the ``calc`` options."""
    from nvalchemi_ase.cli.common import add_batching_options, add_model_options

    parser.add_argument("files", nargs="+", help="structure files (globs, file@slice)")
    parser.add_argument(
        "-o",
        "--output",
        default="calc.extxyz",
        help="extxyz with energy, forces and stress per frame (default: calc.extxyz)",
    )
    add_model_options(parser)
    add_batching_options(parser)


def run(args: argparse.Namespace) -> int:
    """Evaluate all inputs and write and print the results."""
    from pathlib import Path

    from ase.calculators.singlepoint import SinglePointCalculator
    from ase.io import write

    from nvalchemi_ase.cli._table import RESULT_HEADER, format_table, result_row
    from nvalchemi_ase.cli.common import batches, build_calculator, read_sources, say

    calc = build_calculator(args)  # configuration errors first, before reading
    sources = read_sources(args.files)
    properties = ["energy", "forces"] + (
        ["stress"] if "stress" in calc.implemented_properties else []
    )
    output = Path(args.output)
    output.unlink(missing_ok=True)
    rows: list[tuple[str, ...]] = []
    for chunk in batches(sources, args.batch_size, args.max_atoms):
        images = [source.atoms.copy() for _, source in chunk]
        results = calc.calculate_batch(images, properties)
        for atoms, result in zip(images, results, strict=True):
            atoms.calc = SinglePointCalculator(atoms, **result)
        write(output, images, format="extxyz", append=True)
        rows.extend(
            result_row(source.label, atoms, result)
            for (_, source), atoms, result in zip(chunk, images, results, strict=True)
        )
    say(args, format_table(RESULT_HEADER, rows))
    say(args, f"wrote {len(sources)} frames with results to {output}")
    return 0
