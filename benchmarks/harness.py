"""What every benchmark section shares: sizes, the report, alternated timing.

:mod:`benchmarks.run` and its section modules import these; this module
imports none of them.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

ARGON_A = 5.26  # Å


@dataclass
class Settings:
    """Sizes and repeat counts of one benchmark run."""

    device: str
    quick: bool
    repeats: int
    md_steps: int
    sizes: tuple[int, ...]  # atoms per structure (LJ)
    batch_sizes: tuple[int, ...]
    scaling_atoms: tuple[int, ...]
    adapter_count: int
    sevennet_sizes: tuple[int, ...] = (16, 32, 64)
    sevennet_count: int = 32


@dataclass
class Report:
    """Markdown sections collected while the benchmarks run."""

    sections: list[str] = field(default_factory=list)
    #: every table as data (title, header, rows, note), for the JSON report
    records: list[dict[str, Any]] = field(default_factory=list)

    def table(
        self, title: str, header: list[str], rows: list[list[str]], note: str = ""
    ) -> None:
        self.records.append(
            {"title": title, "header": header, "rows": rows, "note": note}
        )
        lines = [f"## {title}", ""]
        if note:
            lines += [note, ""]
        lines.append("| " + " | ".join(header) + " |")
        lines.append("|" + "|".join("---" for _ in header) + "|")
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        self.sections.append("\n".join(lines))
        print("\n" + self.sections[-1] + "\n", flush=True)


def median_time(function: Callable[[], Any], repeats: int, warmup: int = 1) -> float:
    """Median wall time of ``function()`` over ``repeats`` calls after ``warmup``."""
    for _ in range(warmup):
        function()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def interleaved_medians(
    functions: Sequence[Callable[[], Any]], repeats: int, warmup: int = 1
) -> list[float]:
    """Median wall time of each function, timed in alternation.

    Round ``r`` times every function once, so slow drifts of the machine (other
    processes, thermal limits, caches) fall on all sides of a ratio alike.
    """
    for _ in range(warmup):
        for function in functions:
            function()
    times: list[list[float]] = [[] for _ in functions]
    for _ in range(repeats):
        for function, bucket in zip(functions, times, strict=True):
            start = time.perf_counter()
            function()
            bucket.append(time.perf_counter() - start)
    return [statistics.median(bucket) for bucket in times]


@dataclass
class Samples:
    """Wall and CPU times of one function over interleaved rounds (seconds)."""

    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)


def interleaved_samples(
    functions: Sequence[Callable[[], Any]], repeats: int, warmup: int = 1
) -> list[Samples]:
    """Wall and process CPU time of every call, functions timed in alternation.

    As :func:`interleaved_medians`, keeping every sample so that ratios can be
    taken round by round and their spread reported. CPU time counts this
    process only: on a loaded machine it is the steadier measure of the work
    done (wall time also counts the time other processes held the cores), and
    threads that spin while they wait show up in it.
    """
    for _ in range(warmup):
        for function in functions:
            function()
    samples = [Samples() for _ in functions]
    for _ in range(repeats):
        for function, bucket in zip(functions, samples, strict=True):
            wall, cpu = time.perf_counter(), time.process_time()
            function()
            bucket.wall.append(time.perf_counter() - wall)
            bucket.cpu.append(time.process_time() - cpu)
    return samples


def ratio_spread(numerator: Sequence[float], denominator: Sequence[float]) -> str:
    """Median, IQR and range of round-by-round ratios.

    E.g. ``1.020 (IQR 0.990-1.040, range 0.950-1.100)``.
    """
    ratios = sorted(n / d for n, d in zip(numerator, denominator, strict=True))
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    return (
        f"{statistics.median(ratios):.3f} (IQR {quartiles[0]:.3f}-{quartiles[2]:.3f}, "
        f"range {ratios[0]:.3f}-{ratios[-1]:.3f})"
    )


def load_average() -> str:
    """The 1-, 5- and 15-minute load averages, or "n/a"."""
    try:
        return ", ".join(f"{value:.1f}" for value in os.getloadavg())
    except (AttributeError, OSError):
        return "n/a"


def argon(atoms_per_structure: int, seed: int) -> Any:
    """A rattled fcc argon crystal with about ``atoms_per_structure`` atoms."""
    from ase.build import bulk

    cells = max(1, round((atoms_per_structure / 4) ** (1 / 3)))
    reps = (cells, cells, cells)
    if atoms_per_structure == 16:
        reps = (2, 2, 1)
    atoms = bulk("Ar", "fcc", a=ARGON_A, cubic=True).repeat(reps)
    atoms.rattle(0.05, seed=seed)
    return atoms


def thermalized(atoms: Any, temperature_K: float, seed: int) -> Any:
    from ase import units

    rng = np.random.default_rng(seed)
    masses = atoms.get_masses()[:, None]
    atoms.set_momenta(
        rng.normal(size=(len(atoms), 3)) * np.sqrt(masses * units.kB * temperature_K)
    )
    return atoms


def settings_for(device: str, quick: bool) -> Settings:
    """Benchmark sizes: quick (CI smoke), full CPU, or GPU."""
    if quick:
        return Settings(
            device,
            True,
            repeats=1,
            md_steps=8,
            sizes=(108,),
            batch_sizes=(4,),
            scaling_atoms=(1000, 2000),
            adapter_count=500,
            sevennet_sizes=(16,),
            sevennet_count=4,
        )
    if device.startswith("cuda"):
        return Settings(
            device,
            False,
            repeats=5,
            md_steps=100,
            sizes=(16, 108, 256, 864),
            batch_sizes=(1, 8, 32, 128, 512),
            scaling_atoms=(1_000, 10_000, 100_000, 1_000_000),
            adapter_count=10_000,
            sevennet_sizes=(16, 32, 64),
            sevennet_count=128,
        )
    return Settings(
        device,
        False,
        repeats=3,
        md_steps=40,
        sizes=(16, 108, 256, 864),
        batch_sizes=(1, 8, 32, 128),
        scaling_atoms=(1_000, 10_000, 100_000),
        adapter_count=10_000,
    )


def environment(settings: Settings) -> str:
    """Machine, versions and date, for the report header."""
    import torch

    versions = ", ".join(
        f"{name} {importlib.metadata.version(name)}"
        for name in (
            "nvalchemi-ase",
            "nvalchemi-toolkit",
            "nvalchemi-toolkit-ops",
            "ase",
            "torch",
            "warp-lang",
        )
    )
    if settings.device.startswith("cuda"):
        machine = torch.cuda.get_device_name(0)
    else:
        machine = (
            f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
        )
    mode = "quick (smoke test; numbers not meaningful)" if settings.quick else "full"
    policy = os.environ.get("OMP_WAIT_POLICY", "unset")
    return (
        f"# Performance\n\nGenerated by `python -m benchmarks` on "
        f"{datetime.date.today().isoformat()}: {mode} run on **{settings.device}** "
        f"({machine}, torch threads {torch.get_num_threads()}, OMP_WAIT_POLICY "
        f"{policy}; load average at the end {load_average()}), Python "
        f"{platform.python_version()}.\n\nVersions: {versions}.\n\n"
        "Every figure is a ratio of medians over repeats after warm-up, both sides "
        "timed in the same process."
    )
