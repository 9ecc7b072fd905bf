"""``nvalchemi-ase defect``: point-defect formation energies of every input bulk.

Every frame of every input is a bulk material (give relaxed cells, or
--relax-first). Each is repeated into a --supercell and given every --defects
entry: vacancy, vacancy:X, interstitial (a host atom at the largest void),
interstitial:X, substitution:X, substitution:X@Y. The ions of every defect
supercell of every material and of every bulk reference are relaxed at fixed
cell in one in-flight run (each leaves the working batch as it converges;
--clamped: single points). E_f = E_defect − E_bulk − Σ n_i μ_i (eV), with μ
from --chemical-potential X=VALUE (eV/atom); the host species of an elemental
bulk defaults to its bulk energy per atom.

Outputs, after --file-prefix as for ``nvalchemi-ase eos``:
<material>-defect.json (E_f, energies, μ, sites, units),
<material>-defect-structures.extxyz (the relaxed defect supercells with their
energies and labels), <material>-defect.png (E_f per defect; not with
--no-plot), defect-results.csv and defect-summary.json. A material that fails
is listed with its reason, the others finish, and the exit status is 1.
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
    from nvalchemi_ase.properties.defects import DefectResult

__all__ = ["add_arguments", "chemical_potential", "run"]


def chemical_potential(text: str) -> tuple[str, float]:
    """Argparse type: ``X=VALUE`` (a chemical symbol and eV/atom).

    Parameters
    ----------
    text : str
        The option value.

    Returns
    -------
    tuple of (str, float)
        Species and μ, eV/atom.
    """
    from ase.data import atomic_numbers

    species, _, value = text.partition("=")
    try:
        number = float(value)
    except ValueError:
        number = float("nan")
    if species.strip() not in atomic_numbers or number != number:
        raise argparse.ArgumentTypeError(
            f"a chemical potential is SYMBOL=VALUE in eV/atom (e.g. Cu=-4.1), "
            f"got {text!r}"
        )
    return species.strip(), number


def _defect(text: str) -> str:
    from nvalchemi_ase.properties.defects import parse_defect

    try:
        parse_defect(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the ``defect`` options."""
    parser.add_argument(
        "--defects",
        type=_defect,
        nargs="+",
        default=["vacancy"],
        metavar="DEFECT",
        help="vacancy, vacancy:X, interstitial, interstitial:X, substitution:X, "
        "substitution:X@Y (default: vacancy)",
    )
    parser.add_argument(
        "--supercell",
        type=int,
        nargs="+",
        default=[2, 2, 2],
        metavar="N",
        help="supercell of the input cell: 1, 3 or 9 integers (default: 2 2 2)",
    )
    parser.add_argument(
        "--chemical-potential",
        type=chemical_potential,
        action="append",
        default=[],
        metavar="X=VALUE",
        help="chemical potential of species X, eV/atom (repeat for several)",
    )
    parser.add_argument(
        "--clamped",
        action="store_true",
        help="do not relax the defect supercells (default: relax ions)",
    )
    add_relaxation_arguments(parser, default_fmax=0.01)
    add_property_arguments(parser, plots=True)


def run(args: argparse.Namespace) -> int:
    """Compute, write and print the defect formation energies."""
    from nvalchemi_ase.cli.common import CommandError

    if len(args.supercell) not in (1, 3, 9):
        raise CommandError(
            f"--supercell takes 1, 3 or 9 integers, got {len(args.supercell)}"
        )
    return run_property_command(args, _COMMAND)


def _compute(args: argparse.Namespace, calc: Any, atoms: list[Any]) -> list[Any]:
    import re

    import numpy as np

    from nvalchemi_ase.cli.common import CommandError
    from nvalchemi_ase.properties import defect_formation_energies

    values = np.array(args.supercell)
    supercell = values.reshape(3, 3) if values.size == 9 else values
    try:
        return defect_formation_energies(
            atoms,
            calc,
            defects=args.defects,
            supercell=supercell.tolist(),
            chemical_potentials=dict(args.chemical_potential),
            relax=not args.clamped,
            fmax=args.fmax,
            steps=args.steps,
            optimizer=args.optimizer,
            relax_bulk=args.relax_first,
            cell_optimizer=args.cell_optimizer,
        )
    except ValueError as error:  # raised before any work: the user's to fix
        # name the command-line option instead of the keyword
        message = re.sub(
            r"chemical_potentials=\{'(\w+)': \.\.\.\}",
            r"--chemical-potential \1=VALUE",
            str(error),
        )
        raise CommandError(message) from None


def _row(result: DefectResult) -> tuple[str, ...]:
    import numpy as np

    energies = np.asarray(result.formation_energies)
    return (
        str(result.supercell_natoms),
        f"{result.bulk_energy_per_atom:.6f}",
        " ".join(
            f"{label}={value:.4f}"
            for label, value in zip(result.defects, energies, strict=True)
        ),
    )


def _write_structures(
    args: argparse.Namespace, result: DefectResult, path: Path
) -> None:
    from nvalchemi_ase.io_safe import write_frames

    write_frames(path, result.structures, format="extxyz")


def _plot(args: argparse.Namespace, result: DefectResult, path: Path) -> None:
    from nvalchemi_ase.properties.plots import plot_defect_energies

    plot_defect_energies(result, path)


_COMMAND = PropertyCommand(
    name="defect",
    compute=_compute,
    header=("supercell atoms", "e_bulk/eV/atom", "E_f/eV"),
    row=_row,
    extras={"defect-structures.extxyz": _write_structures, "defect.png": _plot},
    wanted=lambda args, suffix: suffix != "defect.png" or not args.no_plot,
)
