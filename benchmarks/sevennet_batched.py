"""SevenNet-0: one batched nvalchemi call vs one ``SevenNetCalculator`` call each.

Run from the repository root::

    .venv/bin/python -m benchmarks.sevennet_batched [--repeats 7] [--structures 32]

Energy and forces of N structures (8-64 atoms, several elements, rattled) are
computed (a) by ``NVAlchemiCalculator.calculate_batch`` with the batched
SevenNet-0 model (neighbour list + one forward/backward pass) and (b) by
``sevenn.calculator.SevenNetCalculator('7net-0')`` called on each structure in
turn. Both run on the CPU in float32. The two are timed alternately after a
warm-up, and the medians are reported as a markdown table: wall-clock time and
the CPU time (user + system, all threads) of this process, which is the steadier
figure on a machine shared with other jobs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings
from collections.abc import Callable, Sequence

import numpy as np
import torch
from ase import Atoms
from ase.build import bulk

from nvalchemi_ase import NVAlchemiCalculator
from nvalchemi_ase.models import load_model

# (label, builder of the conventional cell, allowed repeats)
_CRYSTALS: list[tuple[str, Callable[[], Atoms]]] = [
    ("Si", lambda: bulk("Si", "diamond", a=5.43, cubic=True)),
    ("Cu", lambda: bulk("Cu", "fcc", a=3.61, cubic=True)),
    ("NaCl", lambda: bulk("NaCl", "rocksalt", a=5.64, cubic=True)),
    ("MgO", lambda: bulk("MgO", "rocksalt", a=4.21, cubic=True)),
    ("Fe", lambda: bulk("Fe", "bcc", a=2.87, cubic=True)),
    ("Al", lambda: bulk("Al", "fcc", a=4.05, cubic=True)),
]
_REPEATS = [(1, 1, 1), (2, 1, 1), (2, 2, 1), (2, 2, 2), (3, 1, 1), (4, 2, 1)]
MIN_ATOMS, MAX_ATOMS = 8, 64


def make_structures(count: int, seed: int = 0) -> list[Atoms]:
    """``count`` rattled crystals of 8-64 atoms, reproducibly."""
    rng = np.random.default_rng(seed)
    structures: list[Atoms] = []
    while len(structures) < count:
        _, build = _CRYSTALS[rng.integers(len(_CRYSTALS))]
        repeat = _REPEATS[rng.integers(len(_REPEATS))]
        atoms = build().repeat(repeat)
        if not MIN_ATOMS <= len(atoms) <= MAX_ATOMS:
            continue
        atoms.rattle(0.05, seed=int(rng.integers(1 << 31)))
        structures.append(atoms)
    return structures


def sevenn_reference() -> Callable[[Atoms], tuple[float, np.ndarray]]:
    """SevenNet's own calculator, one structure per call (energy, forces)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from sevenn.calculator import SevenNetCalculator

        calc = SevenNetCalculator("7net-0", device="cpu")

    def evaluate(atoms: Atoms) -> tuple[float, np.ndarray]:
        calc.calculate(atoms, ["energy", "forces"])
        return calc.results["energy"], calc.results["forces"]

    return evaluate


def time_call(function: Callable[[], object]) -> tuple[float, float]:
    """Wall-clock and CPU (user + system, all threads) seconds of one call."""
    cpu_start, start = sum(os.times()[:2]), time.perf_counter()
    function()
    return time.perf_counter() - start, sum(os.times()[:2]) - cpu_start


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--structures", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args(argv)

    images = make_structures(args.structures)
    n_atoms = sum(len(atoms) for atoms in images)
    batched = NVAlchemiCalculator(load_model("sevennet-0"), device="cpu")
    reference = sevenn_reference()

    def run_batched() -> list[dict]:
        return batched.calculate_batch(images, ["energy", "forces"])

    def run_sequential() -> list[tuple[float, np.ndarray]]:
        return [reference(atoms) for atoms in images]

    for _ in range(args.warmup):
        ours, theirs = run_batched(), run_sequential()
    times: dict[str, list[float]] = {"batched": [], "sequential": []}
    cpu: dict[str, list[float]] = {"batched": [], "sequential": []}
    for _ in range(args.repeats):  # alternate, so both see the same machine load
        for key, run in (("batched", run_batched), ("sequential", run_sequential)):
            wall, used = time_call(run)
            times[key].append(wall)
            cpu[key].append(used)

    energy_error = max(
        abs(mine["energy"] - e) / abs(e)
        for mine, (e, _) in zip(ours, theirs, strict=True)
    )
    force_error = max(
        float(np.abs(mine["forces"] - f).max())
        for mine, (_, f) in zip(ours, theirs, strict=True)
    )
    median = {key: statistics.median(values) for key, values in times.items()}
    cpu_median = {key: statistics.median(values) for key, values in cpu.items()}
    ratio = median["sequential"] / median["batched"]
    cpu_ratio = cpu_median["sequential"] / cpu_median["batched"]

    sizes = [len(atoms) for atoms in images]
    print(
        f"SevenNet-0 on CPU ({torch.get_num_threads()} torch threads), "
        f"{len(images)} structures, {n_atoms} atoms ({min(sizes)}-{max(sizes)} "
        f"per structure), float32, energy + forces; median of {args.repeats} "
        f"after {args.warmup} warm-up rounds\n"
    )
    print(
        "| path | calls | wall median (s) | wall min (s) | wall max (s) "
        "| CPU median (s) | atoms/s (wall) |"
    )
    print("|---|---|---|---|---|---|---|")
    rows = (
        ("nvalchemi batched (`calculate_batch`)", 1, "batched"),
        ("sevenn `SevenNetCalculator`, sequential", len(images), "sequential"),
    )
    for label, calls, key in rows:
        values = times[key]
        print(
            f"| {label} | {calls} | {median[key]:.3f} | {min(values):.3f} | "
            f"{max(values):.3f} | {cpu_median[key]:.3f} | "
            f"{n_atoms / median[key]:.0f} |"
        )
    print(
        f"\nspeed-up (sequential / batched): **{ratio:.2f}x** wall-clock median, "
        f"{cpu_ratio:.2f}x CPU-time median"
    )
    print(
        f"agreement: max relative energy difference {energy_error:.1e}, "
        f"max force difference {force_error:.1e} eV/Å"
    )


if __name__ == "__main__":
    main()
