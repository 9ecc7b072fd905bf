"""Batched property workflows vs the sequential ASE/matscipy loop.

Run from the repository root::

    .venv/bin/python -m benchmarks.properties [--model lj|sevennet] [--repeats 3]
        [--quick]

(also ``python -m benchmarks --only properties`` and ``--only
properties-sevennet``; section 9 of ``docs/performance.md``). Eight rattled
crystals of 2-8 atoms, one ``NVAlchemiCalculator`` shared by both sides:

* ``lj`` (9a): argon fcc and hcp cells, Lennard-Jones in float64 on the CPU;
* ``sevennet`` (9b): Si, C, GaAs, NaCl, MgO, LiF, Cu and Al in 2-atom cells,
  SevenNet-0 in float32 (its weights' dtype), one timed round after a
  single-point warm-up (SevenNet-0 is slow on a CPU).

Workflows:

* EOS with ion relaxation: :func:`nvalchemi_ase.properties.equation_of_state`
  (``relax="ions"``: every scaled cell of every material through one
  in-flight FIRE run, :func:`nvalchemi_ase.runners.relax`) vs one
  ``ase.optimize.FIRE`` per cell and ``ase.eos.EquationOfState``;
* relaxed-ion elastic constants:
  :func:`nvalchemi_ase.properties.elastic_constants` (all strained cells
  through one in-flight FIRE run) vs ``matscipy.elasticity.fit_elastic_constants``
  with ``ase.optimize.FIRE`` on each strained cell.

Both sides relax to the same ``fmax``. They are timed in alternation and the
medians are reported, with the largest difference between their results and
the batched side's model work (cells evaluated, summed over model calls).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from ase import Atoms, units
from ase.build import bulk

ARGON_A = 5.26  # Å, fcc
HCP_A = 3.72  # Å, ideal c/a


@dataclass(frozen=True)
class Case:
    """One model's benchmark: calculator, materials and workflow sizes."""

    section: str
    label: str
    model: str
    dtype: str
    materials: Callable[[int], list[Atoms]]
    fmax: float  # eV/Å, both sides
    n_volumes: int
    volume_strain: float  # linear, ±
    n_strains: int
    strain: float
    repeats: int | None = None  # None: the caller's
    warmup: int = 1  # full runs of both sides before timing


def argon_materials(count: int = 8) -> list[Atoms]:
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
    return _rattled(builders, count, 0.03)


def real_materials(count: int = 8) -> list[Atoms]:
    """``count`` rattled 2-atom cells of real crystals near SevenNet-0's a0."""
    builders = [
        lambda: bulk("Si", "diamond", a=5.47),
        lambda: bulk("C", "diamond", a=3.57),
        lambda: bulk("GaAs", "zincblende", a=5.75),
        lambda: bulk("NaCl", "rocksalt", a=5.69),
        lambda: bulk("MgO", "rocksalt", a=4.25),
        lambda: bulk("LiF", "rocksalt", a=4.07),
        lambda: bulk("Cu", "fcc", a=3.62).repeat((2, 1, 1)),
        lambda: bulk("Al", "fcc", a=4.04).repeat((2, 1, 1)),
    ]
    return _rattled(builders, count, 0.02)


def _rattled(
    builders: list[Callable[[], Atoms]], count: int, amount: float
) -> list[Atoms]:
    crystals = []
    for index in range(count):
        atoms = builders[index % len(builders)]()
        atoms.rattle(amount, seed=index)
        crystals.append(atoms)
    return crystals


LJ = Case(
    section="9a",
    label="LJ argon, float64",
    model="lj",
    dtype="float64",
    materials=argon_materials,
    fmax=1e-3,
    n_volumes=7,
    volume_strain=0.05,
    n_strains=5,
    strain=0.01,
)
SEVENNET = Case(
    section="9b",
    label="SevenNet-0, float32",
    model="sevennet-0",
    dtype="float32",
    materials=real_materials,
    fmax=2e-2,
    n_volumes=5,
    volume_strain=0.03,
    n_strains=2,
    strain=0.01,
    repeats=1,
    warmup=0,
)
CASES = {"lj": LJ, "sevennet": SEVENNET}


def _eos_sequential(
    calc: Any, crystals: list[Atoms], case: Case
) -> list[tuple[float, float]]:
    from ase.eos import EquationOfState
    from ase.optimize import FIRE

    factors = np.linspace(
        1 - case.volume_strain, 1 + case.volume_strain, case.n_volumes
    )
    fits = []
    for atoms in crystals:
        volumes, energies = [], []
        for factor in factors:
            scaled = atoms.copy()
            scaled.set_cell(atoms.cell.array * factor, scale_atoms=True)
            scaled.calc = calc
            FIRE(scaled, logfile=None).run(fmax=case.fmax, steps=1000)
            volumes.append(scaled.get_volume())
            energies.append(scaled.get_potential_energy())
        v0, _, bulk_modulus = EquationOfState(
            volumes, energies, eos="birchmurnaghan"
        ).fit(warn=False)
        fits.append((v0, bulk_modulus / units.GPa))
    return fits


def _elastic_sequential(
    calc: Any, crystals: list[Atoms], case: Case
) -> list[np.ndarray]:
    from ase.optimize import FIRE
    from matscipy.elasticity import fit_elastic_constants

    out = []
    for atoms in crystals:
        copy = atoms.copy()
        copy.calc = calc
        stiffness, _ = fit_elastic_constants(
            copy,
            symmetry="triclinic",
            N_steps=case.n_strains,
            delta=2 * case.strain / (case.n_strains - 1),
            optimizer=FIRE,
            verbose=False,
            fmax=case.fmax,
        )
        out.append(stiffness / units.GPa)
    return out


def compare(
    crystals: list[Atoms],
    repeats: int,
    timer: Callable[..., list[float]],
    warmup: int = 1,
    case: Case = LJ,
) -> list[list[str]]:
    """Time both workflows both ways; one table row each."""
    from nvalchemi_ase import NVAlchemiCalculator
    from nvalchemi_ase.properties import elastic_constants, equation_of_state

    calc = NVAlchemiCalculator(case.model, device="cpu", dtype=case.dtype)
    _prime(calc, crystals)
    captured: dict[str, Any] = {}
    evaluated: list[int] = []  # graphs per model call, while a batched side runs
    calc.model.register_forward_hook(
        lambda module, inputs, outputs: evaluated.append(int(inputs[0].num_graphs))
    )

    def eos_batched() -> None:
        evaluated.clear()
        captured["eos"] = equation_of_state(
            crystals,
            calc,
            n_volumes=case.n_volumes,
            strain=case.volume_strain,
            relax="ions",
            fmax=case.fmax,
        )
        captured["eos_cells"] = sum(evaluated)

    def eos_sequential() -> None:
        captured["eos_ref"] = _eos_sequential(calc, crystals, case)

    def elastic_batched() -> None:
        evaluated.clear()
        captured["elastic"] = elastic_constants(
            crystals,
            calc,
            strain=case.strain,
            n_strains=case.n_strains,
            fmax=case.fmax,
        )
        captured["elastic_cells"] = sum(evaluated)

    def elastic_sequential() -> None:
        captured["elastic_ref"] = _elastic_sequential(calc, crystals, case)

    rows = []
    batched, sequential = timer([eos_batched, eos_sequential], repeats, warmup)
    pairs = list(zip(captured["eos"], captured["eos_ref"], strict=True))
    v0_error = max(abs(r.v0 - v0) / v0 for r, (v0, _) in pairs)
    b_error = max(abs(r.B - b) / b for r, (_, b) in pairs)
    relaxed, steps = _steps(np.concatenate([r.relax_steps for r in captured["eos"]]))
    rows.append(
        [
            f"EOS, ions relaxed at {case.n_volumes} volumes",
            str(len(crystals) * case.n_volumes),
            str(relaxed),
            steps,
            str(captured["eos_cells"]),
            f"{batched:.2f}",
            f"{sequential:.2f}",
            f"{sequential / batched:.1f}×",
            f"V0 {v0_error:.1e}, B {b_error:.1e} (relative)",
        ]
    )
    batched, sequential = timer([elastic_batched, elastic_sequential], repeats, warmup)
    elastic = list(zip(captured["elastic"], captured["elastic_ref"], strict=True))
    c_error = max(float(np.abs(r.C - c).max()) for r, c in elastic)
    c_scale = max(float(np.abs(c).max()) for _, c in elastic)
    relaxed, steps = _steps(
        np.concatenate([_elastic_cells(r) for r in captured["elastic"]])
    )
    nonzero = int(np.count_nonzero(np.linspace(-1, 1, case.n_strains)))
    rows.append(
        [
            f"elastic C_ij, ions relaxed, {case.n_strains} strains x 6",
            str(len(crystals) * (1 + 6 * nonzero)),
            str(relaxed),
            steps,
            str(captured["elastic_cells"]),
            f"{batched:.2f}",
            f"{sequential:.2f}",
            f"{sequential / batched:.1f}×",
            f"C {c_error:.1e} GPa (max abs; largest C_ij {c_scale:.0f} GPa)",
        ]
    )
    return rows


def _prime(calc: Any, crystals: list[Atoms]) -> None:
    """One batched and one single call: the model's first-call costs, untimed."""
    calc.calculate_batch(crystals, ["energy", "forces", "stress"])
    atoms = crystals[0].copy()
    atoms.calc = calc
    atoms.get_forces()


def _elastic_cells(result: Any) -> np.ndarray:
    """Steps of each distinct strained cell (and the reference, once)."""
    strained = result.strains != 0.0
    return np.concatenate(
        [result.relax_steps[:, strained].ravel(), result.relax_steps[0, ~strained]]
    )


def _steps(per_cell: np.ndarray) -> tuple[int, str]:
    """Cells the optimizer moved, and their FIRE steps: sum / longest."""
    moved = per_cell[per_cell > 0]
    return int(moved.size), f"{int(moved.sum())} / {int(moved.max(initial=0))}"


HEADER = [
    "workflow",
    "structures",
    "relaxed",
    "FIRE steps (sum / longest)",
    "batched cell-evaluations",
    "batched [s]",
    "ASE/matscipy loop [s]",
    "speed-up",
    "batched vs loop",
]


def note(case: Case, repeats: int, warmup: int) -> str:
    """What was run, for the table's note."""
    timing = (
        f"median of {repeats} rounds after {warmup} warm-up round(s)"
        if repeats > 1 or warmup
        else "one round after a single-point warm-up"
    )
    return (
        f"Rattled crystals (2-8 atoms), {case.label} on the CPU, one "
        "NVAlchemiCalculator for both sides; batched: nvalchemi_ase.properties "
        "(one in-flight FIRE run, nvalchemi_ase.runners.relax, over every cell "
        "that has forces); loop: "
        "ase.optimize.FIRE per cell with ase.eos / matscipy.elasticity; fmax "
        f"{case.fmax} eV/Å on both sides; EOS lattice ±{case.volume_strain}, "
        f"elastic strains ±{case.strain}; {timing}, sides timed in alternation. "
        "FIRE steps of the relaxed cells: their sum is the loop's work (our FIRE "
        "takes ASE's path structure by structure), the longest is the batched "
        "run's length. Batched cell-evaluations: cells the model evaluated in "
        "the batched workflow, summed over its calls (single points and "
        "relaxation; a converged cell leaves the working batch, so the "
        "relaxation's share is about the step sum plus one per cell, not cells "
        "x longest)."
    )


def sizes(case: Case, quick: bool, repeats: int) -> tuple[int, int, int]:
    """Materials, timed rounds and warm-up rounds (quick: 1 material, 1 round)."""
    if quick:
        return 1, 1, 0
    return 8, case.repeats or repeats, case.warmup


def table(case: Case, quick: bool, repeats: int, report: Any) -> None:
    """Run ``case`` and add its table to ``report``."""
    from benchmarks.harness import interleaved_medians

    count, repeats, warmup = sizes(case, quick, repeats)
    rows = compare(
        case.materials(count), repeats, interleaved_medians, warmup=warmup, case=case
    )
    report.table(
        f"{case.section}. Batched property workflows vs ASE/matscipy loops "
        f"({case.label}, {count} materials)",
        HEADER,
        rows,
        note(case, repeats, warmup),
    )


def run(settings: Any, report: Any) -> None:
    """Section 9a of ``python -m benchmarks`` (LJ)."""
    table(LJ, settings.quick, settings.repeats, report)


def run_sevennet(settings: Any, report: Any) -> None:
    """Section 9b of ``python -m benchmarks`` (SevenNet-0; skipped without sevenn)."""
    import importlib.util

    if importlib.util.find_spec("sevenn") is None:
        report.sections.append(
            f"## {SEVENNET.section}. Batched property workflows on SevenNet-0\n\n"
            "`sevenn` is not installed: skipped."
        )
        return
    table(SEVENNET, settings.quick, settings.repeats, report)


def main(argv: list[str] | None = None) -> int:
    """Run this benchmark alone and print its table."""
    from benchmarks.harness import Report

    parser = argparse.ArgumentParser(prog="python -m benchmarks.properties")
    parser.add_argument("--model", choices=sorted(CASES), default="lj")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--quick", action="store_true", help="1 material, 1 repeat, no warm-up"
    )
    args = parser.parse_args(argv)
    start = time.perf_counter()
    report = Report()
    table(CASES[args.model], args.quick, args.repeats, report)
    print(f"total {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
