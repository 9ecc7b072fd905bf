"""In-flight relaxation vs fixed chunks vs one by one (LJ, FIRE).

Heterogeneous LJ argon structures (4-256 atoms, random strains and rattles),
FIRE to 0.05 eV/Å, three ways:

* :func:`nvalchemi_ase.runners.irelax` with an atom budget (finished
  structures leave, queued ones are admitted);
* consecutive fixed chunks within the same atom budget, one batched
  ``nvalchemi_ase.optimize.FIRE`` run each (a chunk runs until its slowest
  structure converges; its converged structures stay in the batch, frozen,
  and are evaluated with it every step);
* ``ase.optimize.FIRE`` with :class:`~nvalchemi_ase.NVAlchemiCalculator`, one
  structure after another (a subset timed, extrapolated).

Besides the rates, every run counts its work: structure-steps (each
structure's own steps, summed), model evaluations (calls) and atoms evaluated
(atoms summed over calls). The paths are the same three ways (ASE's FIRE
arithmetic), so the structure-steps agree and the atoms evaluated tell the
work each way spends; ``ceiling`` is the fixed chunks' atoms evaluated over
the least any runner must evaluate, Σ atoms × (steps + 1): the in-flight
speed-up over the chunks if a step's cost were proportional to its atoms and
refills were free.

Run alone: ``python -m benchmarks.runners [--count N] [--max-atoms M]
[--repeats R]``, or in the suite: ``python -m benchmarks --only runners``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
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


@dataclass
class Work:
    """What one run did: wall time, each structure's steps, model calls, atoms."""

    seconds: float
    steps: list[int]
    calls: int = 0
    atoms: int = 0


class _Counted:
    """Counts the calls of a calculator's model and the atoms they evaluate."""

    def __init__(self, calc: Any) -> None:
        self.calls = self.atoms = 0
        model = calc.model
        forward = model.forward

        def counting(batch: Any, *args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            self.atoms += int(batch.num_nodes)
            return forward(batch, *args, **kwargs)

        model.forward = counting

    def run(self, function: Callable[[], tuple[float, list[int]]]) -> Work:
        self.calls = self.atoms = 0
        seconds, steps = function()
        return Work(seconds, steps, self.calls, self.atoms)


def _in_flight(
    structures: list[Any], calc: Any, max_atoms: int
) -> tuple[float, list[int]]:
    from nvalchemi_ase.runners import irelax

    steps = [0] * len(structures)
    start = time.perf_counter()
    for index, atoms in irelax(
        structures, calc, optimizer="FIRE", fmax=FMAX, steps=STEPS, max_atoms=max_atoms
    ):
        steps[index] = int(atoms.info["steps"])
    return time.perf_counter() - start, steps


def _chunks(structures: list[Any], max_atoms: int) -> list[list[int]]:
    """Consecutive chunks of input indices within ``max_atoms``."""
    chunks: list[list[int]] = [[]]
    used = 0
    for index, atoms in enumerate(structures):
        if chunks[-1] and used + len(atoms) > max_atoms:
            chunks.append([])
            used = 0
        chunks[-1].append(index)
        used += len(atoms)
    return chunks


def _chunked(
    structures: list[Any], calc: Any, max_atoms: int
) -> tuple[float, list[int]]:
    from nvalchemi_ase.optimize import FIRE

    steps = [0] * len(structures)
    start = time.perf_counter()
    for chunk in _chunks(structures, max_atoms):
        images = [structures[index].copy() for index in chunk]
        for image in images:
            image.calc = calc
        optimizer = FIRE(images, logfile=None)
        optimizer.run(fmax=FMAX, steps=STEPS)
        for index, step in zip(chunk, optimizer.converged_at_step, strict=True):
            steps[index] = int(step)
    return time.perf_counter() - start, steps


def _one_by_one(structures: list[Any], calc: Any) -> tuple[float, list[int]]:
    from ase.optimize import FIRE

    steps = []
    start = time.perf_counter()
    for atoms in structures:
        copy = atoms.copy()
        copy.calc = calc
        optimizer = FIRE(copy, logfile=None)
        optimizer.run(fmax=FMAX, steps=STEPS)
        steps.append(optimizer.nsteps)
    return time.perf_counter() - start, steps


def ceiling(structures: list[Any], steps: list[int], max_atoms: int) -> float:
    """Fixed chunks' atoms evaluated over the least needed, Σ atoms × (steps + 1)."""
    sizes = np.array([len(atoms) for atoms in structures])
    counts = np.asarray(steps) + 1
    chunked = sum(
        int(sizes[chunk].sum() * counts[chunk].max())
        for chunk in _chunks(structures, max_atoms)
    )
    return chunked / float((sizes * counts).sum())


def measure(
    count: int,
    max_atoms: int,
    sequential: int,
    device: str = "cpu",
    repeats: int = 3,
) -> tuple[list[list[str]], str]:
    """Rows for the report table and a line on the work ceiling.

    In-flight and chunks are timed in alternation, ``repeats`` rounds after a
    warm-up; their median wall time is reported. One by one is timed once on
    the first ``sequential`` structures and extrapolated to ``count``.
    """
    from nvalchemi_ase import NVAlchemiCalculator

    calc = NVAlchemiCalculator("lj", device=device, dtype="float64")
    counted = _Counted(calc)
    structures = make_structures(count)
    warm = make_structures(4, seed=1)
    _in_flight(warm, calc, max_atoms)
    _chunked(warm, calc, max_atoms)
    runs: dict[str, list[Work]] = {"in-flight": [], "chunks": []}
    for _ in range(repeats):
        runs["in-flight"].append(
            counted.run(lambda: _in_flight(structures, calc, max_atoms))
        )
        runs["chunks"].append(
            counted.run(lambda: _chunked(structures, calc, max_atoms))
        )
    timed = min(sequential, count)
    alone = counted.run(lambda: _one_by_one(structures[:timed], calc))
    seconds = {
        name: statistics.median(work.seconds for work in works)
        for name, works in runs.items()
    }
    seconds["one by one"] = alone.seconds * count / timed
    labels = {
        "in-flight": "in-flight `irelax`",
        "chunks": "fixed chunks, batched FIRE",
        "one by one": f"one by one, `ase.optimize.FIRE` ({timed} timed)",
    }
    works = {"in-flight": runs["in-flight"][0], "chunks": runs["chunks"][0]}
    works["one by one"] = alone
    rows = []
    for name, work in works.items():
        scale = count / len(work.steps)  # one by one: extrapolated
        rows.append(
            [
                labels[name],
                f"{count / seconds[name]:.2f}",
                f"{seconds[name]:.1f}",
                f"{sum(work.steps) * scale:.0f}",
                f"{work.calls * scale:.0f}",
                f"{work.atoms * scale / 1e6:.3f}",
                f"{seconds['chunks'] / seconds[name]:.2f}",
                f"{seconds['one by one'] / seconds[name]:.1f}",
            ]
        )
    steps = runs["in-flight"][0].steps
    same = steps == runs["chunks"][0].steps
    note = (
        f"Work ceiling of in-flight over chunks (atoms evaluated): "
        f"{ceiling(structures, steps, max_atoms):.2f}; steps per structure "
        f"{min(steps)}-{max(steps)} (mean {np.mean(steps):.1f}); in-flight and "
        f"chunk steps per structure {'identical' if same else 'DIFFER'}; "
        f"wall times: median of {repeats} alternated rounds "
        f"(in-flight {', '.join(f'{w.seconds:.2f}' for w in runs['in-flight'])} s; "
        f"chunks {', '.join(f'{w.seconds:.2f}' for w in runs['chunks'])} s)."
    )
    return rows, note


HEADER = [
    "method",
    "structures/s",
    "wall s",
    "structure-steps",
    "model evaluations",
    "atoms evaluated (M)",
    "× chunks",
    "× one by one",
]


def run(settings: Any, report: Any) -> None:
    """Benchmark section for :mod:`benchmarks.run`."""
    count, max_atoms, sequential, repeats = (
        (40, 1024, 8, 1) if settings.quick else (1000, 4096, 50, 3)
    )
    rows, note = measure(count, max_atoms, sequential, settings.device, repeats)
    report.table(
        "10. In-flight relaxation vs fixed chunks vs one by one (LJ, FIRE)",
        HEADER,
        rows,
        f"{count} LJ argon structures of 4-256 atoms (random ±3 % strains, "
        f"0.02-0.1 Å rattles), FIRE to {FMAX} eV/Å; atom budget {max_atoms}. " + note,
    )


def main() -> None:
    """Print the table for ``--count`` structures."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--max-atoms", type=int, default=4096)
    parser.add_argument("--sequential", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    rows, note = measure(
        args.count, args.max_atoms, args.sequential, args.device, args.repeats
    )
    print("| " + " | ".join(HEADER) + " |")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print(note)


if __name__ == "__main__":
    main()
