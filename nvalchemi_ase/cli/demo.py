"""``nvalchemi-ase demo``: the README's main job.

Builds real crystals, a slab and a molecule with ``ase.build`` (44 atoms in 7
structures), evaluates them in one batched call, relaxes them together (FIRE,
fmax 0.05 eV/Å), then runs a short Langevin MD at 300 K (60 K for argon), all
with the default model (SevenNet-0 when the ``sevenn`` package is installed,
else Lennard-Jones argon on argon structures). About a minute on an idle 2-core
CPU with SevenNet-0.

Tables go to standard output; progress goes to standard error even when
standard output is piped: a line per stage with the elapsed time, and during
the relaxation and the MD a bar on a terminal or, elsewhere, a line every
10 s. Structures, trajectories and plots are written into a folder named at
the end.

On a CPU the demo uses as many torch threads as the load average leaves cores
free (at least one): OpenMP threads that wait for a core busy with other
processes make every parallel operation stall, which on a loaded 2-core
machine made a SevenNet-0 step about 15 times slower with two threads than
with one. ``--threads`` or ``OMP_NUM_THREADS`` overrides the choice.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = ["add_arguments", "choose_threads", "demo_structures", "run"]

#: The demo's clock (tests replace it to simulate a slow machine).
_clock = time.perf_counter


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the ``demo`` options."""
    from nvalchemi_ase.cli.common import add_model_options, positive_int

    parser.add_argument(
        "-o",
        "--output-dir",
        default="nvalchemi-ase-demo",
        help="output folder (default: nvalchemi-ase-demo)",
    )
    parser.add_argument(
        "--md-steps", type=positive_int, default=60, help="MD steps (default: 60)"
    )
    parser.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="torch CPU threads (default: OMP_NUM_THREADS if set, else the cores "
        "the load average leaves free, at least 1)",
    )
    parser.add_argument(
        "--quiet", action="store_true", help="no progress on standard error"
    )
    add_model_options(parser)


def demo_structures(model_name: str) -> list[Any]:
    """Structures for the demo: real materials for SevenNet-0, argon for LJ.

    Parameters
    ----------
    model_name : str
        ``"lj"`` gives argon (LJ has one species); anything else real materials.

    Returns
    -------
    list of ase.Atoms
        Rattled bulk crystals, a slab (pbc T, T, F, no third cell vector) and a
        molecule or cluster (no pbc).
    """
    from ase.build import bulk, fcc111, molecule
    from ase.cluster import Icosahedron

    if model_name == "lj":
        crystal = bulk("Ar", "fcc", a=5.26, cubic=True).repeat((3, 3, 3))
        slab = fcc111("Ar", size=(3, 3, 4), a=5.26, vacuum=None)
        cluster = Icosahedron("Ar", noshells=3, latticeconstant=5.26)
        images = [crystal, slab, cluster]
    else:
        images = [
            bulk("Si", "diamond", a=5.43, cubic=True),
            bulk("Cu", "fcc", a=3.61, cubic=True),
            bulk("NaCl", "rocksalt", a=5.64, cubic=True),
            bulk("MgO", "rocksalt", a=4.21, cubic=True),
            bulk("Al", "fcc", a=4.05),
            fcc111("Cu", size=(2, 2, 3), vacuum=None),
            molecule("H2O"),
        ]
    for index, atoms in enumerate(images):
        atoms.info.pop("adsorbate_info", None)
        if atoms.cell.rank < 3 or not atoms.pbc.all():
            atoms.pbc = atoms.cell.array.any(axis=1) & atoms.pbc
        atoms.rattle(0.03, seed=index)
    images[-2].pbc = (True, True, False)
    return images


def run(args: argparse.Namespace) -> int:
    """Evaluate, relax and run MD on the demo batch; print and save the results."""
    from nvalchemi_ase.cli.common import (
        build_calculator,
        parse_model_spec,
        result_properties,
    )

    stages = _Stages(enabled=not args.quiet)
    name, _ = parse_model_spec(args.model)
    stages.say(f"loading model {name} ...")
    calc = build_calculator(args)
    with choose_threads(calc.device, args.threads) as threads:
        images = demo_structures(name)
        folder = Path(args.output_dir)
        folder.mkdir(parents=True, exist_ok=True)
        labels = [
            f"{index}: {atoms.get_chemical_formula()}"
            for index, atoms in enumerate(images)
        ]
        setup = f"{calc.parameters['dtype']}" + (f", {threads}" if threads else "")
        _print(
            f"model {name} on {calc.device} ({setup}); {len(images)} structures, "
            f"{sum(map(len, images))} atoms in one batch"
        )
        stages.say(
            f"model ready on {calc.device} ({setup}); single points of "
            f"{len(images)} structures in one batched call ..."
        )
        start = _clock()
        results = calc.calculate_batch(images, result_properties(calc))
        elapsed = _clock() - start
        _print(f"\nsingle points (one batched call, {elapsed:.2f} s):")
        _print(_table(labels, images, results))
        stages.say(f"single points done ({elapsed:.1f} s)")
        _relax(args, calc, images, labels, folder, name, stages)
        _run_md(args, images, folder, name, stages)
    _print(
        f"\noutputs in {folder.resolve()}/: relaxed.extxyz, relax_*.traj, md_*.traj, "
        "relax.png, md.png (look at a run with: ase gui md_0.traj)"
    )
    stages.say(f"demo done; outputs in {folder.resolve()}/")
    return 0


@contextmanager
def choose_threads(device: Any, requested: int | None) -> Iterator[str | None]:
    """Set torch's CPU thread count for the demo; restore it afterwards.

    Parameters
    ----------
    device : torch.device or str
        The model's device; only CPU runs are changed.
    requested : int or None
        ``--threads``; None chooses: ``OMP_NUM_THREADS`` when set (left as
        torch read it), else the cores the 1-minute load average leaves free,
        between 1 and torch's default.

    Yields
    ------
    str or None
        What was chosen and why, e.g. ``"1 torch thread, load 9.3 on 2
        cores"``; None off the CPU.
    """
    import torch

    if str(device).split(":")[0] != "cpu":
        yield None
        return
    previous = torch.get_num_threads()
    reason = ""
    if requested is not None:
        threads, reason = requested, "from --threads"
    elif os.environ.get("OMP_NUM_THREADS"):
        threads, reason = previous, "from OMP_NUM_THREADS"
    else:
        threads = previous
        cores = _cores()
        load = _load_average()
        if load is not None:
            free = round(cores - load)
            threads = max(1, min(previous, free))
            reason = f"load {load:.1f} on {cores} cores"
    torch.set_num_threads(threads)
    note = f"{threads} torch thread{'s' if threads != 1 else ''}"
    try:
        yield f"{note}, {reason}" if reason else note
    finally:
        torch.set_num_threads(previous)


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):  # not on every platform
        return None


class _Stages:
    """One line per demo stage on standard error, with the elapsed time."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.start = _clock()

    def say(self, text: str) -> None:
        if not self.enabled:
            return
        elapsed = _clock() - self.start
        print(f"[demo {elapsed:7.1f} s] {text}", file=sys.stderr, flush=True)  # noqa: T201


def _relax(
    args: argparse.Namespace,
    calc: Any,
    images: list[Any],
    labels: list[str],
    folder: Path,
    name: str,
    stages: _Stages,
) -> None:
    from ase.io import write

    from nvalchemi_ase.cli.common import result_properties
    from nvalchemi_ase.dynamics.progress import format_rate
    from nvalchemi_ase.dynamics.recorder import Recorder
    from nvalchemi_ase.optimize import FIRE

    for atoms in images:
        atoms.calc = calc
    opt = FIRE(
        images,
        logfile=None,
        trajectory=str(folder / "relax_{i}.traj"),
        progress=not args.quiet,
    )
    record = Recorder(opt)
    stages.say(
        f"relaxing {len(images)} structures together (FIRE to fmax 0.05 eV/Å, at "
        "most 300 batched steps) ..."
    )
    start = _clock()
    opt.run(fmax=0.05, steps=300)
    elapsed = _clock() - start
    relaxed = calc.calculate_batch(images, result_properties(calc))
    converged = int(opt.converged_mask.sum())
    rate = format_rate(opt.nsteps, elapsed, "batched step")
    _print(
        f"\nrelaxed together with FIRE to fmax 0.05 eV/Å: {converged}/{len(images)} "
        f"converged in {opt.nsteps} batched steps ({elapsed:.1f} s, {rate}):"
    )
    _print(_table(labels, images, relaxed))
    frames = [_with_results(a, r) for a, r in zip(images, relaxed, strict=True)]
    write(folder / "relaxed.extxyz", frames)
    record.plot(folder / "relax.png", title=f"FIRE relaxation, {name}")
    stages.say(
        f"relaxation done: {converged}/{len(images)} converged in {opt.nsteps} "
        f"steps ({elapsed:.1f} s, {rate})"
    )


def _run_md(
    args: argparse.Namespace,
    images: list[Any],
    folder: Path,
    name: str,
    stages: _Stages,
) -> None:
    import numpy as np
    from ase import units

    from nvalchemi_ase.dynamics.progress import format_rate
    from nvalchemi_ase.dynamics.recorder import Recorder
    from nvalchemi_ase.md import Langevin

    # argon boils at 87 K: the LJ fallback runs cold
    temperature_K = 60.0 if name == "lj" else 300.0
    timestep = (2.0 if name == "lj" else 1.0) * units.fs
    rng = np.random.default_rng(0)
    # Maxwell-Boltzmann start without centre-of-mass drift, written out because
    # ASE 3.29 renamed MaxwellBoltzmannDistribution and 3.27 lacks the new name
    for atoms in images:
        sigma = np.sqrt(atoms.get_masses()[:, None] * units.kB * temperature_K)
        momenta = rng.normal(size=(len(atoms), 3)) * sigma
        atoms.set_momenta(momenta - momenta.mean(axis=0))
    dyn = Langevin(
        images,
        timestep,
        temperature_K,
        0.02 / units.fs,
        seed=0,
        trajectory=str(folder / "md_{i}.traj"),
        loginterval=10,
        progress=not args.quiet,
    )
    record = Recorder(dyn, interval=5)
    stages.say(
        f"Langevin MD at {temperature_K:g} K: {args.md_steps} steps of "
        f"{timestep / units.fs:g} fs for all structures at once ..."
    )
    start = _clock()
    dyn.run(args.md_steps)
    elapsed = _clock() - start
    temperatures = ", ".join(
        f"{t:.0f} K" for t in dyn.per_structure_thermo()["temperature"]
    )
    record.plot(folder / "md.png", title=f"Langevin {temperature_K:g} K, {name}")
    rates = (
        f"{format_rate(args.md_steps, elapsed, 'batched step')}, "
        f"{format_rate(args.md_steps * len(images), elapsed, 'structure-step')}"
    )
    _print(
        f"\nLangevin MD at {temperature_K:g} K: {args.md_steps} steps of "
        f"{timestep / units.fs:g} fs for all structures at once ({elapsed:.1f} s, "
        f"{rates}); final T: {temperatures}"
    )
    stages.say(f"MD done ({elapsed:.1f} s, {rates})")


def _table(labels: list[str], images: list[Any], results: list[dict[str, Any]]) -> str:
    from nvalchemi_ase.cli._table import RESULT_HEADER, format_table, result_row

    rows = [
        result_row(label, atoms, result)
        for label, atoms, result in zip(labels, images, results, strict=True)
    ]
    return format_table(RESULT_HEADER, rows)


def _with_results(atoms: Any, result: dict[str, Any]) -> Any:
    from ase.calculators.singlepoint import SinglePointCalculator

    copy = atoms.copy()
    copy.calc = SinglePointCalculator(copy, **result)
    return copy


def _print(text: str) -> None:
    print(text)  # noqa: T201
