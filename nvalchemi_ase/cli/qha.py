"""``nvalchemi-ase qha``: quasi-harmonic thermodynamics of every input, batched.

Every frame of every input is a material. Each is relaxed first (cell and
ions, its space group kept; --no-relax-first to skip), scaled to --n-volumes
cells (lattice vectors times 1 - STRAIN ... 1 + STRAIN), its ions relaxed at
each cell (--relax none to skip); phonopy (extra
``nvalchemi-ase[properties]``) builds the displaced supercells of every
volume and the forces on all of them, of all volumes and materials, come
from batched model calls. phonopy's QHA gives, per input cell, V(T) in Å³,
the thermal expansion (volumetric β and α = β/3, 1/K), B(T) in GPa, the
Gibbs energy G(T) in eV and C_P(T) in eV/K, from 0 K to --t-max.

Outputs, after --file-prefix as for ``nvalchemi-ase eos``: <material>-qha.json
(every curve, units), <material>-qha.png (V, α, B and G against T; not with
--no-plot), qha-results.csv and qha-summary.json. A material that fails (a
volume with imaginary modes, a failed fit) is listed with its reason, the
others finish, and the exit status is 1.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nvalchemi_ase.cli.eos import (
    PropertyCommand,
    add_optimizer_arguments,
    add_phonopy_arguments,
    add_property_arguments,
    add_relaxation_limits,
    add_supercell_argument,
    run_property_command,
    supercell_value,
)

if TYPE_CHECKING:
    from nvalchemi_ase.properties.qha import QHAResult

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the ``qha`` options."""
    from nvalchemi_ase.cli.common import positive_float, positive_int
    from nvalchemi_ase.properties.qha import IMAGINARY_TOLERANCE, QHA_EOS

    parser.add_argument(
        "--n-volumes",
        type=positive_int,
        default=7,
        help="volumes per material (default: 7, at least 5)",
    )
    parser.add_argument(
        "--strain",
        type=positive_float,
        default=0.03,
        help="largest linear strain, ± (default: 0.03)",
    )
    add_supercell_argument(
        parser, "--supercell", [2, 2, 2], "phonon supercell of the input cell"
    )
    add_phonopy_arguments(
        parser,
        displacement=0.01,
        mesh=[11, 11, 11],
        mesh_help="q-mesh of the thermal properties (default: {default}; odd "
        "numbers are Γ-centred)",
    )
    parser.add_argument(
        "--t-max",
        type=positive_float,
        default=1000.0,
        help="highest temperature of the results, K (default: 1000)",
    )
    parser.add_argument(
        "--t-step",
        type=positive_float,
        default=10.0,
        help="temperature step, K (default: 10)",
    )
    parser.add_argument(
        "--eos", choices=QHA_EOS, default="vinet", help="F(V) fit (default: vinet)"
    )
    parser.add_argument(
        "--pressure", type=float, default=0.0, help="pressure, GPa (default: 0)"
    )
    parser.add_argument(
        "--no-relax-first",
        action="store_true",
        help="scale the inputs as given (default: relax cell and ions first)",
    )
    parser.add_argument(
        "--relax",
        choices=("ions", "none"),
        default="ions",
        help="relax the ions at each volume (default) or not",
    )
    add_relaxation_limits(parser, default_fmax=1e-3, each="each relaxation")
    add_optimizer_arguments(parser, cell="the first relaxation")
    parser.add_argument(
        "--imaginary-tolerance",
        type=positive_float,
        default=IMAGINARY_TOLERANCE,
        help="a volume whose lowest mesh frequency is below minus this, THz, "
        f"fails its material (default: {IMAGINARY_TOLERANCE:g})",
    )
    add_property_arguments(parser, plots=True)


def run(args: argparse.Namespace) -> int:
    """Compute, write and print the quasi-harmonic results."""
    from nvalchemi_ase.properties.phonons import require_phonopy

    require_phonopy()  # before any work: names the extra to install
    supercell_value(args.supercell, "--supercell")
    return run_property_command(args, _COMMAND)


def _temperatures(args: argparse.Namespace) -> Any:
    import numpy as np

    # one step past --t-max: phonopy's differences consume the last point
    count = int(np.floor(args.t_max / args.t_step + 1e-9)) + 2
    return np.arange(count) * args.t_step


def _compute(args: argparse.Namespace, calc: Any, atoms: list[Any]) -> list[Any]:
    from nvalchemi_ase.properties import qha

    return qha(
        atoms,
        calc,
        n_volumes=args.n_volumes,
        strain=args.strain,
        supercell=supercell_value(args.supercell, "--supercell"),
        displacement=args.displacement,
        mesh=tuple(args.mesh),
        temperatures=_temperatures(args),
        eos=args.eos,
        pressure=args.pressure,
        relax_first=not args.no_relax_first,
        relax=None if args.relax == "none" else "ions",
        fmax=args.fmax,
        steps=args.steps,
        optimizer=args.optimizer,
        cell_optimizer=args.cell_optimizer,
        primitive_matrix=args.primitive,
        imaginary_tolerance=args.imaginary_tolerance,
    )


def _qha_row(result: QHAResult) -> tuple[str, ...]:
    import numpy as np

    temperatures = np.asarray(result.temperatures)
    volumes = np.asarray(result.volume_temperature)
    alpha = np.asarray(result.linear_thermal_expansion)
    bulk = np.asarray(result.bulk_modulus_temperature)
    return (
        f"{temperatures[-1]:g}",
        f"{volumes[0]:.4f}",
        f"{volumes[-1]:.4f}",
        f"{alpha[-1] * 1e6:.3f}",
        f"{bulk[0]:.3f}",
        f"{bulk[-1]:.3f}",
    )


def _plot(args: argparse.Namespace, result: QHAResult, path: Path) -> None:
    from nvalchemi_ase.properties.plots import plot_qha

    plot_qha(result, path)


_COMMAND = PropertyCommand(
    name="qha",
    compute=_compute,
    header=(
        "T max/K",
        "V(0)/Å³",
        "V(T max)/Å³",
        "α(T max)/(1e-6/K)",
        "B(0)/GPa",
        "B(T max)/GPa",
    ),
    row=_qha_row,
    extras={"qha.png": _plot},
    wanted=lambda args, suffix: not args.no_plot,
)
