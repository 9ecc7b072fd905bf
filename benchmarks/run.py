"""The nvalchemi_ase benchmark suite: ratios measured in one process run.

Run ``python -m benchmarks`` (about 10 minutes on a 2-core CPU) or
``python -m benchmarks --quick`` (under a minute; checks that every benchmark
runs, the numbers are not meaningful). ``python -m benchmarks --suite gpu`` is
the prepared run for a lent GPU (:mod:`benchmarks.gpu`). ``--device cuda``
runs the same figures on a GPU with bigger sizes. The markdown report is
printed; a full run also writes it to ``docs/performance.md`` (``--output`` to
choose a file, which ``--only`` and ``--quick`` runs need), with the machine,
the versions and the date. Every figure is a ratio of medians over repeats
after warm-up, both sides timed in the same process.

1. Layer overhead: ASE-style ``VelocityVerlet``/``FIRE`` over B structures vs the
   same nvalchemi engine driven directly on the same ``Batch`` doing the same
   work (checked: same final positions, same neighbour-list builds, and a
   ``status`` column on the raw side whenever ours carries one); then with a
   trajectory frame every 10 steps. Ratios are medians of round-by-round
   ratios with their spread, in wall and CPU time.
2. Batched vs ASE sequential: one batched object vs the same structures run one
   after another with ASE's ``VelocityVerlet``/``FIRE`` and ``NVAlchemiCalculator``
   (LJ argon; SevenNet-0 also against its own ``SevenNetCalculator``).
3. Calculator overhead: ``get_forces()`` on one ``Atoms`` vs neighbour list plus
   model forward on a pre-built batch.
4. Adapter throughput: ``atoms_to_batch``/``batch_to_atoms`` on 10,000 small
   structures vs ``AtomicData.from_atoms`` + ``Batch.from_data_list`` /
   ``Batch.to_data_list``.
5. Scaling: time per MD step against total atoms, and the log-log slope.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import importlib.util
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.harness import (
    Report,
    Settings,
    argon,
    environment,
    interleaved_medians,
    interleaved_samples,
    load_average,
    median_time,
    ratio_spread,
    settings_for,
    thermalized,
)

# ---------------------------------------------------------------------------
# 1. layer overhead
# ---------------------------------------------------------------------------


def layer_overhead(settings: Settings, report: Report) -> None:
    import torch
    from ase import units

    from nvalchemi_ase import NVAlchemiCalculator, atoms_to_batch
    from nvalchemi_ase._quiet import import_quietly
    from nvalchemi_ase.dynamics.base import DEFAULT_SKIN
    from nvalchemi_ase.dynamics.neighbors import neighbor_hooks
    from nvalchemi_ase.engines import fire as fire_engines
    from nvalchemi_ase.md import VelocityVerlet
    from nvalchemi_ase.optimize import FIRE
    from nvalchemi_ase.units import ase_time_to_fs

    dynamics = import_quietly("nvalchemi.dynamics")
    calc = NVAlchemiCalculator(
        "lj", device=settings.device, dtype="float32", switch_width=1.0
    )
    model = calc.model
    batch_size = 8 if settings.quick else 32
    steps = settings.md_steps
    rows = []
    checks = []
    load_before = load_average()

    def images() -> list[Any]:
        structures = [thermalized(argon(108, s), 40.0, s) for s in range(batch_size)]
        for atoms in structures:
            atoms.calc = calc
        return structures

    def builds(engine: Any) -> int:
        return sum(getattr(hook, "builds", 0) for hook in engine.hooks)

    def raw_nve(status: bool = False) -> Any:
        batch = atoms_to_batch(images(), device=settings.device, dtype="float32")
        if status:
            batch["status"] = torch.zeros(batch_size, 1, dtype=torch.long)
        engine = dynamics.NVE(
            model,
            dt=ase_time_to_fs(2 * units.fs),
            hooks=neighbor_hooks(model, DEFAULT_SKIN),
        )
        engine.run(batch, n_steps=steps)
        return batch.positions, builds(engine)

    def ours_nve(trajectory: str | None = None) -> Callable[[], Any]:
        def run() -> Any:
            dyn = VelocityVerlet(
                images(), 2 * units.fs, trajectory=trajectory, loginterval=10
            )
            dyn.run(steps)
            return dyn.batch.positions, builds(dyn.engine)

        return run

    def raw_fire(status: bool = False) -> Any:
        # what our optimizers do to the batch: no velocities, unit masses (ASE's
        # optimizers move fictitious unit-mass particles), ASE's FIRE defaults
        batch = atoms_to_batch(images(), device=settings.device, dtype="float32")
        batch.velocities.zero_()
        batch.atomic_masses.fill_(1.0)
        if status:
            batch["status"] = torch.zeros(batch_size, 1, dtype=torch.long)
        # the engine our FIRE drives: ASE's algorithm, batched (engines/fire.py)
        engine = fire_engines.ASEFIRE(
            model,
            dt=0.1,
            dtmax=1.0,
            maxstep=0.2,
            hooks=neighbor_hooks(model, DEFAULT_SKIN),
        )
        engine.run(batch, n_steps=steps)
        return batch.positions, builds(engine)

    def ours_fire(trajectory: str | None = None) -> Callable[[], Any]:
        def run() -> Any:
            opt = FIRE(images(), logfile=None, trajectory=trajectory, loginterval=10)
            opt.run(fmax=1e-9, steps=steps)  # nothing converges: `steps` steps
            return opt.batch.positions, builds(opt.engine)

        return run

    def carries_status(make: Callable[[], Any]) -> bool:
        """Whether our object's batch has a ``status`` column while it steps."""
        dyn = make()
        seen: list[bool] = []
        dyn.attach(lambda: seen.append("status" in dyn.batch), interval=1)
        if isinstance(dyn, FIRE):
            dyn.run(fmax=1e-9, steps=2)
        else:
            dyn.run(2)
        return any(seen[1:])

    def same_work(raw: Callable[[], Any], ours: Callable[[], Any]) -> str:
        (raw_positions, raw_builds), (our_positions, our_builds) = raw(), ours()
        gap = float((raw_positions - our_positions).abs().max())
        verdict = "same" if gap < 1e-4 and raw_builds == our_builds else "DIFFERENT"
        return (
            f"{verdict} work: final positions agree to {gap:.1e} Å, neighbour "
            f"lists built {raw_builds} (raw) and {our_builds} (ours) times"
        )

    # the ratios sit within a few per cent of 1 and a loaded machine moves
    # single rounds by ±5-10 %: enough rounds for a median that holds
    rounds = 5 if settings.quick else 8 * settings.repeats
    with tempfile.TemporaryDirectory() as folder:
        template = str(Path(folder) / "t_{i}.traj")
        for name, raw, ours, make in (
            (
                "VelocityVerlet / NVE",
                raw_nve,
                ours_nve,
                lambda: VelocityVerlet(images(), 2 * units.fs),
            ),
            (
                "FIRE / FIRE",
                raw_fire,
                ours_fire,
                lambda: FIRE(images(), logfile=None),
            ),
        ):
            status = carries_status(make)
            raw_same = (lambda raw=raw: raw(True)) if status else raw
            checks.append(
                f"{name}: ours {'carries' if status else 'carries no'} `status` "
                f"column while it steps; {same_work(raw_same, ours(None))}"
            )
            functions = [raw, ours(None), ours(template)]
            if status:
                functions.append(raw_same)
            samples = interleaved_samples(functions, rounds)
            bare, plain, traj = samples[:3]
            same = samples[3] if status else bare
            rows.append(
                [
                    name,
                    f"{1e3 * statistics.median(bare.wall) / steps:.2f}",
                    f"{1e3 * statistics.median(same.wall) / steps:.2f}"
                    + ("" if status else " (= bare)"),
                    f"{1e3 * statistics.median(plain.wall) / steps:.2f}",
                    ratio_spread(plain.wall, same.wall),
                    ratio_spread(plain.cpu, same.cpu),
                    ratio_spread(plain.wall, bare.wall),
                    ratio_spread(traj.wall, same.wall),
                ]
            )
    report.table(
        f"1. Layer overhead ({batch_size} × 108-atom LJ argon, float32, {steps} steps)",
        [
            "ASE-style / engine",
            "raw engine ms/step",
            "raw engine, same work ms/step",
            "nvalchemi_ase ms/step",
            "ratio to same work, wall",
            "ratio to same work, CPU",
            "ratio to bare engine, wall",
            "ratio with trajectory every 10 steps, wall",
        ],
        rows,
        "Both sides build their batch, engine and neighbour-list hook (skin "
        f"{DEFAULT_SKIN} Å; the same hook on both sides: nvalchemi's, eager, "
        "skipped while the skin holds) inside the timed call; all sides are "
        f"timed in alternation over {rounds} rounds after a warm-up, and each "
        "ratio is the median of the round-by-round ratios with its interquartile "
        "range and full range. *Same work* is the raw engine given everything our "
        "object gives it: FIRE on zero velocities and unit masses with ASE's "
        "defaults (dt 0.1, dtmax 1.0, maxstep 0.2 Å) and, when our object carries "
        "one, a `status` column, with which nvalchemi's `step` takes its masked "
        "path (graph masks, saved and restored fields, masked output publishing). "
        "Targets ≤ 1.05 (same work) and ≤ 1.3 (trajectory). CPU ratios count this "
        "process's CPU time only, steadier than wall time on a loaded machine. "
        f"Load average (1, 5, 15 min) {load_before} before, {load_average()} "
        "after. Checks: " + "; ".join(checks) + ".",
    )


# ---------------------------------------------------------------------------
# 2. batched vs ASE sequential
# ---------------------------------------------------------------------------


def batched_vs_sequential(settings: Settings, report: Report) -> None:
    from ase import units
    from ase.md.verlet import VelocityVerlet as AseVelocityVerlet

    from nvalchemi_ase import NVAlchemiCalculator
    from nvalchemi_ase.md import VelocityVerlet

    calc = NVAlchemiCalculator(
        "lj", device=settings.device, dtype="float32", switch_width=1.0
    )
    steps = max(5, settings.md_steps // 4)
    rows = []
    for size in settings.sizes:
        for count in settings.batch_sizes:
            structures = [thermalized(argon(size, s), 40.0, s) for s in range(count)]

            def batched() -> None:
                copies = [a.copy() for a in structures]
                for atoms in copies:
                    atoms.calc = calc
                VelocityVerlet(copies, 2 * units.fs).run(steps)

            def sequential() -> None:
                for atoms in structures[: min(count, 8)]:
                    copy = atoms.copy()
                    copy.calc = calc
                    AseVelocityVerlet(copy, 2 * units.fs).run(steps)

            t_batched = median_time(batched, settings.repeats)
            t_sequential = (
                median_time(sequential, settings.repeats) * count / min(count, 8)
            )
            per_batched = t_batched / (count * steps)
            per_sequential = t_sequential / (count * steps)
            rows.append(
                [
                    str(len(structures[0])),
                    str(count),
                    f"{1e3 * per_sequential:.3f}",
                    f"{1e3 * per_batched:.3f}",
                    f"{per_sequential / per_batched:.1f}×",
                ]
            )
    report.table(
        "2a. Batched vs ASE sequential MD (LJ argon, float32)",
        [
            "atoms/structure",
            "structures",
            "ASE sequential ms/structure-step",
            "batched ms/structure-step",
            "speed-up",
        ],
        rows,
        "ASE sequential: `ase.md.VelocityVerlet` + `NVAlchemiCalculator`, one "
        "structure after another (up to 8 timed, extrapolated); target ≥ 10× at "
        "32 × 108 atoms.",
    )
    _sevennet_vs_calculator(settings, report)


def _sevennet_cases(settings: Settings) -> list[tuple[str, list[Any]]]:
    """Batches for the SevenNet-0 comparison: silicon supercells and a mixed set."""
    from ase.build import bulk

    from benchmarks.sevennet_batched import make_structures

    repeats = {8: (1, 1, 1), 16: (2, 1, 1), 32: (2, 2, 1), 64: (2, 2, 2)}
    cases = []
    for size in settings.sevennet_sizes:
        # the autograd graph holds ~250 kB per edge: cap a CPU batch at ~640 atoms
        count = settings.sevennet_count
        if not settings.device.startswith("cuda"):
            count = min(count, max(4, 640 // size))
        structures = []
        for seed in range(count):
            atoms = bulk("Si", "diamond", a=5.43, cubic=True).repeat(repeats[size])
            atoms.rattle(0.03, seed=seed)
            structures.append(atoms)
        cases.append((f"Si, {size} atoms", structures))
    if not settings.quick:
        cases.append(("mixed crystals, 8-64 atoms", make_structures(32)))
    return cases


def _sevennet_vs_calculator(settings: Settings, report: Report) -> None:
    if importlib.util.find_spec("sevenn") is None:
        report.sections.append(
            "## 2b. SevenNet-0\n\n`sevenn` is not installed: skipped."
        )
        return
    from sevenn.calculator import SevenNetCalculator

    from nvalchemi_ase import NVAlchemiCalculator

    ours = NVAlchemiCalculator("sevennet-0", device=settings.device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sevenn warns about missing accelerators
        theirs = SevenNetCalculator("7net-0", device=settings.device)
    rows = []
    for label, structures in _sevennet_cases(settings):
        count = len(structures)
        timed = min(count, 8)

        def batched() -> None:
            ours.calculate_batch(structures, ["energy", "forces", "stress"])

        def sequential() -> None:
            for atoms in structures[:timed]:
                theirs.calculate(atoms, ["energy", "forces", "stress"])

        t_batched, t_sequential = interleaved_medians(
            [batched, sequential], settings.repeats
        )
        t_sequential *= count / timed
        atoms_total = sum(len(a) for a in structures)
        rows.append(
            [
                label,
                str(count),
                str(atoms_total),
                f"{1e3 * t_sequential / count:.1f}",
                f"{1e3 * t_batched / count:.1f}",
                f"{t_sequential / t_batched:.2f}×",
            ]
        )
    report.table(
        "2b. SevenNet-0: batched single points vs sequential `SevenNetCalculator`",
        [
            "structures",
            "count",
            "atoms",
            "SevenNetCalculator ms/structure",
            "batched ms/structure",
            "speed-up",
        ],
        rows,
        "Energy + forces + stress, float32; sequential calls timed on up to 8 "
        "structures and scaled, sides timed in alternation. Target ≥ 3× at "
        "32 × 16 atoms. On a CPU the per-edge tensor products dominate once a "
        "structure has a few thousand edges, so batching 64-atom cells gains "
        "little there; the gain is in launch and Python overhead, larger on a GPU.",
    )


# ---------------------------------------------------------------------------
# 3. calculator overhead
# ---------------------------------------------------------------------------


def calculator_overhead(settings: Settings, report: Report) -> None:
    import torch

    from nvalchemi_ase import NVAlchemiCalculator, atoms_to_batch
    from nvalchemi_ase._quiet import import_quietly

    neighbors = import_quietly("nvalchemi.neighbors")
    rows = []
    for dtype in ("float32", "float64"):
        calc = NVAlchemiCalculator("lj", device=settings.device, dtype=dtype)
        atoms = argon(108, 0)
        atoms.calc = calc
        batch = atoms_to_batch(atoms, device=settings.device, dtype=dtype)
        model = calc.model
        config = model.model_config.neighbor_config

        def raw() -> None:
            neighbors.compute_neighbors(batch, config=config)
            model(batch)
            if settings.device != "cpu":
                torch.cuda.synchronize()

        def ours() -> None:
            atoms.positions[0, 0] += 1e-9  # invalidate ASE's cache
            atoms.get_forces()

        t_raw, t_ours = interleaved_medians(
            [raw, ours], settings.repeats * 20, warmup=3
        )
        rows.append(
            [
                dtype,
                f"{1e3 * t_raw:.2f}",
                f"{1e3 * t_ours:.2f}",
                f"{t_ours / t_raw:.2f}",
            ]
        )
    report.table(
        "3. Calculator overhead (one 108-atom LJ argon structure)",
        ["dtype", "neighbour list + model(batch) ms", "atoms.get_forces() ms", "ratio"],
        rows,
        "The raw side reuses a pre-built batch; the calculator validates the Atoms, "
        "refreshes its batch, builds the list and returns NumPy arrays. Sides are "
        "timed in alternation. Target ≤ 1.5.",
    )


# ---------------------------------------------------------------------------
# 4. adapter throughput
# ---------------------------------------------------------------------------


def adapter_throughput(settings: Settings, report: Report) -> None:
    import torch
    from ase.build import molecule

    from nvalchemi_ase import atoms_to_batch, batch_to_atoms
    from nvalchemi_ase._quiet import import_quietly

    data = import_quietly("nvalchemi.data")
    count = settings.adapter_count
    structures = [molecule("CH4") for _ in range(count)]
    for index, atoms in enumerate(structures):
        atoms.positions += 0.01 * index
    batch = atoms_to_batch(structures, device=settings.device, dtype="float32")

    def theirs_to() -> Any:
        return data.Batch.from_data_list(
            [
                data.AtomicData.from_atoms(
                    a, dtype=torch.float32, device=settings.device
                )
                for a in structures
            ]
        )

    reference_batch = theirs_to()
    t_ours_to, t_theirs_to, t_ours_back, t_theirs_back = interleaved_medians(
        [
            lambda: atoms_to_batch(structures, device=settings.device, dtype="float32"),
            theirs_to,
            lambda: batch_to_atoms(batch),
            reference_batch.to_data_list,
        ],
        settings.repeats,
    )
    report.table(
        f"4. Adapter throughput ({count} CH4 molecules)",
        [
            "direction",
            "AtomicData.from_atoms / Batch path s",
            "nvalchemi_ase s",
            "speed-up",
        ],
        [
            [
                "Atoms → Batch",
                f"{t_theirs_to:.3f}",
                f"{t_ours_to:.3f}",
                f"{t_theirs_to / t_ours_to:.1f}×",
            ],
            [
                "Batch → Atoms (theirs: to_data_list, no Atoms)",
                f"{t_theirs_back:.3f}",
                f"{t_ours_back:.3f}",
                f"{t_theirs_back / t_ours_back:.1f}×",
            ],
        ],
        "nvalchemi's path is `Batch.from_data_list([AtomicData.from_atoms(a) ...])`; "
        "back, `Batch.to_data_list()` stops at AtomicData while ours builds full "
        "ASE Atoms with results. Target ≥ 10× both ways.",
    )


# ---------------------------------------------------------------------------
# 5. scaling
# ---------------------------------------------------------------------------


def scaling(settings: Settings, report: Report) -> None:
    from ase import units

    from nvalchemi_ase import NVAlchemiCalculator
    from nvalchemi_ase.md import VelocityVerlet

    calc = NVAlchemiCalculator(
        "lj", device=settings.device, dtype="float32", switch_width=1.0
    )
    rows, totals, per_step = [], [], []
    for total in settings.scaling_atoms:
        count = max(1, round(total / 108))
        structures = [thermalized(argon(108, s), 40.0, s) for s in range(count)]
        for atoms in structures:
            atoms.calc = calc
        dyn = VelocityVerlet(structures, 2 * units.fs)
        dyn.run(2)  # warm-up: kernels, neighbour-list buffers
        steps = max(3, settings.md_steps // 4)
        elapsed = (
            median_time(functools.partial(dyn.run, steps), settings.repeats, warmup=0)
            / steps
        )
        atoms_total = count * 108
        totals.append(atoms_total)
        per_step.append(elapsed)
        rows.append(
            [
                str(atoms_total),
                str(count),
                f"{1e3 * elapsed:.2f}",
                f"{1e6 * elapsed / atoms_total:.3f}",
            ]
        )
    slope = (
        float(np.polyfit(np.log(totals), np.log(per_step), 1)[0])
        if len(totals) > 1
        else float("nan")
    )
    report.table(
        "5. Scaling of an MD step with total atoms (LJ argon, 108-atom structures)",
        ["atoms", "structures", "ms/step", "µs/atom-step"],
        rows,
        f"log-log slope: **{slope:.2f}** (target 1.0 ± 0.15 from 1k to 100k atoms).",
    )


# ---------------------------------------------------------------------------


BENCHMARKS = {
    "overhead": layer_overhead,
    "sequential": batched_vs_sequential,
    "calculator": calculator_overhead,
    "adapter": adapter_throughput,
    "scaling": scaling,
    "runners": lambda s, r: importlib.import_module("benchmarks.runners").run(s, r),
    "runners-sevennet": lambda *a: importlib.import_module(
        "benchmarks.runners"
    ).run_sevennet(*a),
    "distributed": lambda *a: importlib.import_module("benchmarks.distributed").run(*a),
    "memory": lambda *a: importlib.import_module("benchmarks.memory").run(*a),
    "neb": lambda s, r: importlib.import_module("benchmarks.neb").neb_paths(s, r),
    "neb-sevennet": lambda s, r: importlib.import_module("benchmarks.neb").neb_sevennet(
        s, r
    ),
    "properties": lambda *a: importlib.import_module("benchmarks.properties").run(*a),
    "properties-sevennet": lambda *a: importlib.import_module(
        "benchmarks.properties"
    ).run_sevennet(*a),
    "surfaces-defects": lambda *a: importlib.import_module(
        "benchmarks.surfaces_defects"
    ).run_lj(*a),
    "surfaces-defects-sevennet": lambda *a: importlib.import_module(
        "benchmarks.surfaces_defects"
    ).run_sevennet(*a),
    "torchsim": lambda *a: importlib.import_module("benchmarks.torchsim").run(*a),
    "kappa": lambda *a: importlib.import_module("benchmarks.thermal").run(*a, "kappa"),
    "qha": lambda *a: importlib.import_module("benchmarks.thermal").run(*a, "qha"),
    "md-analysis": lambda *a: importlib.import_module("benchmarks.md_analysis").run(*a),
    "models": lambda *a: importlib.import_module("benchmarks.models").run(*a),
}

#: Names ``--only`` takes for several benchmarks at once.
GROUPS = {
    # the batched workflows of #29 against their structure-by-structure loops (LJ)
    "workflows": ["surfaces-defects", "kappa", "qha", "md-analysis"],
}


def expand_names(names: Sequence[str]) -> list[str]:
    """Benchmark names with every group replaced by its members, in order, once."""
    expanded: list[str] = []
    for name in names:
        for member in GROUPS.get(name, [name]):
            if member not in expanded:
                expanded.append(member)
    return expanded


def main(argv: list[str] | None = None) -> int:
    """Run the benchmarks and write the report."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--quick", action="store_true", help="CI smoke run, under a minute"
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: torch's own choice)",
    )
    parser.add_argument(
        "--only",
        nargs="*",
        choices=sorted(BENCHMARKS) + sorted(GROUPS),
        default=None,
        help="run these benchmarks only; groups: "
        + "; ".join(f"{group} = {' '.join(names)}" for group, names in GROUPS.items()),
    )
    parser.add_argument(
        "--suite",
        choices=["gpu"],
        default=None,
        help="gpu: the prepared GPU checks (benchmarks/gpu.py), JSON + markdown "
        "into --output-dir",
    )
    parser.add_argument(
        "--output-dir",
        default="gpu-report",
        help="folder for the --suite reports (default: gpu-report/)",
    )
    parser.add_argument(
        "--time-limit",
        type=float,
        default=480.0,
        help="seconds the --suite run may take; sections that do not fit are "
        "skipped and listed (default: 480)",
    )
    parser.add_argument(
        "--output",
        default=None,
        help="markdown report (default: docs/performance.md for a full run; "
        "--only and --quick print only)",
    )
    args = parser.parse_args(argv)
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    if args.suite == "gpu":
        gpu = importlib.import_module("benchmarks.gpu")
        gpu.run_suite(
            args.device, args.quick, Path(args.output_dir), args.time_limit, BENCHMARKS
        )
        return 0
    settings = settings_for(args.device, args.quick)
    report = Report()
    start = time.perf_counter()
    for name in expand_names(args.only) if args.only else BENCHMARKS:
        BENCHMARKS[name](settings, report)
    elapsed = time.perf_counter() - start
    text = (
        environment(settings)
        + f" Total run time {elapsed:.0f} s.\n\n"
        + "\n\n".join(report.sections)
        + "\n"
    )
    # a partial run (--only) or a quick one must not replace the full report
    whole = not args.quick and not args.only
    output = args.output or ("docs/performance.md" if whole else None)
    if output:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        Path(output).write_text(text)
        print(f"wrote {output}", file=sys.stderr)
    return 0
