"""In-flight relaxation vs fixed chunks vs one by one (LJ, FIRE).

Heterogeneous LJ argon structures (4-256 atoms, random strains and rattles),
FIRE to 0.05 eV/Å, three ways:

* :func:`nvalchemi_ase.runners.irelax` with an atom budget (finished
  structures leave, queued ones are admitted);
* consecutive fixed chunks within the same atom budget, one batched
  ``nvalchemi_ase.optimize.FIRE`` run each (a chunk runs until its slowest
  structure converges);
* ``ase.optimize.FIRE`` with :class:`~nvalchemi_ase.NVAlchemiCalculator`, one
  structure after another (a subset timed, extrapolated).

Run alone: ``python -m benchmarks.runners [--count N] [--max-atoms M]``, or in
the suite: ``python -m benchmarks --only runners``.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

FMAX = 0.05
STEPS = 1000


def make_structures(count: int, seed: int = 0) -> list[Any]:
    """``count`` fcc argon cells of 4-256 atoms, strained (±3 %) and rattled."""
    from ase.build import bulk

    rng = np.random.default_rng(seed)
    structures = []
    while len(structures) < count:
        repeat = rng.integers(1, 5, size=3)
        if repeat.prod() > 64:
            continue
        atoms = bulk("Ar", "fcc", a=5.26, cubic=True) * tuple(int(r) for r in repeat)
        strain = np.eye(3) + rng.uniform(-0.03, 0.03, (3, 3))
        atoms.set_cell(atoms.cell.array @ strain, scale_atoms=True)
        atoms.rattle(rng.uniform(0.02, 0.1), seed=int(rng.integers(1 << 30)))
        structures.append(atoms)
    return structures


def _in_flight(structures: list[Any], calc: Any, max_atoms: int) -> float:
    from nvalchemi_ase.runners import irelax

    start = time.perf_counter()
    for _ in irelax(
        structures, calc, optimizer="FIRE", fmax=FMAX, steps=STEPS, max_atoms=max_atoms
    ):
        pass
    return time.perf_counter() - start


def _chunked(structures: list[Any], calc: Any, max_atoms: int) -> float:
    from nvalchemi_ase.optimize import FIRE

    start = time.perf_counter()
    chunk: list[Any] = []
    for atoms in [*structures, None]:
        if chunk and (atoms is None or sum(map(len, chunk)) + len(atoms) > max_atoms):
            images = [a.copy() for a in chunk]
            for image in images:
                image.calc = calc
            FIRE(images, logfile=None).run(fmax=FMAX, steps=STEPS)
            chunk = []
        if atoms is not None:
            chunk.append(atoms)
    return time.perf_counter() - start


def _one_by_one(structures: list[Any], calc: Any) -> float:
    from ase.optimize import FIRE

    start = time.perf_counter()
    for atoms in structures:
        copy = atoms.copy()
        copy.calc = calc
        FIRE(copy, logfile=None).run(fmax=FMAX, steps=STEPS)
    return time.perf_counter() - start


def measure(
    count: int, max_atoms: int, sequential: int, device: str = "cpu"
) -> list[list[str]]:
    """Structures per second of the three ways; rows for the report table."""
    from nvalchemi_ase import NVAlchemiCalculator

    calc = NVAlchemiCalculator("lj", device=device, dtype="float64")
    structures = make_structures(count)
    warm = make_structures(4, seed=1)
    _in_flight(warm, calc, max_atoms)
    _chunked(warm, calc, max_atoms)
    timed = min(sequential, count)
    figures = [
        ("in-flight `irelax`", _in_flight(structures, calc, max_atoms), count),
        ("fixed chunks, batched FIRE", _chunked(structures, calc, max_atoms), count),
        (
            f"one by one, `ase.optimize.FIRE` ({timed} timed)",
            _one_by_one(structures[:timed], calc),
            timed,
        ),
    ]
    return [
        [label, f"{done / seconds:.2f}", f"{seconds * count / done:.1f}"]
        for label, seconds, done in figures
    ]


def run(settings: Any, report: Any) -> None:
    """Benchmark section for :mod:`benchmarks.run`."""
    count, max_atoms, sequential = (40, 1024, 8) if settings.quick else (1000, 4096, 50)
    rows = measure(count, max_atoms, sequential, settings.device)
    report.table(
        "6. In-flight relaxation",
        ["method", "structures/s", f"s for {count} (extrapolated)"],
        rows,
        f"{count} LJ argon structures of 4-256 atoms (random ±3 % strains, "
        f"0.02-0.1 Å rattles), FIRE to {FMAX} eV/Å; atom budget {max_atoms}.",
    )


def main() -> None:
    """Print the table for ``--count`` structures."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--max-atoms", type=int, default=4096)
    parser.add_argument("--sequential", type=int, default=50)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    rows = measure(args.count, args.max_atoms, args.sequential, args.device)
    for row in rows:
        print(" | ".join(row))


if __name__ == "__main__":
    main()
