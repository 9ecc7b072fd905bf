"""Data-parallel relaxation: 2 ranks (torchrun, gloo) vs 1 process (LJ, FIRE).

The heterogeneous LJ argon structures of :mod:`benchmarks.runners` (4-256
atoms), FIRE to 0.05 eV/Å with :func:`nvalchemi_ase.runners.relax`, run as

* one process with one thread and with as many threads as ranks (the fair
  comparison on a machine whose cores the ranks share);
* ``torchrun --nproc_per_node=N`` with one thread per rank: each rank relaxes
  its shard (structure ``i`` on rank ``i % N``) and rank 0 merges the output.

Each configuration is a fresh ``torch.distributed.run`` launch; inside it the
runner call is timed after a warm-up run (median of the repeats), from a
barrier before it to a barrier after it, so process start and ``import
nvalchemi`` are not counted (they are reported separately, as the launch's
whole wall time).

Run alone: ``python -m benchmarks.distributed [--count N] [--ranks 2]``, or in
the suite: ``python -m benchmarks --only distributed``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

FMAX = 0.05
ROOT = Path(__file__).resolve().parents[1]


def _worker(count: int, max_atoms: int, repeats: int, device: str) -> None:
    """One rank: warm up, then time ``relax`` ``repeats`` times; rank 0 prints."""
    import torch.distributed as dist

    from benchmarks.runners import make_structures
    from nvalchemi_ase import NVAlchemiCalculator
    from nvalchemi_ase.runners import relax
    from nvalchemi_ase.runners.distributed import sharding

    calc = NVAlchemiCalculator("lj", device=device, dtype="float64")
    structures = make_structures(count)
    with sharding() as shard:
        relax(make_structures(2 * shard.size, seed=1), calc, max_atoms=max_atoms)
        seconds = []
        for _ in range(repeats):
            with tempfile.TemporaryDirectory() as folder:
                shard.barrier()
                start = time.perf_counter()
                relax(
                    structures,
                    calc,
                    fmax=FMAX,
                    max_atoms=max_atoms,
                    output=Path(folder) / "out.extxyz",
                )
                seconds.append(time.perf_counter() - start)
        if shard.is_root:
            print(json.dumps({"seconds": statistics.median(seconds)}))
    if dist.is_initialized():
        dist.destroy_process_group()


def _launch(
    ranks: int, threads: int, count: int, max_atoms: int, repeats: int, device: str
) -> tuple[float, float]:
    """(median seconds of the runner call, wall seconds of the whole launch)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(ROOT))
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={ranks}",
        "-m",
        "benchmarks.distributed",
        "--worker",
        f"--count={count}",
        f"--max-atoms={max_atoms}",
        f"--repeats={repeats}",
        f"--device={device}",
    ]
    start = time.perf_counter()
    done = subprocess.run(  # noqa: S603 - this repository's module
        command, cwd=ROOT, env=env, capture_output=True, text=True, check=True
    )
    wall = time.perf_counter() - start
    line = [row for row in done.stdout.splitlines() if row.startswith("{")][-1]
    return float(json.loads(line)["seconds"]), wall


def measure(
    count: int, max_atoms: int, ranks: int, repeats: int, device: str = "cpu"
) -> list[list[str]]:
    """Structures per second of each configuration; rows for the report table."""
    configurations = [(1, 1), (1, ranks), (ranks, 1)]
    figures = {
        configuration: _launch(*configuration, count, max_atoms, repeats, device)
        for configuration in configurations
    }
    base = figures[(1, 1)][0]
    fair = figures[(1, ranks)][0]
    rows = []
    for (n, threads), (seconds, wall) in figures.items():
        rows.append(
            [
                f"{n} rank{'s' if n > 1 else ''} × {threads} thread"
                f"{'s' if threads > 1 else ''}",
                f"{count / seconds:.2f}",
                f"{base / seconds:.2f}",
                f"{fair / seconds:.2f}",
                f"{wall:.1f}",
            ]
        )
    return rows


HEADER = [
    "configuration",
    "structures/s",
    "× 1 rank 1 thread",
    "× 1 rank, same threads",
    "launch wall s",
]


def run(settings: Any, report: Any) -> None:
    """Benchmark section for :mod:`benchmarks.run`."""
    count, max_atoms, repeats = (16, 512, 1) if settings.quick else (400, 2048, 3)
    rows = measure(count, max_atoms, 2, repeats, settings.device)
    report.table(
        "7. Data-parallel relaxation under torchrun",
        HEADER,
        rows,
        f"{count} LJ argon structures of 4-256 atoms, FIRE to {FMAX} eV/Å, "
        f"float64, atom budget {max_atoms} per rank; median of {repeats} timed "
        "runner calls after a warm-up, inside one torchrun launch each (gloo).",
    )


def main() -> None:
    """Print the table (or, with ``--worker``, be one rank of a launch)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--count", type=int, default=400)
    parser.add_argument("--max-atoms", type=int, default=2048)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    if args.worker:
        _worker(args.count, args.max_atoms, args.repeats, args.device)
        return
    rows = measure(args.count, args.max_atoms, args.ranks, args.repeats, args.device)
    print(" | ".join(HEADER))
    for row in rows:
        print(" | ".join(row))


if __name__ == "__main__":
    main()
