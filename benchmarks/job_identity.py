"""Cost of the job identity on a 5000-structure LJ single-point stream.

``python -m benchmarks.job_identity [--count 5000] [--repeats 3]``

The same ``single_points(..., output=F)`` run with the job identity (as
shipped) and without it (``runners._common.job_of`` returning None: no
digests, no identity keys in the frames), alternated, plus the identity's own
pieces timed alone: the structure digests of the stream, their encoding, and
a ``resume=True`` of the finished output (scan + check of every frame).
Medians and spreads (min-max) in seconds.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from unittest import mock


def _stream(count: int):
    from ase.build import bulk

    base = bulk("Ar", "fcc", a=5.26, cubic=True) * (2, 2, 2)  # 32 atoms
    for index in range(count):
        atoms = base.copy()
        atoms.rattle(0.05, seed=index)
        yield atoms


def _timed(function) -> float:
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--count", type=int, default=5000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from nvalchemi_ase import NVAlchemiCalculator
    from nvalchemi_ase.identity import STRUCTURE_FIELDS, encode, structure_digests
    from nvalchemi_ase.runners import single_points

    calc = NVAlchemiCalculator("lj", device="cpu", dtype="float64")
    single_points(list(_stream(50)), calc)  # warm-up (kernels built)
    times: dict[str, list[float]] = {"with": [], "without": [], "resume": []}
    with tempfile.TemporaryDirectory() as folder:
        for repeat in range(args.repeats):
            for mode in ("with", "without"):
                output = Path(folder) / f"{mode}{repeat}.extxyz"
                run = lambda output=output: single_points(  # noqa: E731
                    _stream(args.count), calc, output=output
                )
                if mode == "without":
                    with mock.patch(
                        "nvalchemi_ase.runners._common.job_of", return_value=None
                    ):
                        times[mode].append(_timed(run))
                else:
                    times[mode].append(_timed(run))
            output = Path(folder) / f"with{repeat}.extxyz"
            times["resume"].append(
                _timed(
                    lambda output=output: single_points(
                        _stream(args.count), calc, output=output, resume=True
                    )
                )
            )
    images = list(_stream(args.count))
    digest = [
        _timed(lambda: structure_digests(images, STRUCTURE_FIELDS))
        for _ in range(args.repeats)
    ]
    rows = structure_digests(images, STRUCTURE_FIELDS)
    encoding = [_timed(lambda: [encode(r) for r in rows]) for _ in range(args.repeats)]
    for name, values in (*times.items(), ("digests", digest), ("encode", encoding)):
        print(
            f"{name:8s} median {statistics.median(values):8.3f} s "
            f"(min {min(values):.3f}, max {max(values):.3f})"
        )
    overhead = statistics.median(times["with"]) / statistics.median(times["without"])
    print(f"run with identity / without: {overhead:.4f}")


if __name__ == "__main__":
    main()
