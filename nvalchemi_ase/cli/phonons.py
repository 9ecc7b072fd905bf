"""``nvalchemi-ase phonons``: harmonic phonons of every input structure, batched.

Every frame of every input is a material. phonopy (extra
``nvalchemi-ase[properties]``) builds each supercell and its symmetry-reduced
displaced copies; the forces on every displaced supercell of every material
come from batched model calls. Frequencies in THz (imaginary negative) at Γ,
along a band path (ASE's default special points, or --band-path) and on a
Γ-centred --mesh with the density of states.

Outputs, after --file-prefix as for ``nvalchemi-ase eos``:
<material>-phonons.json (frequencies, DOS, units; no force constants),
<material>-phonopy.yaml (phonopy's file with forces and force constants;
``phonopy.load`` reads it), <material>-phonons.png (bands and DOS; not with
--no-plot), phonons-results.csv and phonons-summary.json. A material that fails
is listed with its reason, the others finish, and the exit status is 1. Relax
the inputs first.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nvalchemi_ase.cli.eos import (
    PropertyCommand,
    add_phonopy_arguments,
    add_property_arguments,
    add_supercell_argument,
    run_property_command,
    supercell_value,
)

if TYPE_CHECKING:
    from nvalchemi_ase.properties.phonons import PhononResult

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the ``phonons`` options."""
    from nvalchemi_ase.cli.common import positive_int

    add_supercell_argument(
        parser, "--supercell", [2, 2, 2], "supercell of the input cell"
    )
    add_phonopy_arguments(
        parser,
        displacement=0.01,
        mesh=[10, 10, 10],
        mesh_help="Γ-centred q-mesh for the DOS (default: {default})",
    )
    parser.add_argument(
        "--no-dos", action="store_true", help="no mesh frequencies and no DOS"
    )
    parser.add_argument(
        "--band-path",
        default="auto",
        help="special points of the band path in ASE's notation, e.g. GXWKGL "
        "(default: auto, ASE's path for the lattice); 'none' for no bands",
    )
    parser.add_argument(
        "--band-npoints",
        type=positive_int,
        default=101,
        help="q-points along the path (default: 101)",
    )
    add_property_arguments(parser, plots=True)


def run(args: argparse.Namespace) -> int:
    """Compute, write and print the phonons."""
    from nvalchemi_ase.properties.phonons import require_phonopy

    require_phonopy()  # before any work: names the extra to install
    supercell_value(args.supercell, "--supercell")
    return run_property_command(args, _COMMAND)


def _compute(args: argparse.Namespace, calc: Any, atoms: list[Any]) -> list[Any]:
    from nvalchemi_ase.properties import phonons

    return phonons(
        atoms,
        calc,
        supercell=supercell_value(args.supercell, "--supercell"),
        displacement=args.displacement,
        mesh=None if args.no_dos else tuple(args.mesh),
        band_path=None if args.band_path.lower() == "none" else args.band_path,
        band_npoints=args.band_npoints,
        primitive_matrix=args.primitive,
    )


def _phonon_row(result: PhononResult) -> tuple[str, ...]:
    import numpy as np

    gamma_frequencies = np.asarray(result.gamma_frequencies)
    gamma = np.sort(np.abs(gamma_frequencies))
    sampled: list[np.ndarray] = [gamma_frequencies]
    sampled.extend(
        np.ravel(frequencies)
        for frequencies in (result.band_frequencies, result.mesh_frequencies)
        if frequencies is not None
    )
    everything: np.ndarray = np.concatenate(sampled)
    return (
        str(result.n_displacements),
        f"{gamma[:3].max():.4f}",
        f"{everything.min():.3f}",
        f"{everything.max():.3f}",
    )


def _plot(args: argparse.Namespace, result: PhononResult, path: Path) -> None:
    from nvalchemi_ase.properties.plots import plot_phonons

    plot_phonons(result, path)


def _save_phonopy(args: argparse.Namespace, result: PhononResult, path: Path) -> None:
    result.phonopy.save(filename=str(path), settings={"force_constants": True})


def _wanted(args: argparse.Namespace, suffix: str) -> bool:
    if suffix != "phonons.png":
        return True
    has_band = args.band_path.lower() != "none"
    return not args.no_plot and (has_band or not args.no_dos)


_COMMAND = PropertyCommand(
    name="phonons",
    compute=_compute,
    header=("displacements", "max|f| acoustic Γ/THz", "min f/THz", "max f/THz"),
    row=_phonon_row,
    extras={"phonopy.yaml": _save_phonopy, "phonons.png": _plot},
    wanted=_wanted,
    json_drop=("force_constants",),
)
