"""High-throughput runs: many structures through a bounded, refilled working batch.

:func:`irelax` (and :func:`relax` over it) relaxes any iterable of ``Atoms`` —
a list, ``ase.io.iread(...)``, a generator; never materialised — through a
*working batch* whose size is bounded by an atom (and edge) budget. Each
structure that finishes (converged, step limit, or failed) leaves the batch,
is yielded (and, with ``output=``, appended to an extxyz file at once), and the
next structures are admitted. :func:`single_points` evaluates in consecutive
chunks within the same budget, one ``calculate_batch`` each; :func:`md` runs
fixed-length MD in consecutive chunks within it.

Design: engines rebuilt per refill, state carried over
------------------------------------------------------
nvalchemi's own in-flight machinery (``BaseDynamics(sampler=...,
refill_frequency=...)``, ``refill_check``) was read and not used directly:

* ``refill_check`` builds the admitted structures with
  ``Batch.from_data_list(AtomicData...)``, which refuses mixed periodicity and
  cells with ``det <= 0`` and drops what :mod:`nvalchemi_ase.convert` carries
  (cell padding of molecules and slabs, frozen atoms, unit optimizer masses);
* everything this package keeps per structure next to the engine — the
  :class:`~nvalchemi_ase.dynamics.failures.FailureGuard` flags and snapshots,
  the neighbour-list hooks' reference positions and sizes, the optimizer's
  convergence arrays, the ``Atoms`` written back — is sized on the first batch
  and would have to be resized in step with it;
* its samplers need a sized, indexable dataset, not a stream.

What *is* nvalchemi's is the per-structure engine state: at each refill the
old engine's ``_sync_state_to_batch(remaining, n_new, new_batch)`` — the very
method ``refill_check`` calls — keeps the survivors' rows (FIRE's ``dt``,
``alpha`` and step counters, L-BFGS history, this package's BFGS Hessians,
widened if needed) and appends ``_make_new_state`` rows for the admitted
structures, and that state is handed to a freshly built optimizer of this
package (:func:`nvalchemi_ase._compat.carry_engine_state`). The survivors'
velocities (FIRE, FIRE2, MDMin) are copied over too. So a refill is: write
the batch back into the working ``Atoms``, build a new
:class:`~nvalchemi_ase.optimize.optimize.BatchedOptimizer` over survivors +
admitted structures (failure guard included), carry the state, prime (one
model evaluation: survivors get the forces they already had) and go on. No
structure's path depends on what else is in the batch: every engine works per
structure, convergence and step limits are per structure, and the state a
structure's next step reads is its own. The cost is one extra model
evaluation and one batch build per refill, so refills are batched: one
happens when a structure reaches its step limit (it must stop moving), when
every structure in the batch has finished, or when finished structures
(which stay frozen in the batch until then, as in a plain batched run) hold
:data:`_REFILL_FRACTION` of the batch's atoms and the next queued structure
fits (or the queue is empty, to shrink the batch).

Step limits are per structure (``steps`` of its own), as if it ran alone.
Admission is in input order; a structure that alone exceeds the budget (or
has a constraint nvalchemi cannot honour) is a per-structure failure with its
reason, never a crash.

Budget. With neither ``max_atoms`` nor ``max_edges`` the budget is the
model's memory estimate (:func:`~nvalchemi_ase.models.memory.memory_estimate`)
against :data:`~nvalchemi_ase.models.memory.SAFETY_FRACTION` of
:func:`~nvalchemi_ase.models.memory.available_memory`, as the command line
does; with either, those counts (edges: ordered pairs within the model's
cutoff, :func:`~nvalchemi_ase.models.memory.count_edges`).

Streaming output and resume. With ``output=PATH`` each finished structure is
appended to ``PATH`` (extxyz, finish order, ``info["index"]`` = input index)
and flushed; failures go to ``<stem>.failed.extxyz`` (``info["failure"]``
holds the reason). ``resume=True`` skips every index already in either file
(a last frame cut off mid-write is dropped first), so an interrupted run
continued with it ends with the same content (in another order;
:func:`read_results` gives input order). Without ``resume`` an existing,
non-empty output is refused.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Generator, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from ase import Atoms

    from nvalchemi_ase.calculator import NVAlchemiCalculator
    from nvalchemi_ase.models.memory import MemoryEstimate

__all__ = [
    "OPTIMIZERS",
    "Budget",
    "failed_path",
    "irelax",
    "md",
    "read_results",
    "relax",
    "single_points",
]

#: Optimizer names :func:`irelax` accepts (classes of ``nvalchemi_ase.optimize``).
OPTIMIZERS = ("FIRE", "FIRE2", "LBFGS", "BFGS", "MDMin")

#: Refill once finished structures hold this fraction of the batch's atoms.
_REFILL_FRACTION = 0.25


# -- public API -----------------------------------------------------------------


def irelax(
    structures: Iterable[Atoms],
    model: Any,
    *,
    optimizer: str | type = "FIRE",
    fmax: float = 0.05,
    steps: int = 1000,
    max_atoms: int | None = None,
    max_edges: int | None = None,
    output: str | Path | None = None,
    resume: bool = False,
    progress: bool | None = None,
    **optimizer_kwargs: Any,
) -> Iterator[tuple[int, Atoms]]:
    """Relax many structures through a bounded working batch, yielding as each ends.

    Parameters
    ----------
    structures : iterable of ase.Atoms
        Any iterable (list, ``ase.io.iread``, generator); read lazily, one
        structure ahead of admission. Never modified.
    model : str, nvalchemi model, or NVAlchemiCalculator
        A :func:`~nvalchemi_ase.models.load_model` name, a model, or a
        calculator (its model, device and dtype are used).
    optimizer : str or class
        One of :data:`OPTIMIZERS` or one of this package's optimizer classes.
    fmax : float
        Convergence threshold on each structure's largest force, eV/Å.
    steps : int
        Step limit of each structure (its own steps, counted from admission).
    max_atoms, max_edges : int, optional
        Working-batch limits (atoms; ordered pairs within the model's cutoff).
        Default: the model's memory estimate within the free memory.
    output : str or path, optional
        extxyz file each finished structure is appended to at once (failures:
        :func:`failed_path`).
    resume : bool
        Skip input indices already in ``output`` (or its failures file).
    progress : bool or None
        Progress bar over structures on standard error; None: only on a terminal.
    **optimizer_kwargs
        Passed to the optimizer class (``dt``, ``maxstep``, ``memory``, ...);
        ``device`` and ``dtype`` build the calculator when ``model`` is not one.

    Yields
    ------
    (int, ase.Atoms)
        Input index and a new ``Atoms``: final positions, a
        ``SinglePointCalculator`` with ``energy`` (eV) and ``forces`` [N, 3]
        (eV/Å), and ``info`` ``converged`` (bool), ``steps`` (int),
        ``failure`` (None or the reason) and ``index``.
    """
    if not fmax > 0:
        raise ValueError(f"fmax must be positive (eV/Å), got {fmax}")
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    device = optimizer_kwargs.pop("device", None)
    dtype = optimizer_kwargs.pop("dtype", None)
    for reserved in ("logfile", "trajectory", "model", "restart"):
        if reserved in optimizer_kwargs:
            raise TypeError(f"irelax() does not take {reserved}=")
    calc = _calculator(model, device, dtype)
    optimizer_class = _optimizer_class(optimizer)
    budget = Budget.for_calculator(calc, max_atoms, max_edges)
    sink = _Sink(output, resume)
    queue = _Queue(structures, skip=sink.done, budget=budget)
    relaxation = _Runner(calc, optimizer_class, optimizer_kwargs, fmax, steps, budget)
    bar = _progress_bar(progress)
    try:
        for index, atoms in relaxation.run(queue):
            sink.write(atoms)
            if bar is not None:
                bar.step(f"in flight {relaxation.in_flight}")
            yield index, atoms
    finally:
        relaxation.close()
        sink.close()
        if bar is not None:
            bar.close()


def relax(structures: Iterable[Atoms], model: Any, **kwargs: Any) -> list[Atoms]:
    """Relax many structures (see :func:`irelax`); results in input order.

    Parameters
    ----------
    structures : iterable of ase.Atoms
        The structures (never modified).
    model : str, nvalchemi model, or NVAlchemiCalculator
        The model.
    **kwargs
        Every keyword of :func:`irelax`.

    Returns
    -------
    list of ase.Atoms
        One per input structure, in input order; with ``resume=True`` those
        found in ``output`` are read back from it.
    """
    results = dict(irelax(structures, model, **kwargs))
    if kwargs.get("resume") and kwargs.get("output") is not None:
        for atoms in read_results(kwargs["output"]):
            results.setdefault(int(atoms.info["index"]), atoms)
    return [results[index] for index in sorted(results)]


def single_points(
    structures: Iterable[Atoms],
    model: Any,
    *,
    properties: Iterable[str] = ("energy", "forces"),
    max_atoms: int | None = None,
    output: str | Path | None = None,
) -> list[Atoms]:
    """Evaluate many structures in consecutive chunks within the budget.

    Parameters
    ----------
    structures : iterable of ase.Atoms
        Read lazily, one chunk at a time; never modified.
    model : str, nvalchemi model, or NVAlchemiCalculator
        The model.
    properties : iterable of str
        ASE property names (``energy`` eV, ``forces`` eV/Å, ``stress`` eV/Å³
        Voigt for cells of rank 3).
    max_atoms : int, optional
        Atoms per chunk (default: from the model's memory estimate).
    output : str or path, optional
        extxyz file each chunk's results are appended to (input order,
        ``info["index"]``); structures too large go to :func:`failed_path`.

    Returns
    -------
    list of ase.Atoms
        Copies with a ``SinglePointCalculator``, in input order; a structure
        too large for the budget comes back without results and with
        ``info["failure"]``.
    """
    from ase.calculators.singlepoint import SinglePointCalculator

    calc = _calculator(model, None, None)
    budget = Budget.for_calculator(calc, max_atoms, None)
    wanted = [p for p in properties]
    sink = _Sink(output, resume=False)
    results: list[Atoms] = []
    try:
        for chunk in _chunks(structures, budget):
            evaluate = [(i, a) for i, a, reason in chunk if reason is None]
            values = calc.calculate_batch([a for _, a in evaluate], wanted)
            by_index = dict(zip([i for i, _ in evaluate], values, strict=True))
            for index, atoms, reason in chunk:
                copy = atoms.copy()
                copy.info.update(index=index, failure=reason)
                if reason is None:
                    copy.calc = SinglePointCalculator(copy, **by_index[index])
                sink.write(copy)
                results.append(copy)
    finally:
        sink.close()
    return results


def md(
    structures: Iterable[Atoms],
    model: Any,
    *,
    dynamics: str | type = "Langevin",
    timestep: float,
    steps: int,
    max_atoms: int | None = None,
    output: str | Path | None = None,
    **kwargs: Any,
) -> list[Atoms]:
    """Run ``steps`` MD steps on every structure, in chunks within the budget.

    Consecutive structures are grouped into chunks whose atoms (or estimated
    memory) stay within the budget, and each chunk is one batched run of the
    MD class (fixed length, so no in-flight refill is needed).

    Parameters
    ----------
    structures : iterable of ase.Atoms
        Read lazily, one chunk at a time; never modified (their momenta are
        the initial ones).
    model : str, nvalchemi model, or NVAlchemiCalculator
        The model.
    dynamics : str or class
        A class name of :mod:`nvalchemi_ase.md` (``"Langevin"``,
        ``"VelocityVerlet"``, ``"Bussi"``, ...) or such a class.
    timestep : float
        ASE time units (``2 * ase.units.fs``).
    steps : int
        Steps per structure.
    max_atoms : int, optional
        Atoms per chunk (default: from the model's memory estimate).
    output : str or path, optional
        extxyz file each chunk's final states are appended to (input order
        within the run, ``info["index"]``); failures to :func:`failed_path`.
    **kwargs
        Passed to the MD class (``temperature_K``, ``friction``, ...): scalars
        only, since chunks differ in size. ``seed`` is offset by the chunk
        number, so chunks draw different noise (stochastic paths therefore
        depend on the chunking).

    Returns
    -------
    list of ase.Atoms
        Final states in input order: positions, momenta, a
        ``SinglePointCalculator`` (energy eV, forces eV/Å), ``info["index"]``
        and ``info["failure"]`` (None or the reason; a failed structure keeps
        its last finite state).
    """
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    md_class = _md_class(dynamics)
    calc = _calculator(model, None, None)
    budget = Budget.for_calculator(calc, max_atoms, None)
    sink = _Sink(output, resume=False)
    results: list[Atoms] = []
    seed = kwargs.pop("seed", None)
    try:
        for number, chunk in enumerate(_chunks(structures, budget)):
            chunk_seed = None if seed is None else int(seed) + number
            for atoms in _md_chunk(
                md_class, calc, chunk, timestep, steps, chunk_seed, kwargs
            ):
                sink.write(atoms)
                results.append(atoms)
    finally:
        sink.close()
    return results


def _md_chunk(
    md_class: type,
    calc: NVAlchemiCalculator,
    chunk: list[tuple[int, Atoms, str | None]],
    timestep: float,
    steps: int,
    seed: int | None,
    kwargs: dict[str, Any],
) -> list[Atoms]:
    """One batched MD run over a chunk; refused structures come back as failures."""
    slots = [_Slot(index, atoms.copy(), np.zeros(3)) for index, atoms, _ in chunk]
    refused = {slots[i].index: r for i, (_, _, r) in enumerate(chunk) if r}
    run = [slot for slot in slots if slot.index not in refused]
    values: dict[int, dict[str, Any]] = {}
    reasons: dict[int, str] = dict(refused)
    if run:
        for slot in run:
            slot.atoms.calc = calc
            slot.steps = steps
        extra = {} if seed is None else {"seed": seed}
        with _quiet_failures():
            dyn = md_class(
                [slot.atoms for slot in run], timestep, logfile=None, **kwargs, **extra
            )
            dyn.run(steps)
            failures = dyn.failures
        results = _batch_results(dyn, np.arange(len(run)))
        values = {slot.index: r for slot, r in zip(run, results, strict=True)}
        reasons |= {run[f.index].index: f.reason for f in failures}
    out = []
    for slot in slots:
        if slot.index in reasons:
            atoms = _failed_result(slot, reasons[slot.index], values.get(slot.index))
        else:
            atoms = _result(slot, values[slot.index], converged=True)
        atoms.info.pop("converged", None)
        out.append(atoms)
    return out


def _md_class(dynamics: str | type) -> type:
    from nvalchemi_ase import md as md_module

    if isinstance(dynamics, str):
        found = getattr(md_module, dynamics, None)
        if found is None or dynamics not in md_module.__all__:
            raise ValueError(
                f"dynamics must be a class name of nvalchemi_ase.md "
                f"({', '.join(md_module.__all__)}), got {dynamics!r}"
            )
        return found  # type: ignore[no-any-return]
    if isinstance(dynamics, type) and issubclass(
        dynamics, md_module.BatchedMolecularDynamics
    ):
        return dynamics
    raise TypeError(
        f"dynamics must be a name or an nvalchemi_ase.md class, got {dynamics!r}"
    )


def failed_path(output: str | Path) -> Path:
    """Where failures of a run with ``output`` go: ``<stem>.failed.extxyz``."""
    path = Path(output)
    return path.with_name(f"{path.stem}.failed.extxyz")


def read_results(path: str | Path, *, failures: bool = True) -> list[Atoms]:
    """Read a run's output back in input order.

    Parameters
    ----------
    path : str or path
        The ``output`` of :func:`irelax` / :func:`relax`.
    failures : bool
        Include the structures of :func:`failed_path` (``info["failure"]``).

    Returns
    -------
    list of ase.Atoms
        Sorted by ``info["index"]``; ``info["failure"]`` is None for the others.
    """
    frames = _read_frames(Path(path))
    if failures:
        frames += _read_frames(failed_path(path))
    for atoms in frames:
        atoms.info.setdefault("failure", None)
    return sorted(frames, key=lambda atoms: int(atoms.info["index"]))


# -- budget ---------------------------------------------------------------------


@dataclass
class Budget:
    """How much the working batch may hold.

    Attributes
    ----------
    max_atoms : int or None
        Atoms.
    max_edges : int or None
        Ordered pairs within ``cutoff``.
    max_bytes : float or None
        Bytes of the memory estimate (used when neither count is given).
    estimate : MemoryEstimate or None
        The model's estimate (with ``max_bytes``).
    cutoff : float or None
        Edge cutoff, Å.
    """

    max_atoms: int | None = None
    max_edges: int | None = None
    max_bytes: float | None = None
    estimate: MemoryEstimate | None = None
    cutoff: float | None = None
    available: int | None = field(default=None, repr=False)

    @classmethod
    def for_calculator(
        cls, calc: NVAlchemiCalculator, max_atoms: int | None, max_edges: int | None
    ) -> Budget:
        """Build the budget for ``calc``'s model: the counts given, else memory."""
        from nvalchemi_ase.models.memory import (
            SAFETY_FRACTION,
            available_memory,
            memory_estimate,
        )

        for name, value in (("max_atoms", max_atoms), ("max_edges", max_edges)):
            if value is not None and (isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        estimate = memory_estimate(calc.model, calc.dtype, calc.device)
        if max_atoms is not None or max_edges is not None:
            return cls(max_atoms, max_edges, cutoff=estimate.cutoff)
        available = available_memory(calc.device)
        return cls(
            max_bytes=SAFETY_FRACTION * available,
            estimate=estimate,
            cutoff=estimate.cutoff,
            available=available,
        )

    def cost(self, atoms: Atoms) -> npt.NDArray[np.float64]:
        """(atoms, edges, bytes) one structure takes; counts only what is limited."""
        from nvalchemi_ase.models.memory import count_edges

        natoms = float(len(atoms))
        counted = self.max_edges is not None or (
            self.estimate is not None and self.estimate.bytes_per_edge > 0
        )
        edges = count_edges(atoms, self.cutoff) if counted else 0.0
        memory = (
            0.0 if self.estimate is None else self.estimate.bytes_for(len(atoms), edges)
        )
        return np.array([natoms, edges, memory])

    @property
    def limits(self) -> npt.NDArray[np.float64]:
        """(atoms, edges, bytes) limits; inf where unlimited."""
        return np.array(
            [
                math.inf if value is None else float(value)
                for value in (self.max_atoms, self.max_edges, self.max_bytes)
            ]
        )

    def fits(
        self, used: npt.NDArray[np.float64], cost: npt.NDArray[np.float64]
    ) -> bool:
        """Whether ``cost`` fits next to ``used``."""
        return bool(np.all(used + cost <= self.limits))

    def refusal(self, cost: npt.NDArray[np.float64]) -> str | None:
        """Why a structure alone does not fit, or None."""
        from nvalchemi_ase.models.memory import format_bytes

        natoms, edges, memory = cost
        if self.max_atoms is not None and natoms > self.max_atoms:
            return f"{natoms:.0f} atoms exceed max_atoms={self.max_atoms}"
        if self.max_edges is not None and edges > self.max_edges:
            return f"{edges:.0f} edges exceed max_edges={self.max_edges}"
        if self.max_bytes is not None and memory > self.max_bytes:
            return (
                f"needs about {format_bytes(memory)} by the model's memory estimate; "
                f"{format_bytes(self.max_bytes)} may be used "
                f"({format_bytes(self.available or 0)} available)"
            )
        return None


# -- input queue ------------------------------------------------------------------


@dataclass
class _Slot:
    """One structure in (or about to enter) the working batch."""

    index: int
    atoms: Atoms  # the runner's own working copy
    cost: npt.NDArray[np.float64]
    steps: int = 0


class _Queue:
    """Inputs read lazily, one ahead; skipped and refused ones sorted out."""

    def __init__(self, structures: Iterable[Atoms], skip: set[int], budget: Budget):
        self._source = enumerate(structures)
        self._skip = skip
        self._budget = budget
        self._next: _Slot | None = None
        self.refused: list[tuple[_Slot, str]] = []
        self.exhausted = False

    def peek(self) -> _Slot | None:
        """Return the next admissible structure (refused ones go to ``refused``)."""
        while self._next is None and not self.exhausted:
            try:
                index, atoms = next(self._source)
            except StopIteration:
                self.exhausted = True
                break
            if index in self._skip:
                continue
            working = atoms.copy()
            slot = _Slot(index, working, self._budget.cost(working))
            reason = self._budget.refusal(slot.cost) or _constraint_problem(working)
            if reason is not None:
                self.refused.append((slot, reason))
                continue
            self._next = slot
        return self._next

    def take(self) -> _Slot:
        """Remove and return the structure :meth:`peek` showed."""
        slot = self.peek()
        if slot is None:
            raise IndexError("no structure left")
        self._next = None
        return slot


def _constraint_problem(atoms: Atoms) -> str | None:
    from nvalchemi_ase.dynamics.images import check_constraints

    try:
        check_constraints([atoms])
    except (ValueError, TypeError) as error:
        return str(error)
    return None


# -- the relaxation runner ----------------------------------------------------------


class _Runner:
    """The working batch: admission, steps, finishing, refills."""

    def __init__(
        self,
        calc: NVAlchemiCalculator,
        optimizer_class: type,
        optimizer_kwargs: dict[str, Any],
        fmax: float,
        steps: int,
        budget: Budget,
    ) -> None:
        self.calc = calc
        self.optimizer_class = optimizer_class
        self.optimizer_kwargs = optimizer_kwargs
        self.fmax = fmax
        self.steps = steps
        self.budget = budget
        self.slots: list[_Slot] = []
        self.finished = np.zeros(0, dtype=bool)
        self.opt: Any = None
        self._run: Generator[bool, None, None] | None = None
        #: Largest number of structures in flight so far.
        self.peak = 0

    @property
    def in_flight(self) -> int:
        """Structures in the working batch still moving."""
        return int((~self.finished).sum())

    def run(self, queue: _Queue) -> Iterator[tuple[int, Atoms]]:
        """Yield ``(index, result)`` for every input, in finish order."""
        while True:
            admitted = self._admit(queue)
            yield from self._refused(queue)
            survivors = [
                s for s, d in zip(self.slots, self.finished, strict=True) if not d
            ]
            if not survivors and not admitted:
                return
            self._rebuild(survivors, admitted)
            yield from self._advance_until_refill(queue)

    def close(self) -> None:
        """Stop the current optimizer run (closes its generator)."""
        if self._run is not None:
            self._run.close()
            self._run = None

    # -- admission and rebuild --------------------------------------------------

    def _used(self) -> npt.NDArray[np.float64]:
        """(atoms, edges, bytes) of the structures still moving."""
        used = np.zeros(3)
        for slot, done in zip(self.slots, self.finished, strict=True):
            if not done:
                used = used + slot.cost
        return used

    def _admit(self, queue: _Queue) -> list[_Slot]:
        used = self._used()
        admitted: list[_Slot] = []
        while (slot := queue.peek()) is not None and (
            self.budget.fits(used, slot.cost) or (not admitted and not used.any())
        ):
            admitted.append(queue.take())
            used = used + slot.cost
        return admitted

    def _refused(self, queue: _Queue) -> Iterator[tuple[int, Atoms]]:
        while queue.refused:
            slot, reason = queue.refused.pop(0)
            yield slot.index, _failed_result(slot, reason, results=None)

    def _rebuild(self, survivors: list[_Slot], admitted: list[_Slot]) -> None:
        """Build an optimizer over survivors + admitted; carry survivors' state."""
        previous, keep = (
            self.opt,
            [position for position, done in enumerate(self.finished) if not done],
        )
        self.close()
        slots = [*survivors, *admitted]
        for slot in slots:
            slot.atoms.calc = self.calc
        with _quiet_failures():
            opt = self.optimizer_class(
                [slot.atoms for slot in slots],
                logfile=None,
                progress=False,
                **self.optimizer_kwargs,
            )
        if previous is not None:
            _carry_state(previous, opt, keep, len(admitted))
        self.opt, self.slots = opt, slots
        self.finished = np.zeros(len(slots), dtype=bool)
        self.peak = max(self.peak, len(slots))
        self._run = opt._irun(self.fmax, _NO_LIMIT, sync_every_step=False)

    # -- stepping -----------------------------------------------------------------

    def _advance_until_refill(self, queue: _Queue) -> Iterator[tuple[int, Atoms]]:
        moving = np.ones(len(self.slots), dtype=bool)
        first = True
        while True:
            with _quiet_failures():
                self._step()
                if not first:
                    for position in np.flatnonzero(moving):
                        self.slots[position].steps += 1
                first = False
                converged = self.opt.converged_mask
                failed = self.opt.failed_mask
                limit = np.array([slot.steps >= self.steps for slot in self.slots])
                ended = (converged | failed | limit) & ~self.finished
                done = (
                    self._finish(np.flatnonzero(ended), converged, failed)
                    if ended.any()
                    else []
                )
                moving = ~self.finished
                refill = self._run is None or self._refill_due(
                    queue, limit & ~converged
                )
            yield from done
            if refill:
                return

    def _step(self) -> None:
        """One optimizer step (the first call: the initial evaluation)."""
        try:
            next(self._run)  # type: ignore[arg-type]
        except StopIteration:
            self._run = None

    def _refill_due(self, queue: _Queue, at_limit: npt.NDArray[np.bool_]) -> bool:
        """Whether to rebuild now: see the module docstring's refill policy."""
        if not self.finished.any():
            return False
        if (at_limit & ~self.opt.failed_mask).any() or not (~self.finished).any():
            return True
        sizes = np.array([len(slot.atoms) for slot in self.slots])
        if sizes[self.finished].sum() < _REFILL_FRACTION * sizes.sum():
            return False
        slot = queue.peek()
        return slot is None or self.budget.fits(self._used(), slot.cost)

    def _finish(
        self,
        positions: npt.NDArray[np.intp],
        converged: npt.NDArray[np.bool_],
        failed: npt.NDArray[np.bool_],
    ) -> list[tuple[int, Atoms]]:
        self.opt.sync_atoms()
        reasons = {f.index: f.reason for f in self.opt.failures}
        results = _batch_results(self.opt, positions)
        self.finished[positions] = True
        done = []
        for position, result in zip(positions, results, strict=True):
            slot = self.slots[position]
            if failed[position]:
                atoms = _failed_result(slot, reasons.get(position, "failed"), result)
            else:
                atoms = _result(slot, result, converged=bool(converged[position]))
            done.append((slot.index, atoms))
        return done


#: Step limit passed to the optimizer: the runner enforces per-structure limits.
_NO_LIMIT = 1 << 62


def _carry_state(previous: Any, opt: Any, keep: list[int], n_new: int) -> None:
    """Give ``opt`` the survivors' engine state and velocities from ``previous``."""
    import torch

    from nvalchemi_ase._compat import carry_engine_state

    remaining = torch.as_tensor(keep, dtype=torch.long, device=previous.batch.device)
    carry_engine_state(previous.engine, opt.engine, remaining, n_new, opt.batch)
    if not keep:
        return
    pointer = previous.batch.batch_ptr.cpu().numpy()
    rows = np.concatenate([np.arange(pointer[k], pointer[k + 1]) for k in keep])
    index = torch.as_tensor(rows, dtype=torch.long, device=previous.batch.device)
    with torch.no_grad():
        opt.batch.velocities[: rows.size].copy_(previous.batch.velocities[index])


def _batch_results(opt: Any, positions: npt.NDArray[np.intp]) -> list[dict[str, Any]]:
    """Energy (eV) and forces [N, 3] (eV/Å) of the graphs at ``positions``."""
    import torch

    batch = opt.batch
    energy = batch.energy.detach().reshape(-1).to(torch.float64).cpu().numpy()
    forces = batch.forces.detach().to(torch.float64).cpu().numpy()
    pointer = batch.batch_ptr.cpu().numpy()
    return [
        {
            "energy": float(energy[p]),
            "forces": forces[pointer[p] : pointer[p + 1]].copy(),
        }
        for p in positions
    ]


def _result(slot: _Slot, values: dict[str, Any], *, converged: bool) -> Atoms:
    from ase.calculators.singlepoint import SinglePointCalculator

    atoms = slot.atoms.copy()
    atoms.calc = SinglePointCalculator(atoms, **values)
    atoms.info.update(
        index=slot.index, converged=converged, steps=slot.steps, failure=None
    )
    return atoms


def _failed_result(slot: _Slot, reason: str, results: dict[str, Any] | None) -> Atoms:
    from ase.calculators.singlepoint import SinglePointCalculator

    atoms = slot.atoms.copy()
    if (
        results is not None
        and np.isfinite(results["energy"])
        and np.isfinite(results["forces"]).all()
    ):
        atoms.calc = SinglePointCalculator(atoms, **results)
    atoms.info.update(
        index=slot.index, converged=False, steps=slot.steps, failure=reason
    )
    return atoms


# -- chunks (single points) -----------------------------------------------------------


def _chunks(
    structures: Iterable[Atoms], budget: Budget
) -> Iterator[list[tuple[int, Atoms, str | None]]]:
    """Consecutive chunks within ``budget``; (index, atoms, refusal reason)."""
    chunk: list[tuple[int, Atoms, str | None]] = []
    used = np.zeros(3)
    for index, atoms in enumerate(structures):
        cost = budget.cost(atoms)
        reason = budget.refusal(cost)
        if reason is None and chunk and not budget.fits(used, cost):
            yield chunk
            chunk, used = [], np.zeros(3)
        chunk.append((index, atoms, reason))
        if reason is None:
            used = used + cost
    if chunk:
        yield chunk


# -- output files -------------------------------------------------------------------


class _Sink:
    """Appends finished structures to ``output`` / its failures file, flushed."""

    def __init__(self, output: str | Path | None, resume: bool) -> None:
        self.done: set[int] = set()
        self._files: dict[bool, Any] = {}
        if output is None:
            self._paths: dict[bool, Path] = {}
            return
        path = Path(output)
        self._paths = {False: path, True: failed_path(path)}
        if resume:
            for target in self._paths.values():
                frames = _read_frames(target, repair=True)
                self.done.update(int(atoms.info["index"]) for atoms in frames)
            return
        for target in self._paths.values():
            if target.exists() and target.stat().st_size:
                raise FileExistsError(
                    f"{target} exists; pass resume=True to continue that run, or "
                    "remove it"
                )

    def write(self, atoms: Atoms) -> None:
        """Append one result (failures to the failures file) and flush."""
        if not self._paths:
            return
        import io

        from ase.io import write

        failed = atoms.info.get("failure") is not None
        handle = self._files.get(failed)
        if handle is None:
            path = self._paths[failed]
            path.parent.mkdir(parents=True, exist_ok=True)
            handle = self._files[failed] = path.open("a")
        text = io.StringIO()
        frame = atoms.copy()
        frame.calc = atoms.calc
        if frame.info.get("failure") is None:
            frame.info.pop("failure", None)
        write(text, frame, format="extxyz")
        handle.write(text.getvalue())  # one write per frame
        handle.flush()

    def close(self) -> None:
        """Close the files."""
        for handle in self._files.values():
            handle.close()
        self._files.clear()


def _read_frames(path: Path, *, repair: bool = False) -> list[Atoms]:
    """Frames of an output file; ``repair`` drops a last frame cut off mid-write."""
    import os

    from ase.io import iread, write

    if not path.exists() or path.stat().st_size == 0:
        return []
    frames: list[Atoms] = []
    try:
        frames.extend(iread(path, index=":", format="extxyz"))
    except Exception:  # any parse error: a write that was interrupted
        if not repair:
            raise
        staged = path.with_name(path.name + ".repair")
        write(staged, frames, format="extxyz")
        os.replace(staged, path)
    return frames


# -- helpers ----------------------------------------------------------------------


def _calculator(model: Any, device: Any, dtype: Any) -> NVAlchemiCalculator:
    from nvalchemi_ase.calculator import NVAlchemiCalculator

    if isinstance(model, NVAlchemiCalculator):
        if device is not None or dtype is not None:
            raise TypeError(
                "device/dtype come from the calculator; pass a model name to set them"
            )
        return model
    return NVAlchemiCalculator(model, device=device, dtype=dtype)


def _optimizer_class(optimizer: str | type) -> type:
    from nvalchemi_ase import optimize

    if isinstance(optimizer, str):
        if optimizer not in OPTIMIZERS:
            raise ValueError(
                f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {optimizer!r}"
            )
        return getattr(optimize, optimizer)  # type: ignore[no-any-return]
    if isinstance(optimizer, type) and issubclass(optimizer, optimize.BatchedOptimizer):
        return optimizer
    raise TypeError(
        f"optimizer must be a name or a nvalchemi_ase.optimize class, got {optimizer!r}"
    )


@contextlib.contextmanager
def _quiet_failures() -> Iterator[None]:
    """Failures are reported per structure in the results, not warned about."""
    from nvalchemi_ase.dynamics.failures import StructureFailedWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", StructureFailedWarning)
        yield


def _progress_bar(progress: bool | None) -> Any:
    from nvalchemi_ase.dynamics.progress import ProgressBar, progress_enabled

    if not progress_enabled(progress):
        return None
    return ProgressBar("relax", _NO_LIMIT, unit="structure")
