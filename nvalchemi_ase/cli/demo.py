"""``nvalchemi-ase demo``: the README's main job.

Builds real crystals, a slab and a molecule with ``ase.build``, evaluates them in
one batched call, relaxes them together (FIRE, fmax 0.05 eV/Å), then runs a
short Langevin MD at 300 K (60 K for argon), all with the default model
(SevenNet-0 when the ``sevenn`` package is installed, else Lennard-Jones argon
on argon structures).
Prints tables and writes structures, trajectories and plots into a folder it
names at the end.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

__all__ = ["add_arguments", "demo_structures", "run"]


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
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
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
            bulk("Cu", "fcc", a=3.61, cubic=True).repeat(2),
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
    from nvalchemi_ase.cli.common import build_calculator, parse_model_spec

    name, _ = parse_model_spec(args.model)
    calc = build_calculator(args)
    images = demo_structures(name)
    folder = Path(args.output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    labels = [
        f"{index}: {atoms.get_chemical_formula()}" for index, atoms in enumerate(images)
    ]
    _print(
        f"model {name} on {calc.device} ({calc.parameters['dtype']}); "
        f"{len(images)} structures, {sum(map(len, images))} atoms in one batch"
    )
    start = time.perf_counter()
    results = calc.calculate_batch(images, _properties(calc))
    _print(f"\nsingle points (one batched call, {time.perf_counter() - start:.2f} s):")
    _print(_table(labels, images, results))
    _relax(args, calc, images, labels, folder, name)
    _run_md(args, images, folder, name)
    _print(
        f"\noutputs in {folder.resolve()}/: relaxed.extxyz, relax_*.traj, md_*.traj, "
        "relax.png, md.png (look at a run with: ase gui md_0.traj)"
    )
    return 0


def _relax(
    args: argparse.Namespace,
    calc: Any,
    images: list[Any],
    labels: list[str],
    folder: Path,
    name: str,
) -> None:
    from ase.io import write

    from nvalchemi_ase.cli.common import show_progress
    from nvalchemi_ase.dynamics.recorder import Recorder
    from nvalchemi_ase.optimize import FIRE

    for atoms in images:
        atoms.calc = calc
    opt = FIRE(
        images,
        logfile=None,
        trajectory=str(folder / "relax_{i}.traj"),
        progress=show_progress(args),
    )
    record = Recorder(opt)
    start = time.perf_counter()
    opt.run(fmax=0.05, steps=300)
    elapsed = time.perf_counter() - start
    relaxed = calc.calculate_batch(images, _properties(calc))
    converged = int(opt.converged_mask.sum())
    _print(
        f"\nrelaxed together with FIRE to fmax 0.05 eV/Å: {converged}/{len(images)} "
        f"converged in {opt.nsteps} batched steps ({elapsed:.1f} s):"
    )
    _print(_table(labels, images, relaxed))
    frames = [_with_results(a, r) for a, r in zip(images, relaxed, strict=True)]
    write(folder / "relaxed.extxyz", frames)
    record.plot(folder / "relax.png", title=f"FIRE relaxation, {name}")


def _run_md(
    args: argparse.Namespace, images: list[Any], folder: Path, name: str
) -> None:
    import numpy as np
    from ase import units

    from nvalchemi_ase.cli.common import show_progress
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
        progress=show_progress(args),
    )
    record = Recorder(dyn, interval=5)
    start = time.perf_counter()
    dyn.run(args.md_steps)
    elapsed = time.perf_counter() - start
    temperatures = ", ".join(
        f"{t:.0f} K" for t in dyn.per_structure_thermo()["temperature"]
    )
    record.plot(folder / "md.png", title=f"Langevin {temperature_K:g} K, {name}")
    rate = args.md_steps * len(images) / elapsed
    _print(
        f"\nLangevin MD at {temperature_K:g} K: {args.md_steps} steps of "
        f"{timestep / units.fs:g} fs for all structures at once ({elapsed:.1f} s, "
        f"{rate:.0f} structure-steps/s); final T: {temperatures}"
    )


def _properties(calc: Any) -> list[str]:
    return [
        p for p in ("energy", "forces", "stress") if p in calc.implemented_properties
    ]


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
