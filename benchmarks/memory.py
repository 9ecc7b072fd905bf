"""Peak memory of the runners on a set far larger than RAM in one batch (SevenNet-0).

Rattled silicon cells of 16-64 atoms, as many as it takes for their summed
memory estimate (:func:`nvalchemi_ase.models.memory.memory_estimate`: what one
batch holding all of them would need) to reach ``--times`` × the machine's
RAM, streamed from a generator (never a list) through
:func:`nvalchemi_ase.runners.single_points` and, for a fixed number of steps,
:func:`~nvalchemi_ase.runners.relax` with the default (memory) budget. Each
run is its own process, so its peak resident set size (``ru_maxrss``) is its
own; reported next to the budget and the estimate of one working batch.

Run alone: ``python -m benchmarks.memory [--times 3]``, or in the suite:
``python -m benchmarks --only memory``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
MODEL = "sevennet-0"
GIB = 2**30


def _structures(count: int, seed: int = 0) -> Iterator[Any]:
    """``count`` rattled diamond Si cells of 16-64 atoms, made one at a time."""
    from ase.build import bulk

    rng = np.random.default_rng(seed)
    shapes = [(2, 2, 1), (2, 2, 2), (3, 2, 2), (4, 2, 2)]  # x 8 atoms ... 64
    for _ in range(count):
        shape = shapes[int(rng.integers(len(shapes)))]
        atoms = bulk("Si", "diamond", a=5.43, cubic=True) * shape
        atoms.rattle(0.05, seed=int(rng.integers(1 << 30)))
        yield atoms


def _count_for(times: float) -> tuple[int, float, float, float]:
    """(structures, their summed estimate, RAM, budget) for ``times`` x RAM."""
    from nvalchemi_ase import NVAlchemiCalculator
    from nvalchemi_ase.runners import Budget

    calc = NVAlchemiCalculator(MODEL, device="cpu", dtype="float32")
    budget = Budget.for_calculator(calc, None, None)
    ram = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    total, count = 0.0, 0
    for atoms in _structures(1 << 30):
        if total >= times * ram:
            break
        total += float(budget.cost(atoms)[2])
        count += 1
    return count, total, ram, float(budget.max_bytes or 0.0)


def _worker(kind: str, count: int, steps: int) -> None:
    """One run in this process; print structures/s and the peak RSS."""
    from nvalchemi_ase import NVAlchemiCalculator
    from nvalchemi_ase.runners import irelax, isingle_points

    calc = NVAlchemiCalculator(MODEL, device="cpu", dtype="float32")
    start = time.perf_counter()
    if kind == "single_points":
        done = sum(1 for _ in isingle_points(_structures(count), calc))
    else:
        done = sum(1 for _ in irelax(_structures(count), calc, fmax=1e-6, steps=steps))
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    print(json.dumps({"done": done, "seconds": seconds, "peak": peak}))


def _launch(kind: str, count: int, steps: int) -> dict[str, float]:
    command = [sys.executable, "-m", "benchmarks.memory", "--worker", kind]
    command += [f"--count={count}", f"--steps={steps}"]
    done = subprocess.run(  # noqa: S603 - this repository's module
        command,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        check=True,
    )
    line = [row for row in done.stdout.splitlines() if row.startswith("{")][-1]
    return dict(json.loads(line))


def measure(times: float, steps: int) -> tuple[list[list[str]], str]:
    """Rows for the report, and the note describing the set."""
    count, total, ram, budget = _count_for(times)
    rows = []
    for kind in ("single_points", "relax"):
        figures = _launch(kind, count, steps)
        rows.append(
            [
                f"`{kind}`" + (f" ({steps} steps each)" if kind == "relax" else ""),
                f"{figures['done']:.0f}/{count}",
                f"{figures['done'] / figures['seconds']:.2f}",
                f"{figures['peak'] / GIB:.2f}",
                f"{budget / GIB:.2f}",
            ]
        )
    note = (
        f"{count} rattled Si cells of 16-64 atoms from a generator, SevenNet-0 "
        f"float32 on the CPU; one batch of all of them would need "
        f"{total / GIB:.0f} GiB by the model's estimate ({total / ram:.1f} x this "
        f"machine's {ram / GIB:.0f} GiB RAM). Default budget: half the free "
        "memory. Peak RSS of the whole process (model and Python included)."
    )
    return rows, note


HEADER = ["runner", "finished", "structures/s", "peak RSS GiB", "budget GiB"]


def run(settings: Any, report: Any) -> None:
    """Benchmark section for :mod:`benchmarks.run`."""
    title = "8. Memory: a set several times RAM (SevenNet-0)"
    if settings.quick:  # two fresh SevenNet-0 processes: ~45 s even for one cell
        report.table(title, HEADER, [], "skipped in quick mode")
        return
    rows, note = measure(3.0, 2)
    report.table(title, HEADER, rows, note)


def main() -> None:
    """Print the table (or, with ``--worker KIND``, be one measured run)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--count", type=int, default=0)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--times", type=float, default=3.0)
    args = parser.parse_args()
    if args.worker:
        _worker(args.worker, args.count, args.steps)
        return
    rows, note = measure(args.times, args.steps)
    print(note)
    print(" | ".join(HEADER))
    for row in rows:
        print(" | ".join(row))


if __name__ == "__main__":
    main()
