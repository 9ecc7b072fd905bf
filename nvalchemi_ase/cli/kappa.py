"""``nvalchemi-ase kappa``: lattice thermal conductivity of every input, batched.

Every frame of every input is a material. Each is relaxed first (cell and
ions, its space group kept; --no-relax to skip), then phono3py (extra
``nvalchemi-ase[kappa]``) builds its supercell and the displaced copies for
the third-order (and second-order) force constants; the forces on every
displaced supercell of every material come from batched model calls in one
stream; phono3py solves the phonon BTE on --mesh (RTA, or --method lbte).
κ in W/(m K) at each of --temperatures.

Two checks per material: the forces on every displaced supercell must sum
to ~0 (translational invariance, --force-sum-tolerance eV/Å) and the
acoustic frequencies at Γ of the raw FC2 must vanish (--acoustic-tolerance
THz). A material failing either is listed with the reason instead of a κ.

Outputs, after --file-prefix as for ``nvalchemi-ase eos``:
<material>-kappa.json (κ tensors, checks, units), <material>-kappa.png (κ
against T; not with --no-plot), kappa-results.csv and kappa-summary.json. A
material that fails is listed with its reason, the others finish, and the
exit status is 1.
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
    from nvalchemi_ase.properties.kappa import ThermalConductivityResult

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the ``kappa`` options."""
    from nvalchemi_ase.cli.common import positive_float
    from nvalchemi_ase.properties.kappa import (
        ACOUSTIC_TOLERANCE,
        FORCE_SUM_TOLERANCE,
    )

    add_supercell_argument(
        parser, "--supercell", [2, 2, 2], "supercell of the input cell for FC3"
    )
    add_supercell_argument(
        parser,
        "--fc2-supercell",
        None,
        "a separate, larger supercell for FC2 (default: the FC3 one)",
    )
    add_phonopy_arguments(
        parser,
        displacement=0.03,
        mesh=[11, 11, 11],
        mesh_help="q-mesh of the BTE (default: {default})",
    )
    parser.add_argument(
        "--temperatures",
        type=positive_float,
        nargs="+",
        default=[300.0],
        metavar="T",
        help="temperatures, K (default: 300)",
    )
    parser.add_argument(
        "--method",
        choices=("rta", "lbte"),
        default="rta",
        help="relaxation-time approximation or the direct LBTE solution",
    )
    parser.add_argument(
        "--cutoff-pair-distance",
        type=positive_float,
        default=None,
        help="leave out FC3 pairs of displaced atoms farther apart, Å",
    )
    parser.add_argument("--isotope", action="store_true", help="add isotope scattering")
    parser.add_argument(
        "--no-relax",
        action="store_true",
        help="use the inputs as given (default: relax cell and ions first)",
    )
    add_relaxation_limits(
        parser, default_fmax=1e-3, relaxations="the relaxation", each="the relaxation"
    )
    add_optimizer_arguments(parser, cell="the relaxation", ions=False)
    parser.add_argument(
        "--force-sum-tolerance",
        type=positive_float,
        default=FORCE_SUM_TOLERANCE,
        help="largest |sum of forces| of one displaced supercell, eV/Å "
        f"(default: {FORCE_SUM_TOLERANCE:g})",
    )
    parser.add_argument(
        "--acoustic-tolerance",
        type=positive_float,
        default=ACOUSTIC_TOLERANCE,
        help="largest |f| of an acoustic mode at Γ, THz "
        f"(default: {ACOUSTIC_TOLERANCE:g})",
    )
    add_property_arguments(parser, plots=True)


def run(args: argparse.Namespace) -> int:
    """Compute, write and print the thermal conductivities."""
    from nvalchemi_ase.properties.kappa import require_phono3py

    require_phono3py()  # before any work: names the extra to install
    supercell_value(args.supercell, "--supercell")
    supercell_value(args.fc2_supercell, "--fc2-supercell")
    return run_property_command(args, _COMMAND)


def _compute(args: argparse.Namespace, calc: Any, atoms: list[Any]) -> list[Any]:
    from nvalchemi_ase.properties import thermal_conductivity

    return thermal_conductivity(
        atoms,
        calc,
        supercell=supercell_value(args.supercell, "--supercell"),
        fc2_supercell=supercell_value(args.fc2_supercell, "--fc2-supercell"),
        mesh=tuple(args.mesh),
        temperatures=tuple(args.temperatures),
        displacement=args.displacement,
        method=args.method,
        cutoff_pair_distance=args.cutoff_pair_distance,
        is_isotope=args.isotope,
        primitive_matrix=args.primitive,
        relax=not args.no_relax,
        fmax=args.fmax,
        steps=args.steps,
        cell_optimizer=args.cell_optimizer,
        force_sum_tolerance=args.force_sum_tolerance,
        acoustic_tolerance=args.acoustic_tolerance,
    )


def _kappa_row(result: ThermalConductivityResult) -> tuple[str, ...]:
    temperatures = list(result.temperatures if result.temperatures is not None else [])
    kappa = list(result.kappa_mean if result.kappa_mean is not None else [])
    return (
        str((result.n_fc3_displacements or 0) + (result.n_fc2_displacements or 0)),
        " ".join(f"{t:g}" for t in temperatures),
        " ".join(f"{k:.4g}" for k in kappa),
        f"{result.max_force_sum:.2e}",
        f"{result.acoustic_gamma:.2e}",
    )


def _plot(
    args: argparse.Namespace, result: ThermalConductivityResult, path: Path
) -> None:
    from nvalchemi_ase.properties.plots import plot_kappa

    plot_kappa(result, path)


_COMMAND = PropertyCommand(
    name="kappa",
    compute=_compute,
    header=(
        "displacements",
        "T/K",
        "κ mean/(W/mK)",
        "max|ΣF|/(eV/Å)",
        "Γ acoustic/THz",
    ),
    row=_kappa_row,
    extras={"kappa.png": _plot},
    wanted=lambda args, suffix: not args.no_plot,
)
