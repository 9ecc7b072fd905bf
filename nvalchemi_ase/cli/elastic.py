"""``nvalchemi-ase elastic``: elastic constants of every input structure, batched.

Every frame of every input is a material. Each cell is strained along the six
Voigt components (--n-strains values in [-STRAIN, STRAIN]); the ions of every
strained cell of every material are relaxed at fixed cell in one batched
optimizer run (--clamped: not relaxed) and all stresses come from batched
model calls. C_ij (GPa, Voigt order xx yy zz yz xz xy) is the least-squares
slope of stress i against strain j (ASE's stress sign: C = +dσ/dε), with the
Voigt, Reuss and Hill bulk and shear moduli.

Outputs, after --file-prefix as for ``nvalchemi-ase eos``:
<material>-elastic.json (C, compliance, moduli, the stress-strain data,
units), elastic-results.csv and elastic-summary.json. A material that fails is
listed with its reason, the others finish, and the exit status is 1. Start
from relaxed cells (--relax-first relaxes cell and ions first).
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from nvalchemi_ase.cli.eos import (
    PropertyCommand,
    add_property_arguments,
    add_relaxation_arguments,
    run_property_command,
)

if TYPE_CHECKING:
    from nvalchemi_ase.properties.elastic import ElasticResult

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the ``elastic`` options."""
    from nvalchemi_ase.cli.common import positive_float, positive_int

    parser.add_argument(
        "--strain",
        type=positive_float,
        default=0.01,
        help="largest Voigt strain per component (default: 0.01)",
    )
    parser.add_argument(
        "--n-strains",
        type=positive_int,
        default=5,
        help="strain values per component (default: 5)",
    )
    parser.add_argument(
        "--clamped",
        action="store_true",
        help="clamped ions: do not relax the strained cells (default: relax ions)",
    )
    add_relaxation_arguments(parser, default_fmax=1e-3)
    add_property_arguments(parser, plots=False)


def run(args: argparse.Namespace) -> int:
    """Compute, write and print the elastic constants."""
    return run_property_command(args, _COMMAND)


def _compute(args: argparse.Namespace, calc: Any, atoms: list[Any]) -> list[Any]:
    from nvalchemi_ase.properties import elastic_constants

    return elastic_constants(
        atoms,
        calc,
        strain=args.strain,
        n_strains=args.n_strains,
        relax_ions=not args.clamped,
        fmax=args.fmax,
        steps=args.steps,
        optimizer=args.optimizer,
        relax_first=args.relax_first,
        cell_optimizer=args.cell_optimizer,
    )


_COMPONENTS = ((0, 0), (1, 1), (2, 2), (0, 1), (0, 2), (1, 2), (3, 3), (4, 4), (5, 5))


def _elastic_row(result: ElasticResult) -> tuple[str, ...]:
    stiffness = result.C
    if stiffness is None:
        raise ValueError("no elastic constants")
    return (
        *(f"{stiffness[i, j]:.2f}" for i, j in _COMPONENTS),
        f"{result.bulk_hill:.2f}",
        f"{result.shear_hill:.2f}",
    )


_COMMAND = PropertyCommand(
    name="elastic",
    compute=_compute,
    header=(
        *(f"C{i + 1}{j + 1}" for i, j in _COMPONENTS),
        "K_VRH",
        "G_VRH",
    ),
    row=_elastic_row,
)
