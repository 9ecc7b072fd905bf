"""Per-structure MD analysis (RDF, MSD), batched vs a per-structure ASE loop.

Run from the repository root::

    .venv/bin/python -m benchmarks.md_analysis [--repeats 3] [--quick]

(also ``python -m benchmarks --only md-analysis``, part of ``--only
workflows``). LJ argon, float64, B structures of 108 atoms (fcc, rattled,
300 K: a liquid within a few hundred steps). Two rows, both sides timed in
alternation, medians reported:

* files: the RDF (``rmax`` 7 Å, 140 bins) and the MSD (lags up to a quarter
  of the frames, every time origin) of B stored trajectories of F frames:
  :func:`nvalchemi_ase.analysis.radial_distribution` and
  :func:`~nvalchemi_ase.analysis.mean_squared_displacement` on all of them vs,
  structure by structure, ASE's ``get_rdf`` on every frame and a NumPy MSD
  over the same lags and origins;
* MD + analysis: one batched ``VelocityVerlet`` run with ``RDFObserver`` and
  ``TransportObserver`` streaming (no frames kept) vs, structure by structure,
  ASE's ``VelocityVerlet`` with ``NVAlchemiCalculator`` and an observer taking
  ``get_rdf`` and the positions every ``k`` steps, the MSD computed after.

The check column gives the largest difference of the two sides' results:
``Δg`` (absolute) and the largest relative MSD difference (same dynamics: ASE's
velocity Verlet and the batched one agree to rounding over these runs).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from ase import Atoms, units
from ase.build import bulk

RMAX, NBINS = 7.0, 140
TEMPERATURE_K = 300.0
DT = 5 * units.fs
HEADER = [
    "workflow",
    "structures × samples",
    "batched [s]",
    "ASE loop [s]",
    "speed-up",
    "largest Δg / rel. ΔMSD",
]
NOTE = (
    "LJ argon, float64, CPU, {count} structures of 108 atoms; medians of "
    "{repeats} alternated rounds after a warm-up. files: RDF + MSD of stored "
    "trajectories (analysis only). MD + analysis: NVE run with streamed RDF and "
    "MSD vs ASE's VelocityVerlet + get_rdf per sample + NumPy MSD, structure "
    "by structure."
)


@dataclass(frozen=True)
class Sizes:
    """Batch size, frames of the file row, MD steps and sampling interval."""

    structures: int
    frames: int
    steps: int
    interval: int


FULL = Sizes(structures=8, frames=30, steps=150, interval=5)
QUICK = Sizes(structures=2, frames=8, steps=20, interval=5)


def liquid(seed: int) -> Atoms:
    """108 argon atoms, rattled fcc with 300 K momenta."""
    atoms = bulk("Ar", "fcc", a=5.26, cubic=True).repeat(3)
    atoms.rattle(0.1, seed=seed)
    rng = np.random.default_rng(seed)
    masses = atoms.get_masses()[:, None]
    atoms.set_momenta(
        rng.normal(size=(len(atoms), 3)) * np.sqrt(masses * units.kB * TEMPERATURE_K)
    )
    return atoms


def stored_trajectories(calc: Any, sizes: Sizes) -> list[list[Atoms]]:
    """B trajectories of F frames (one batched NVE run, a frame per interval)."""
    from nvalchemi_ase.md import VelocityVerlet

    images = [liquid(seed) for seed in range(sizes.structures)]
    for atoms in images:
        atoms.calc = calc
    dyn = VelocityVerlet(images, DT)
    frames: list[list[Atoms]] = [[] for _ in images]

    def keep() -> None:
        for store, atoms in zip(frames, images, strict=True):
            store.append(
                Atoms(atoms.numbers, atoms.positions, cell=atoms.cell, pbc=True)
            )

    dyn.attach(keep, interval=sizes.interval)
    dyn.run(sizes.interval * (sizes.frames - 1))
    return frames


def ase_rdf(frames: list[Atoms]) -> np.ndarray:
    """ASE's ``get_rdf`` of every frame, averaged."""
    from ase.geometry.rdf import get_rdf

    return np.mean([get_rdf(atoms, RMAX, NBINS)[0] for atoms in frames], axis=0)


def numpy_msd(positions: np.ndarray, cell: np.ndarray, lags: int) -> np.ndarray:
    """MSD (Å²) at lags 0..lags-1 over every time origin, unwrapped (one structure)."""
    fractional = positions @ np.linalg.inv(cell)
    steps = np.diff(fractional, axis=0)
    steps -= np.round(steps)
    unwrapped = np.concatenate([fractional[:1], fractional[:1] + np.cumsum(steps, 0)])
    cartesian = unwrapped @ cell
    msd = np.zeros(lags)
    for lag in range(1, lags):
        moved = cartesian[lag:] - cartesian[:-lag]
        msd[lag] = (moved**2).sum(axis=-1).mean()
    return msd


def files_row(calc: Any, sizes: Sizes, repeats: int) -> list[str]:
    from benchmarks.harness import interleaved_medians
    from nvalchemi_ase.analysis import mean_squared_displacement, radial_distribution

    trajectories = stored_trajectories(calc, sizes)
    lags = max(2, sizes.frames // 4)
    interval = sizes.interval * DT
    results: dict[str, Any] = {}

    def batched() -> None:
        results["rdf"] = [r.g for r in radial_distribution(trajectories, RMAX, NBINS)]
        results["msd"] = [
            r.curve
            for r in mean_squared_displacement(
                trajectories,
                interval,
                window=lags,
                block_length=sizes.frames,
                remove_drift=False,
            )
        ]

    def loop() -> None:
        results["ase_rdf"] = [ase_rdf(frames) for frames in trajectories]
        results["ase_msd"] = [
            numpy_msd(
                np.array([a.positions for a in frames]), frames[0].cell.array, lags
            )
            for frames in trajectories
        ]

    ours, theirs = interleaved_medians([batched, loop], repeats)
    check = _differences(results)
    count = f"{sizes.structures} × {sizes.frames} frames"
    return _row("files (RDF + MSD)", count, ours, theirs, check)


def md_row(calc: Any, sizes: Sizes, repeats: int) -> list[str]:
    from ase.md.verlet import VelocityVerlet as AseVelocityVerlet

    from benchmarks.harness import interleaved_medians
    from nvalchemi_ase import NVAlchemiCalculator
    from nvalchemi_ase.analysis import RDFObserver, TransportObserver
    from nvalchemi_ase.md import VelocityVerlet

    samples = sizes.steps // sizes.interval + 1
    lags = max(2, samples // 4)
    results: dict[str, Any] = {}

    def batched() -> None:
        images = [liquid(seed) for seed in range(sizes.structures)]
        for atoms in images:
            atoms.calc = calc
        dyn = VelocityVerlet(images, DT)
        rdf = RDFObserver(dyn, RMAX, NBINS)
        transport = TransportObserver(
            dyn, window=lags, block_length=samples, remove_drift=False, viscosity=False
        )
        dyn.attach(rdf, interval=sizes.interval)
        dyn.attach(transport, interval=sizes.interval)
        dyn.run(sizes.steps)
        results["rdf"] = [r.g for r in rdf.result()]
        results["msd"] = [r.curve for r in transport.msd()]

    def loop() -> None:
        rdfs, msds = [], []
        for seed in range(sizes.structures):
            atoms = liquid(seed)
            atoms.calc = NVAlchemiCalculator(calc.model, device="cpu", dtype="float64")
            dyn = AseVelocityVerlet(atoms, DT)
            taken: list[np.ndarray] = []
            positions: list[np.ndarray] = []

            def sample(
                atoms: Atoms = atoms, taken: list = taken, at: list = positions
            ) -> None:
                from ase.geometry.rdf import get_rdf

                taken.append(get_rdf(atoms, RMAX, NBINS)[0])
                at.append(atoms.get_positions())

            dyn.attach(sample, interval=sizes.interval)
            dyn.run(sizes.steps)
            rdfs.append(np.mean(taken, axis=0))
            msds.append(numpy_msd(np.array(positions), atoms.cell.array, lags))
        results["ase_rdf"], results["ase_msd"] = rdfs, msds

    ours, theirs = interleaved_medians([batched, loop], repeats)
    check = _differences(results)
    count = f"{sizes.structures} × {samples} samples"
    return _row("MD + streamed RDF/MSD", count, ours, theirs, check)


def _differences(results: dict[str, Any]) -> str:
    rdf = max(
        float(np.abs(a - b).max())
        for a, b in zip(results["rdf"], results["ase_rdf"], strict=True)
    )
    msd = max(
        float(np.abs(a[1:] - b[1:]).max() / np.abs(b[1:]).max())
        for a, b in zip(results["msd"], results["ase_msd"], strict=True)
    )
    return f"{rdf:.1e} / {msd:.1e}"


def _row(name: str, count: str, ours: float, theirs: float, check: str) -> list[str]:
    return [name, count, f"{ours:.2f}", f"{theirs:.2f}", f"{theirs / ours:.1f}×", check]


def table(quick: bool, repeats: int, report: Any) -> None:
    from nvalchemi_ase import NVAlchemiCalculator

    sizes = QUICK if quick else FULL
    repeats = 1 if quick else repeats
    calc = NVAlchemiCalculator("lj", device="cpu", dtype="float64")
    rows = [files_row(calc, sizes, repeats), md_row(calc, sizes, repeats)]
    report.table(
        "12. MD analysis: per-structure RDF and MSD, batched vs the ASE loop (LJ)",
        HEADER,
        rows,
        NOTE.format(count=sizes.structures, repeats=repeats),
    )


def run(settings: Any, report: Any) -> None:
    """``--only md-analysis`` (section 12)."""
    table(settings.quick, settings.repeats, report)


def main(argv: list[str] | None = None) -> int:
    """Run this benchmark alone and print its table."""
    from benchmarks.harness import Report

    parser = argparse.ArgumentParser(prog="python -m benchmarks.md_analysis")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    table(args.quick, args.repeats, Report())
    print(f"({time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
