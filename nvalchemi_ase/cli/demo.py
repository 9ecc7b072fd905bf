"""``nvalchemi-ase demo``: evaluate a batch of real structures in one model call."""

from __future__ import annotations

import argparse
import time

__all__ = ["add_arguments", "demo_structures", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the ``demo`` options.

    Parameters
    ----------
    parser : argparse.ArgumentParser
        The subcommand's parser.
    """
    parser.add_argument(
        "--device",
        default=None,
        help="torch device (default: cuda if available, else cpu)",
    )
    parser.add_argument(
        "--dtype", default="float64", help="float32 or float64 (default: float64)"
    )


def demo_structures() -> list:
    """Argon structures from ``ase.build``: a bulk crystal, a slab and a cluster.

    Returns
    -------
    list of ase.Atoms
        Rattled fcc bulk (periodic), an fcc(111) slab (pbc T, T, F, no third cell
        vector) and an icosahedral cluster (no pbc).
    """
    from ase.build import bulk, fcc111
    from ase.cluster import Icosahedron

    crystal = bulk("Ar", "fcc", a=5.26, cubic=True).repeat((3, 3, 3))
    crystal.rattle(0.05, seed=1)
    slab = fcc111("Ar", size=(3, 3, 4), a=5.26, vacuum=None)
    slab.pbc = (True, True, False)
    cluster = Icosahedron("Ar", noshells=3, latticeconstant=5.26)
    return [crystal, slab, cluster]


def run(args: argparse.Namespace) -> int:
    """Evaluate the demo structures in one batched call and print a table.

    Parameters
    ----------
    args : argparse.Namespace
        Parsed options.

    Returns
    -------
    int
        Exit status.
    """
    import numpy as np
    from ase import units

    from nvalchemi_ase.calculator import NVAlchemiCalculator
    from nvalchemi_ase.cli._table import format_table
    from nvalchemi_ase.units import pressure_from_stress

    images = demo_structures()
    calc = NVAlchemiCalculator("lj", device=args.device, dtype=args.dtype)
    start = time.perf_counter()
    results = calc.calculate_batch(images, properties=("energy", "forces", "stress"))
    elapsed = time.perf_counter() - start
    rows = []
    for index, (atoms, result) in enumerate(zip(images, results, strict=True)):
        pressure = (
            f"{pressure_from_stress(result['stress']) / units.GPa:.4f}"
            if "stress" in result
            else "-"
        )
        rows.append(
            (
                index,
                atoms.get_chemical_formula(),
                "".join("T" if p else "F" for p in atoms.pbc),
                f"{result['energy']:.6f}",
                f"{result['energy'] / len(atoms):.6f}",
                f"{np.linalg.norm(result['forces'], axis=1).max():.6f}",
                pressure,
            )
        )
    header = ("#", "formula", "pbc", "energy/eV", "eV/atom", "max|F|/(eV/Å)", "P/GPa")
    print(  # noqa: T201
        f"model: Lennard-Jones argon (nvalchemi LennardJonesModelWrapper) on "
        f"{calc.device}, {calc.parameters['dtype']}; {len(images)} structures, "
        f"{sum(map(len, images))} atoms in one batched call ({elapsed:.2f} s incl. "
        "first-call kernel compilation)"
    )
    print(format_table(header, rows))  # noqa: T201
    return 0
