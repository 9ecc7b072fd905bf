"""In-flight relaxation vs fixed chunks vs one by one (FIRE; LJ and SevenNet-0).

Heterogeneous structures, FIRE to 0.05 eV/Å, three ways:

* :func:`nvalchemi_ase.runners.irelax` with an atom budget (finished
  structures leave, queued ones are admitted);
* consecutive fixed chunks within the same atom budget, one batched
  ``nvalchemi_ase.optimize.FIRE`` run each (a chunk runs until its slowest
  structure converges; its converged structures stay in the batch, frozen,
  and are evaluated with it every step);
* ``ase.optimize.FIRE`` with :class:`~nvalchemi_ase.NVAlchemiCalculator`, one
  structure after another (a subset timed, extrapolated).

Two sets (:data:`CASES`):

* ``lj`` (section 10): 1000 LJ argon cells of 4-256 atoms (random ±3 %
  strains, 0.02-0.1 Å rattles), float64, atom budget 4096;
* ``sevennet`` (section 10b): 10 real crystals SevenNet-0 knows (Si, GaAs,
  Cu, Al, NaCl, MgO; conventional or primitive cells repeated 1-2 times per
  axis, 2-64 atoms, ±3 % strains, 0.02-0.1 Å rattles), float32 (its
  weights' dtype), a step cap of 100, atom budget 64, one timed round (on a
  CPU SevenNet-0 costs ~10-30 ms an atom evaluated: the section takes
  3-6 min); the in-flight runner also with ``refill_steps=6``, the
  default of direct-force models such as LJ (its default for
  machine-learned potentials is 1). The note adds CPU times, the edges
  within the model's cutoff the model evaluated (its cost on a CPU follows
  them) and the work ceiling in edges.

Besides the rates, every run counts its work: structure-steps (each
structure's own steps, summed), model evaluations (calls) and atoms evaluated
(atoms summed over calls), and the batches the model saw (each rebuilt working
batch or chunk starts with one evaluation of all of it). The paths are the
same three ways (ASE's FIRE arithmetic), so in float64 the structure-steps
agree and the atoms evaluated tell the work each way spends (in float32 a
structure's forces depend on its batch's summation order to rounding, so a
structure near the threshold may converge a step apart; the note says how
many do); ``ceiling`` is the fixed chunks' atoms evaluated over the least any
runner must evaluate, Σ atoms × (steps + 1): the in-flight speed-up over the
chunks if a step's cost were proportional to its atoms and refills were free.

Run alone: ``python -m benchmarks.runners [--model lj|sevennet] [--count N]
[--max-atoms M] [--repeats R]``, or in the suite: ``python -m benchmarks
--only runners`` (``runners-sevennet``; skipped in ``--quick`` mode and
without ``sevenn``).
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
    structures: list[Any] = []
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


# (symbol, structure, lattice constant near SevenNet-0's, Å)
CRYSTALS = [
    ("Si", "diamond", 5.47),
    ("GaAs", "zincblende", 5.75),
    ("Cu", "fcc", 3.62),
    ("Al", "fcc", 4.04),
    ("NaCl", "rocksalt", 5.69),
    ("MgO", "rocksalt", 4.25),
]


def make_crystals(count: int, seed: int = 0) -> list[Any]:
    """``count`` real crystals of 2-64 atoms, strained (±3 %) and rattled.

    Each draws a crystal of :data:`CRYSTALS`, its conventional (cubic) or
    primitive cell, and 1-2 repeats along each axis, until the cell has 2-64
    atoms; then a random ±3 % strain and a 0.02-0.1 Å rattle.
    """
    from ase.build import bulk

    rng = np.random.default_rng(seed)
    structures: list[Any] = []
    while len(structures) < count:
        symbol, kind, a = CRYSTALS[rng.integers(len(CRYSTALS))]
        cubic = bool(rng.integers(2))
        repeat = tuple(int(r) for r in rng.integers(1, 3, size=3))
        atoms = bulk(symbol, kind, a=a, cubic=cubic) * repeat
        if not 2 <= len(atoms) <= 64:
            continue
        strain = np.eye(3) + rng.uniform(-0.03, 0.03, (3, 3))
        atoms.set_cell(atoms.cell.array @ strain, scale_atoms=True)
        atoms.rattle(rng.uniform(0.02, 0.1), seed=int(rng.integers(1 << 30)))
        structures.append(atoms)
    return structures


@dataclass(frozen=True)
class Sizes:
    """How many structures, the atom budget, one-by-one timed, timed rounds."""

    count: int
    max_atoms: int
    sequential: int
    repeats: int


@dataclass(frozen=True)
class Case:
    """One model's benchmark: calculator, structures, limits and sizes."""

    section: str
    label: str
    model: str
    dtype: str
    make: Callable[[int, int], list[Any]]
    structures: str  # the set, for the note
    steps: int  # each structure's step limit
    refills: tuple[float | None, ...]  # irelax refill_steps (None: default)
    full: Sizes
    quick: Sizes | None  # None: skipped in quick mode
    cuda: Sizes | None = None  # None: ``full``
    warm: int = 4  # structures of the warm-up round (seed 1)
    warm_steps: int | None = None  # their step limit (None: ``steps``)
    details: bool = False  # more checks in the note (float32: steps may differ)


LJ = Case(
    section="10",
    label="LJ",
    model="lj",
    dtype="float64",
    make=make_structures,
    structures="LJ argon structures of 4-256 atoms (random ±3 % strains, "
    "0.02-0.1 Å rattles)",
    steps=STEPS,
    refills=(None,),
    full=Sizes(1000, 4096, 50, 3),
    quick=Sizes(40, 1024, 8, 1),
)
SEVENNET = Case(
    section="10b",
    label="SevenNet-0",
    model="sevennet-0",
    dtype="float32",
    make=make_crystals,
    structures="SevenNet-0 (float32) crystals of 2-64 atoms (Si, GaAs, Cu, Al, "
    "NaCl, MgO; cubic or primitive cells, 1-2 repeats per axis; random ±3 % "
    "strains, 0.02-0.1 Å rattles)",
    steps=100,
    refills=(None, 6.0),
    full=Sizes(10, 64, 3, 1),
    quick=None,  # ~10 ms an atom-evaluation on a CPU: minutes even for a few
    cuda=Sizes(256, 2048, 16, 3),
    warm=6,
    warm_steps=3,
    details=True,
)
CASES = {"lj": LJ, "sevennet": SEVENNET}


@dataclass
class Work:
    """What one run did: wall time, each structure's steps, model calls, atoms."""

    seconds: float
    steps: list[int]
    calls: int = 0
    atoms: int = 0
    batches: int = 0  # calls on a batch the previous call did not evaluate
    cpu: float = 0.0  # this process's CPU seconds (all threads)
    edges: int = 0  # edges within the model's cutoff, summed over calls


class _Counted:
    """Counts the calls of a calculator's model, the atoms and batches they see.

    With ``edges``, also the edges within the model's ``cutoff`` (a COO list
    built with a Verlet skin holds more; the model drops them): what a
    message-passing model's cost follows.
    """

    def __init__(self, calc: Any, edges: bool = False) -> None:
        self.calls = self.atoms = self.batches = self.edges = 0
        self._last: Any = None
        model = calc.model
        forward = model.forward
        cutoff = float(model.cutoff) if edges else 0.0

        def counting(batch: Any, *args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            self.atoms += int(batch.num_nodes)
            if batch is not self._last:
                self.batches += 1
                self._last = batch
            if cutoff:
                self.edges += _edges_within(batch, cutoff)
            return forward(batch, *args, **kwargs)

        model.forward = counting

    def run(self, function: Callable[[], tuple[float, list[int]]]) -> Work:
        self.calls = self.atoms = self.batches = self.edges = 0
        self._last = None
        cpu = time.process_time()
        seconds, steps = function()
        cpu = time.process_time() - cpu
        return Work(
            seconds, steps, self.calls, self.atoms, self.batches, cpu, self.edges
        )


def _edges_within(batch: Any, cutoff: float) -> int:
    """Edges of ``batch``'s COO neighbour list no longer than ``cutoff``."""
    import torch

    from nvalchemi_ase.models.edge_vectors import edge_graph

    with torch.no_grad():
        graph = edge_graph(
            batch,
            cutoff=cutoff,
            dtype=batch.positions.dtype,
            need_cell=False,
            model_name="edge count",
        )
    return int(graph.edge_index.shape[1])


def _in_flight(
    structures: list[Any],
    calc: Any,
    max_atoms: int,
    steps: int = STEPS,
    refill_steps: float | None = None,
) -> tuple[float, list[int]]:
    from nvalchemi_ase.runners import irelax

    taken = [0] * len(structures)
    start = time.perf_counter()
    for index, atoms in irelax(
        structures,
        calc,
        optimizer="FIRE",
        fmax=FMAX,
        steps=steps,
        max_atoms=max_atoms,
        refill_steps=refill_steps,
    ):
        taken[index] = int(atoms.info["steps"])
    return time.perf_counter() - start, taken


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
    structures: list[Any], calc: Any, max_atoms: int, steps: int = STEPS
) -> tuple[float, list[int]]:
    from nvalchemi_ase.optimize import FIRE

    taken = [0] * len(structures)
    start = time.perf_counter()
    for chunk in _chunks(structures, max_atoms):
        images = [structures[index].copy() for index in chunk]
        for image in images:
            image.calc = calc
        optimizer = FIRE(images, logfile=None)
        optimizer.run(fmax=FMAX, steps=steps)
        for index, step in zip(chunk, optimizer.converged_at_step, strict=True):
            # a structure that never converged ran to the limit
            taken[index] = int(step) if step >= 0 else steps
    return time.perf_counter() - start, taken


def _one_by_one(
    structures: list[Any], calc: Any, steps: int = STEPS
) -> tuple[float, list[int]]:
    from ase.optimize import FIRE

    taken = []
    start = time.perf_counter()
    for atoms in structures:
        copy = atoms.copy()
        copy.calc = calc
        optimizer = FIRE(copy, logfile=None)
        optimizer.run(fmax=FMAX, steps=steps)
        taken.append(optimizer.nsteps)
    return time.perf_counter() - start, taken


def ceiling(
    structures: list[Any],
    steps: list[int],
    max_atoms: int,
    weights: list[float] | None = None,
) -> float:
    """Fixed chunks' atoms evaluated over the least needed, Σ atoms × (steps + 1).

    With ``weights`` (one per structure, e.g. its edges) the same in those
    units instead of atoms.
    """
    sizes = np.array(
        [len(atoms) for atoms in structures] if weights is None else weights
    )
    counts = np.asarray(steps) + 1
    chunked = sum(
        float(sizes[chunk].sum() * counts[chunk].max())
        for chunk in _chunks(structures, max_atoms)
    )
    return chunked / float((sizes * counts).sum())


def agreement(first: list[int], second: list[int]) -> str:
    """``identical``, or on how many structures and by how much they differ."""
    gaps = np.abs(np.asarray(first) - np.asarray(second))
    if not gaps.any():
        return "identical"
    return (
        f"DIFFER on {int(np.count_nonzero(gaps))} of {len(gaps)} structures "
        f"(by at most {int(gaps.max())} steps; sums {sum(first)} and {sum(second)})"
    )


def _millions(count: float) -> str:
    """``count`` in millions, to three decimals (four below 0.1 M)."""
    return f"{count / 1e6:.{3 if count >= 1e5 else 4}f}"


def _in_flight_name(refill: float | None) -> str:
    return "in-flight" if refill is None else f"in-flight, refill_steps={refill:g}"


def measure(
    count: int,
    max_atoms: int,
    sequential: int,
    device: str = "cpu",
    repeats: int = 3,
    case: Case = LJ,
) -> tuple[list[list[str]], str]:
    """Rows for the report table and a line on the work ceiling.

    The in-flight runs (one per ``case.refills``) and the chunks are timed in
    alternation, ``repeats`` rounds after a warm-up; their median wall time is
    reported. One by one is timed once on the first ``sequential`` structures
    and extrapolated to ``count``.
    """
    from nvalchemi_ase import NVAlchemiCalculator

    calc = NVAlchemiCalculator(case.model, device=device, dtype=case.dtype)
    counted = _Counted(calc, edges=case.details)
    structures = case.make(count, 0)
    warm = case.make(case.warm, 1)
    warm_steps = case.steps if case.warm_steps is None else case.warm_steps
    for refill in case.refills:
        _in_flight(warm, calc, max_atoms, warm_steps, refill)
    _chunked(warm, calc, max_atoms, warm_steps)
    names = [_in_flight_name(refill) for refill in case.refills]
    runs: dict[str, list[Work]] = {name: [] for name in [*names, "chunks"]}

    def in_flight(refill: float | None) -> Callable[[], tuple[float, list[int]]]:
        return lambda: _in_flight(structures, calc, max_atoms, case.steps, refill)

    for _ in range(repeats):
        for name, refill in zip(names, case.refills, strict=True):
            runs[name].append(counted.run(in_flight(refill)))
        runs["chunks"].append(
            counted.run(lambda: _chunked(structures, calc, max_atoms, case.steps))
        )
    timed = min(sequential, count)
    alone = counted.run(lambda: _one_by_one(structures[:timed], calc, case.steps))
    seconds = {
        name: statistics.median(work.seconds for work in works)
        for name, works in runs.items()
    }
    seconds["one by one"] = alone.seconds * count / timed
    labels = {
        name: "in-flight `irelax`"
        + ("" if refill is None else f", `refill_steps={refill:g}`")
        for name, refill in zip(names, case.refills, strict=True)
    }
    labels["chunks"] = "fixed chunks, batched FIRE"
    labels["one by one"] = f"one by one, `ase.optimize.FIRE` ({timed} timed)"
    works = {name: works[0] for name, works in runs.items()}
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
                _millions(work.atoms * scale),
                f"{seconds['chunks'] / seconds[name]:.2f}",
                f"{seconds['one by one'] / seconds[name]:.1f}",
            ]
        )
    steps = runs[names[0]][0].steps
    checks = [
        f"in-flight and chunk steps per structure "
        f"{agreement(steps, runs['chunks'][0].steps)}"
    ]
    checks += [
        f"{name} against in-flight {agreement(runs[name][0].steps, steps)}"
        for name in names[1:]
    ]
    sizes = [len(atoms) for atoms in structures]
    if case.details:
        checks.append(
            f"one by one and in-flight steps on the {timed} timed structures "
            f"{agreement(alone.steps, steps[:timed])}"
        )
        checks.append(
            "batches the model evaluated (each starts with an evaluation of all "
            "of it): "
            + ", ".join(f"{name} {runs[name][0].batches}" for name in names)
            + f", chunks {runs['chunks'][0].batches}"
        )
        cpu = {
            name: statistics.median(w.cpu for w in done) for name, done in runs.items()
        }
        cpu["one by one"] = alone.cpu * count / timed
        checks.append(
            "process CPU s (steadier than wall on a shared machine): "
            + ", ".join(
                f"{name} {value:.1f} ({cpu['chunks'] / value:.2f}× chunks)"
                for name, value in cpu.items()
            )
        )
        from nvalchemi_ase.models.memory import count_edges

        edges = [count_edges(atoms, float(calc.model.cutoff)) for atoms in structures]
        checks.append(
            "work ceiling in edges within the cutoff (each structure's at its "
            "start): "
            f"{ceiling(structures, steps, max_atoms, edges):.2f}; least needed "
            f"Σ edges × (steps + 1) "
            f"{float(np.dot(edges, np.asarray(steps) + 1)) / 1e6:.3f} M"
        )
        checks.append(
            "edges within the cutoff evaluated (M): "
            + ", ".join(
                f"{name} {work.edges * count / len(work.steps) / 1e6:.3f}"
                for name, work in works.items()
            )
        )
        checks.append(
            f"{sum(sizes)} atoms, {min(sizes)}-{max(sizes)} per structure "
            f"(mean {np.mean(sizes):.1f}); "
            f"{sum(step >= case.steps for step in steps)} reached the "
            f"{case.steps}-step limit"
        )
    rounds = "; ".join(
        f"{name} {', '.join(f'{w.seconds:.2f}' for w in done)} s"
        for name, done in runs.items()
    )
    note = (
        f"Work ceiling of in-flight over chunks (atoms evaluated): "
        f"{ceiling(structures, steps, max_atoms):.2f}; steps per structure "
        f"{min(steps)}-{max(steps)} (mean {np.mean(steps):.1f}); "
        + "; ".join(checks)
        + f"; wall times: median of {repeats} alternated rounds ({rounds})."
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


def title(case: Case) -> str:
    """The report section's title."""
    return (
        f"{case.section}. In-flight relaxation vs fixed chunks vs one by one "
        f"({case.label}, FIRE)"
    )


def table(case: Case, settings: Any, report: Any) -> None:
    """Run ``case`` at ``settings``' sizes and add its table to ``report``."""
    sizes = case.quick if settings.quick else case.full
    if not settings.quick and settings.device.startswith("cuda") and case.cuda:
        sizes = case.cuda
    if sizes is None:
        report.table(title(case), HEADER, [], "skipped in quick mode")
        return
    rows, note = measure(
        sizes.count,
        sizes.max_atoms,
        sizes.sequential,
        settings.device,
        sizes.repeats,
        case,
    )
    report.table(
        title(case),
        HEADER,
        rows,
        f"{sizes.count} {case.structures}, FIRE to {FMAX} eV/Å"
        + (f" (at most {case.steps} steps)" if case.steps != STEPS else "")
        + f"; atom budget {sizes.max_atoms}. "
        + note,
    )


def run(settings: Any, report: Any) -> None:
    """Section 10 of :mod:`benchmarks.run` (LJ)."""
    table(LJ, settings, report)


def run_sevennet(settings: Any, report: Any) -> None:
    """Section 10b of :mod:`benchmarks.run` (SevenNet-0; skipped without sevenn)."""
    import importlib.util

    if importlib.util.find_spec("sevenn") is None:
        report.sections.append(
            f"## {title(SEVENNET)}\n\n`sevenn` is not installed: skipped."
        )
        return
    table(SEVENNET, settings, report)


def main() -> None:
    """Print the table for ``--count`` structures of ``--model``'s set."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", choices=sorted(CASES), default="lj")
    parser.add_argument("--count", type=int, default=None)
    parser.add_argument("--max-atoms", type=int, default=None)
    parser.add_argument("--sequential", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    case = CASES[args.model]
    full = case.full
    rows, note = measure(
        args.count or full.count,
        args.max_atoms or full.max_atoms,
        args.sequential or full.sequential,
        args.device,
        args.repeats or full.repeats,
        case,
    )
    print("| " + " | ".join(HEADER) + " |")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print(note)


if __name__ == "__main__":
    main()
