"""``nvalchemi-ase surface``: surface energies of every input bulk, batched.

Every frame of every input is a bulk material. Each is cut into one slab per
--miller facet (ase.build.surface: --layers repeats of the cell's surface
unit, --vacuum Å on each side; Miller indices of the input cell's lattice, so
give conventional cells for the cubic indices); the ions of every slab of
every material and of every bulk reference are relaxed at fixed cell in one
in-flight run (each structure leaves the working batch as it converges;
--clamped: single points). γ = (E_slab − n·e_bulk) / (2A), in eV/Å² and J/m².

Outputs, after --file-prefix as for ``nvalchemi-ase eos``:
<material>-surface.json (γ per facet, slab energies, areas, units),
<material>-surface-slabs.extxyz (the relaxed slabs with their energies, γ and
Miller indices), <material>-surface.png (γ per facet; not with --no-plot),
surface-results.csv and surface-summary.json. A material that fails is listed
with its reason, the others finish, and the exit status is 1.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nvalchemi_ase.cli.eos import (
    PropertyCommand,
    add_property_arguments,
    add_relaxation_arguments,
    run_property_command,
)

if TYPE_CHECKING:
    from nvalchemi_ase.properties.surfaces import SurfaceResult

__all__ = ["add_arguments", "miller_index", "run"]


def miller_index(text: str) -> tuple[int, int, int]:
    """Argparse type: ``111``, ``1-10`` (digits, a minus before one) or ``1,1,0``.

    Parameters
    ----------
    text : str
        The facet.

    Returns
    -------
    tuple of int
        (h, k, l).
    """
    try:
        if "," in text:
            values = [int(part) for part in text.split(",")]
        else:
            values, sign = [], 1
            for char in text.strip():
                if char == "-":
                    sign = -1
                    continue
                values.append(sign * int(char))
                sign = 1
    except ValueError:
        values = []
    if len(values) != 3 or not any(values):
        raise argparse.ArgumentTypeError(
            f"a Miller index is three integers, not all zero (111, 1-10 or "
            f"1,1,0), got {text!r}"
        )
    return values[0], values[1], values[2]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the ``surface`` options."""
    from nvalchemi_ase.cli.common import positive_float, positive_int

    parser.add_argument(
        "--miller",
        type=miller_index,
        nargs="+",
        default=[(1, 0, 0), (1, 1, 0), (1, 1, 1)],
        metavar="HKL",
        help="facets, Miller indices of the input cell's lattice: 111, 1-10 or "
        "1,1,0 (default: 100 110 111)",
    )
    parser.add_argument(
        "--layers",
        type=positive_int,
        default=4,
        help="repeats of the surface unit along the normal (default: 4)",
    )
    parser.add_argument(
        "--vacuum",
        type=positive_float,
        default=10.0,
        help="vacuum on each side of every slab, Å (default: 10)",
    )
    parser.add_argument(
        "--clamped",
        action="store_true",
        help="do not relax the slabs and bulk references (default: relax ions)",
    )
    add_relaxation_arguments(parser, default_fmax=0.01)
    add_property_arguments(parser, plots=True)


def run(args: argparse.Namespace) -> int:
    """Compute, write and print the surface energies."""
    labels = ["".join(str(i) for i in hkl) for hkl in args.miller]
    command = PropertyCommand(
        name="surface",
        compute=_compute,
        header=("e_bulk/eV/atom", *(f"γ({label})/J/m²" for label in labels)),
        row=_row,
        extras={"surface-slabs.extxyz": _write_slabs, "surface.png": _plot},
        wanted=lambda args, suffix: suffix != "surface.png" or not args.no_plot,
    )
    return run_property_command(args, command)


def _compute(args: argparse.Namespace, calc: Any, atoms: list[Any]) -> list[Any]:
    from nvalchemi_ase.properties import surface_energies

    return surface_energies(
        atoms,
        calc,
        miller=args.miller,
        layers=args.layers,
        vacuum=args.vacuum,
        relax=not args.clamped,
        fmax=args.fmax,
        steps=args.steps,
        optimizer=args.optimizer,
        relax_bulk=args.relax_first,
        cell_optimizer=args.cell_optimizer,
    )


def _row(result: SurfaceResult) -> tuple[str, ...]:
    import numpy as np

    return (
        f"{result.bulk_energy_per_atom:.6f}",
        *(f"{gamma:.4f}" for gamma in np.asarray(result.surface_energies_si)),
    )


def _write_slabs(args: argparse.Namespace, result: SurfaceResult, path: Path) -> None:
    from nvalchemi_ase.io_safe import write_frames

    write_frames(path, result.slabs, format="extxyz")


def _plot(args: argparse.Namespace, result: SurfaceResult, path: Path) -> None:
    from nvalchemi_ase.properties.plots import plot_surface_energies

    plot_surface_energies(result, path)
