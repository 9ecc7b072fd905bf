"""Batched surface and defect energies vs the sequential ASE loop.

Run from the repository root::

    .venv/bin/python -m benchmarks.surfaces_defects [--model lj|sevennet]
        [--repeats 3] [--quick]

(also ``python -m benchmarks --only surfaces-defects`` and
``surfaces-defects-sevennet``; the "Workflows"
section of ``docs/performance.md``). One ``NVAlchemiCalculator`` is shared by
both sides:

* surfaces: :func:`nvalchemi_ase.properties.surface_energies` (every slab of
  every material and every bulk reference through one in-flight FIRE run,
  :func:`nvalchemi_ase.runners.relax`) vs ``ase.build.surface`` and one
  ``ase.optimize.FIRE`` per slab (matcalc's ``SurfaceCalc`` loop);
* defects: :func:`nvalchemi_ase.properties.defect_formation_energies`
  (vacancy and self-interstitial of every material, one in-flight FIRE run)
  vs one ``ase.optimize.FIRE`` per defect supercell.

Materials: fcc argon at four lattice constants (LJ, float64) or Cu, Al, Ni
and Ag (SevenNet-0, float32), conventional cubic cells, facets (100), (110),
(111) of 3 cell layers, 2×2×2 supercells (31-33 atoms). Both sides relax to
the same ``fmax``; they are timed in alternation and medians reported, with
the largest difference between their results.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from ase import Atoms
from ase.build import bulk, make_supercell, surface

FACETS = [(1, 0, 0), (1, 1, 0), (1, 1, 1)]
LAYERS = 3
VACUUM = 8.0  # Å, each side


@dataclass(frozen=True)
class Case:
    """One model's benchmark."""

    label: str
    model: str
    dtype: str
    materials: Callable[[], list[Atoms]]
    fmax: float  # eV/Å, both sides
    repeats: int | None = None
    warmup: int = 1


def argon() -> list[Atoms]:
    """Four fcc argon cells (4 atoms) at lattice constants around 5.26 Å."""
    return [bulk("Ar", "fcc", a=a, cubic=True) for a in (5.22, 5.26, 5.30, 5.34)]


def metals() -> list[Atoms]:
    """Cu, Al, Ni, Ag conventional cells near SevenNet-0's lattice constants."""
    return [
        bulk(name, "fcc", a=a, cubic=True)
        for name, a in (("Cu", 3.62), ("Al", 4.04), ("Ni", 3.52), ("Ag", 4.15))
    ]


LJ = Case("LJ argon, float64", "lj", "float64", argon, fmax=1e-3)
SEVENNET = Case(
    "SevenNet-0, float32", "sevennet-0", "float32", metals, 2e-2, repeats=1, warmup=0
)
CASES = {"lj": LJ, "sevennet": SEVENNET}


def _fire(calc: Any, atoms: Atoms, fmax: float) -> tuple[float, int]:
    """ASE's FIRE on one structure: energy (eV) and steps."""
    from ase.optimize import FIRE

    atoms = atoms.copy()
    atoms.calc = calc
    optimizer = FIRE(atoms, logfile=None)
    optimizer.run(fmax=fmax, steps=2000)
    return atoms.get_potential_energy(), optimizer.nsteps


def surfaces_sequential(calc: Any, crystals: list[Atoms], fmax: float) -> np.ndarray:
    """γ (eV/Å²) [material, facet], one FIRE per slab and bulk."""
    out = []
    for crystal in crystals:
        e_bulk = _fire(calc, crystal, fmax)[0] / len(crystal)
        row = []
        for hkl in FACETS:
            slab = surface(crystal, hkl, LAYERS, vacuum=VACUUM)
            area = np.linalg.norm(np.cross(slab.cell[0], slab.cell[1]))
            row.append((_fire(calc, slab, fmax)[0] - len(slab) * e_bulk) / (2 * area))
        out.append(row)
    return np.array(out)


def defects_sequential(calc: Any, crystals: list[Atoms], fmax: float) -> np.ndarray:
    """E_f (eV) [material, (vacancy, interstitial)], one FIRE per supercell."""
    from nvalchemi_ase.properties.defects import largest_void

    out = []
    for crystal in crystals:
        e_cell = _fire(calc, crystal, fmax)[0]
        perfect = make_supercell(crystal, np.diag([2, 2, 2]))
        e_bulk = e_cell * len(perfect) / len(crystal)
        mu = e_bulk / len(perfect)
        vacancy = perfect.copy()
        del vacancy[0]
        interstitial = perfect.copy()
        interstitial.append(crystal.get_chemical_symbols()[0])
        interstitial.positions[-1] = largest_void(crystal)
        out.append(
            [
                _fire(calc, vacancy, fmax)[0] - e_bulk + mu,
                _fire(calc, interstitial, fmax)[0] - e_bulk - mu,
            ]
        )
    return np.array(out)


def compare(case: Case, repeats: int, warmup: int, quick: bool) -> list[list[str]]:
    """Time both workflows both ways; one table row each."""
    from benchmarks.harness import interleaved_medians
    from nvalchemi_ase import NVAlchemiCalculator
    from nvalchemi_ase.properties import defect_formation_energies, surface_energies

    calc = NVAlchemiCalculator(case.model, device="cpu", dtype=case.dtype)
    crystals = case.materials()[: 1 if quick else None]
    _prime(calc, crystals)
    captured: dict[str, Any] = {}
    evaluated: list[int] = []
    calc.model.register_forward_hook(
        lambda module, inputs, outputs: evaluated.append(int(inputs[0].num_graphs))
    )

    def surfaces_batched() -> None:
        evaluated.clear()
        captured["surfaces"] = surface_energies(
            crystals, calc, miller=FACETS, layers=LAYERS, vacuum=VACUUM, fmax=case.fmax
        )
        captured["surfaces_cells"] = sum(evaluated)

    def surfaces_loop() -> None:
        captured["surfaces_ref"] = surfaces_sequential(calc, crystals, case.fmax)

    def defects_batched() -> None:
        evaluated.clear()
        captured["defects"] = defect_formation_energies(
            crystals,
            calc,
            defects=("vacancy", "interstitial"),
            supercell=2,
            fmax=case.fmax,
        )
        captured["defects_cells"] = sum(evaluated)

    def defects_loop() -> None:
        captured["defects_ref"] = defects_sequential(calc, crystals, case.fmax)

    rows = []
    batched, loop = interleaved_medians(
        [surfaces_batched, surfaces_loop], repeats, warmup
    )
    for result in captured["surfaces"]:
        if not result.ok:
            raise RuntimeError(f"surface benchmark failed: {result.error}")
    gammas = np.array([r.surface_energies for r in captured["surfaces"]])
    error = float(np.abs(gammas - captured["surfaces_ref"]).max())
    steps = np.concatenate([r.relax_steps for r in captured["surfaces"]])
    rows.append(
        _row(
            f"surface energies, {len(FACETS)} facets, {LAYERS} layers",
            len(crystals) * len(FACETS),
            steps,
            captured["surfaces_cells"],
            batched,
            loop,
            f"γ {error * 16.0218:.1e} J/m² (max abs; γ ≈ "
            f"{float(np.abs(gammas).max()) * 16.0218:.3f})",
        )
    )
    batched, loop = interleaved_medians(
        [defects_batched, defects_loop], repeats, warmup
    )
    for result in captured["defects"]:
        if not result.ok:
            raise RuntimeError(f"defect benchmark failed: {result.error}")
    formation = np.array([r.formation_energies for r in captured["defects"]])
    error = float(np.abs(formation - captured["defects_ref"]).max())
    steps = np.concatenate([r.relax_steps for r in captured["defects"]])
    rows.append(
        _row(
            "vacancy + interstitial, 2×2×2 supercells",
            2 * len(crystals),
            steps,
            captured["defects_cells"],
            batched,
            loop,
            f"E_f {error:.1e} eV (max abs; E_f up to {float(formation.max()):.3f})",
        )
    )
    return rows


def _prime(calc: Any, crystals: list[Atoms]) -> None:
    """A batched call and a one-step relaxation: first-call costs, untimed.

    The first relaxation of a process imports the relaxation machinery
    (about 2 s unloaded, 20 s on the loaded 2-core CPU), which the quick mode
    (no warm-up round) would otherwise put on the batched side.
    """
    from nvalchemi_ase.runners import relax

    calc.calculate_batch(crystals, ["energy", "forces"])
    rattled = crystals[0].copy()
    rattled.rattle(0.01, seed=0)
    relax([rattled], calc, steps=1, progress=False, distributed=False)


def _row(
    name: str,
    count: int,
    steps: np.ndarray,
    cells: int,
    batched: float,
    loop: float,
    agreement: str,
) -> list[str]:
    moved = steps[steps > 0]
    return [
        name,
        str(count),
        f"{int(moved.sum())} / {int(moved.max(initial=0))}",
        str(cells),
        f"{batched:.2f}",
        f"{loop:.2f}",
        f"{loop / batched:.1f}×",
        agreement,
    ]


HEADER = [
    "workflow",
    "structures",
    "FIRE steps (sum / longest)",
    "batched cell-evaluations",
    "batched [s]",
    "ASE loop [s]",
    "speed-up",
    "batched vs loop",
]


def table(case: Case, quick: bool, repeats: int, report: Any) -> None:
    """Run ``case`` and add its table to ``report``."""
    repeats, warmup = (1, 0) if quick else (case.repeats or repeats, case.warmup)
    rows = compare(case, repeats, warmup, quick)
    count = 1 if quick else len(case.materials())
    timing = (
        f"median of {repeats} rounds after {warmup} warm-up round(s)"
        if repeats > 1 or warmup
        else "one round after a single-point warm-up"
    )
    report.table(
        f"Workflows: surface and defect energies, batched vs the ASE loop "
        f"({case.label}, {count} materials)",
        HEADER,
        rows,
        f"fcc conventional cells on the CPU, one NVAlchemiCalculator for both "
        f"sides; batched: nvalchemi_ase.properties (every slab/supercell and bulk "
        f"reference of every material in one in-flight FIRE run); loop: "
        f"ase.optimize.FIRE structure by structure; fmax {case.fmax} eV/Å; "
        f"{timing}, sides timed in alternation. FIRE steps: their sum is the "
        "loop's work, the longest the batched run's length; batched "
        "cell-evaluations: structures the model evaluated, summed over calls.",
    )


def run_lj(settings: Any, report: Any) -> None:
    """``--only surfaces-defects``: both workflows on LJ (one table)."""
    table(LJ, settings.quick, settings.repeats, report)


def run_sevennet(settings: Any, report: Any) -> None:
    """``--only surfaces-defects-sevennet`` (skipped without sevenn or quick)."""
    import importlib.util

    reason = (
        "`sevenn` is not installed"
        if importlib.util.find_spec("sevenn") is None
        else "minutes of SevenNet-0 on a CPU: not in --quick mode"
        if settings.quick
        else None
    )
    if reason is not None:
        report.sections.append(
            f"## Workflows: surface and defect energies on SevenNet-0\n\n{reason}: "
            "skipped."
        )
        return
    table(SEVENNET, settings.quick, settings.repeats, report)


def main(argv: list[str] | None = None) -> int:
    """Run this benchmark alone and print its table."""
    from benchmarks.harness import Report

    parser = argparse.ArgumentParser(prog="python -m benchmarks.surfaces_defects")
    parser.add_argument("--model", choices=sorted(CASES), default="lj")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="1 material, 1 round")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    table(CASES[args.model], args.quick, args.repeats, Report())
    print(f"total {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
