"""Batched property workflows vs the sequential ASE/matscipy loop (LJ argon).

Run from the repository root::

    .venv/bin/python -m benchmarks.properties [--repeats 3] [--quick]

(also section 6 of ``python -m benchmarks``). Eight rattled argon crystals
(fcc and hcp cells of 2-8 atoms), Lennard-Jones in float64 on the CPU, one
``NVAlchemiCalculator`` shared by both sides:

* EOS with ion relaxation, 7 volumes per material:
  :func:`nvalchemi_ase.properties.equation_of_state` (``relax="ions"``: one
  batched FIRE run over all 56 cells) vs one ``ase.optimize.FIRE`` per cell and
  ``ase.eos.EquationOfState``;
* relaxed-ion elastic constants, 5 strains per Voigt component:
  :func:`nvalchemi_ase.properties.elastic_constants` (one batched FIRE run
  over all strained cells) vs ``matscipy.elasticity.fit_elastic_constants``
  with ``ase.optimize.FIRE`` on each strained cell.

Both sides relax to the same ``fmax``. They are timed in alternation after a
warm-up and the medians are reported, with the largest difference between
their results.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from ase import Atoms, units
from ase.build import bulk

ARGON_A = 5.26  # Å, fcc
HCP_A = 3.72  # Å, ideal c/a
FMAX = 1e-3  # eV/Å, both sides
N_VOLUMES = 7
N_STRAINS = 5
STRAIN = 0.01


def materials(count: int = 8) -> list[Atoms]:
    """``count`` rattled argon crystals of 2-8 atoms (every cell has forces)."""
    hcp = bulk("Ar", "hcp", a=HCP_A, c=HCP_A * np.sqrt(8.0 / 3.0))
    builders = [
        lambda: bulk("Ar", "fcc", a=ARGON_A, cubic=True),
        lambda: bulk("Ar", "fcc", a=ARGON_A, cubic=True).repeat((2, 1, 1)),
        lambda: hcp.copy(),
        lambda: hcp.repeat((2, 1, 1)),
        lambda: bulk("Ar", "fcc", a=ARGON_A).repeat((2, 2, 1)),
        lambda: bulk("Ar", "fcc", a=5.22, cubic=True),
        lambda: bulk("Ar", "fcc", a=ARGON_A).repeat((2, 2, 2)),
        lambda: hcp.repeat((1, 1, 2)),
    ]
    crystals = []
    for index in range(count):
        atoms = builders[index % len(builders)]()
        atoms.rattle(0.03, seed=index)
        crystals.append(atoms)
    return crystals


def _eos_sequential(calc: Any, crystals: list[Atoms]) -> list[tuple[float, float]]:
    from ase.eos import EquationOfState
    from ase.optimize import FIRE

    fits = []
    for atoms in crystals:
        volumes, energies = [], []
        for factor in np.linspace(0.95, 1.05, N_VOLUMES):
            scaled = atoms.copy()
            scaled.set_cell(atoms.cell.array * factor, scale_atoms=True)
            scaled.calc = calc
            FIRE(scaled, logfile=None).run(fmax=FMAX, steps=1000)
            volumes.append(scaled.get_volume())
            energies.append(scaled.get_potential_energy())
        v0, _, bulk_modulus = EquationOfState(
            volumes, energies, eos="birchmurnaghan"
        ).fit(warn=False)
        fits.append((v0, bulk_modulus / units.GPa))
    return fits


def _elastic_sequential(calc: Any, crystals: list[Atoms]) -> list[np.ndarray]:
    from ase.optimize import FIRE
    from matscipy.elasticity import fit_elastic_constants

    out = []
    for atoms in crystals:
        copy = atoms.copy()
        copy.calc = calc
        stiffness, _ = fit_elastic_constants(
            copy,
            symmetry="triclinic",
            N_steps=N_STRAINS,
            delta=2 * STRAIN / (N_STRAINS - 1),
            optimizer=FIRE,
            verbose=False,
            fmax=FMAX,
        )
        out.append(stiffness / units.GPa)
    return out


def compare(
    crystals: list[Atoms],
    repeats: int,
    timer: Callable[..., list[float]],
    warmup: int = 1,
) -> list[list[str]]:
    """Time both workflows both ways; one table row each."""
    from nvalchemi_ase import NVAlchemiCalculator
    from nvalchemi_ase.properties import elastic_constants, equation_of_state

    calc = NVAlchemiCalculator("lj", device="cpu", dtype="float64")
    captured: dict[str, Any] = {}

    def eos_batched() -> None:
        captured["eos"] = equation_of_state(
            crystals, calc, n_volumes=N_VOLUMES, relax="ions", fmax=FMAX
        )

    def eos_sequential() -> None:
        captured["eos_ref"] = _eos_sequential(calc, crystals)

    def elastic_batched() -> None:
        captured["elastic"] = elastic_constants(
            crystals, calc, strain=STRAIN, n_strains=N_STRAINS, fmax=FMAX
        )

    def elastic_sequential() -> None:
        captured["elastic_ref"] = _elastic_sequential(calc, crystals)

    rows = []
    batched, sequential = timer([eos_batched, eos_sequential], repeats, warmup)
    pairs = list(zip(captured["eos"], captured["eos_ref"], strict=True))
    v0_error = max(abs(r.v0 - v0) / v0 for r, (v0, _) in pairs)
    b_error = max(abs(r.B - b) / b for r, (_, b) in pairs)
    relaxed = sum(int((r.relax_steps > 0).sum()) for r in captured["eos"])
    rows.append(
        [
            f"EOS, ions relaxed at {N_VOLUMES} volumes",
            str(len(crystals) * N_VOLUMES),
            str(relaxed),
            f"{batched:.2f}",
            f"{sequential:.2f}",
            f"{sequential / batched:.1f}×",
            f"V0 {v0_error:.1e}, B {b_error:.1e} (relative)",
        ]
    )
    batched, sequential = timer([elastic_batched, elastic_sequential], repeats, warmup)
    elastic = list(zip(captured["elastic"], captured["elastic_ref"], strict=True))
    c_error = max(float(np.abs(r.C - c).max()) for r, c in elastic)
    relaxed = sum(_relaxed_cells(r) for r in captured["elastic"])
    per_material = 1 + 6 * int(np.count_nonzero(np.linspace(-1, 1, N_STRAINS)))
    rows.append(
        [
            f"elastic C_ij, ions relaxed, {N_STRAINS} strains x 6",
            str(len(crystals) * per_material),
            str(relaxed),
            f"{batched:.2f}",
            f"{sequential:.2f}",
            f"{sequential / batched:.1f}×",
            f"C {c_error:.1e} GPa (max abs)",
        ]
    )
    return rows


def _relaxed_cells(result: Any) -> int:
    """Strained cells (and the reference) that the optimizer moved."""
    strained = result.strains != 0.0
    moved = int((result.relax_steps[:, strained] > 0).sum())
    return moved + int((result.relax_steps[0, ~strained] > 0).any())


HEADER = [
    "workflow",
    "structures",
    "relaxed",
    "batched [s]",
    "ASE/matscipy loop [s]",
    "speed-up",
    "batched vs loop",
]
NOTE = (
    "Rattled argon crystals (2-8 atoms), LJ float64 on the CPU, one "
    "NVAlchemiCalculator for both sides; batched: nvalchemi_ase.properties (one "
    "batched FIRE run over every cell that has forces); loop: ase.optimize.FIRE "
    f"per cell with ase.eos / matscipy.elasticity; fmax {FMAX} eV/Å on both "
    "sides; medians, timed in alternation."
)


def run(settings: Any, report: Any) -> None:
    """Section 6 of ``python -m benchmarks``."""
    from benchmarks.run import interleaved_medians

    count = 1 if settings.quick else 8  # quick: checks it runs, in ~15 s
    rows = compare(
        materials(count),
        settings.repeats,
        interleaved_medians,
        warmup=0 if settings.quick else 1,
    )
    report.table(
        f"6. Batched property workflows vs ASE/matscipy loops ({count} materials)",
        HEADER,
        rows,
        NOTE,
    )


def main(argv: list[str] | None = None) -> int:
    """Run this benchmark alone and print its table."""
    from benchmarks.run import Report, interleaved_medians

    parser = argparse.ArgumentParser(prog="python -m benchmarks.properties")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--quick", action="store_true", help="1 material, 1 repeat, no warm-up"
    )
    args = parser.parse_args(argv)
    start = time.perf_counter()
    count = 1 if args.quick else 8
    repeats = 1 if args.quick else args.repeats
    rows = compare(
        materials(count), repeats, interleaved_medians, warmup=0 if args.quick else 1
    )
    Report().table(
        f"Batched property workflows vs ASE/matscipy loops ({count} materials)",
        HEADER,
        rows,
        NOTE + f" Total {time.perf_counter() - start:.0f} s.",
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
