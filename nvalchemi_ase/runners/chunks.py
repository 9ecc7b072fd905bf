"""Single points and fixed-length MD in consecutive chunks within the budget.

Chunks are formed over the whole input, so a resumed run evaluates the
uninterrupted run's chunks (see :mod:`nvalchemi_ase.runners`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from nvalchemi_ase.identity import MD_FIELDS, STRUCTURE_FIELDS
from nvalchemi_ase.runners._common import (
    Admission,
    CountedInputs,
    Run,
    Slot,
    check_written_first,
    checked_properties,
    failed_atoms,
    final_values,
    in_input_order,
    naming_inputs,
    opened_run,
    quiet_failures,
    result_atoms,
)
from nvalchemi_ase.runners.distributed import Shard
from nvalchemi_ase.runners.restart import (
    ChunkRestart,
    RunStopped,
    checkpoint_exists,
    rank_path,
)

if TYPE_CHECKING:
    from ase import Atoms

    from nvalchemi_ase.calculator import NVAlchemiCalculator
    from nvalchemi_ase.runners.budget import Budget

__all__ = ["imd", "isingle_points", "md", "single_points"]


#: (index, atoms, refusal reason or None) of one input in a chunk.
_Entry = tuple[int, "Atoms", "str | None"]


def isingle_points(
    structures: Iterable[Atoms],
    model: Any,
    *,
    properties: Iterable[str] = ("energy", "forces"),
    max_atoms: int | None = None,
    max_structures: int | None = None,
    output: str | Path | None = None,
    failures: str | Path | None = None,
    resume: bool = False,
    distributed: bool | None = None,
) -> Iterator[tuple[int, Atoms]]:
    """Evaluate many structures in consecutive chunks within the budget.

    Parameters
    ----------
    structures : iterable of ase.Atoms
        Read lazily, one chunk at a time; never modified.
    model : str, nvalchemi model, or NVAlchemiCalculator
        The model.
    properties : iterable of str
        ASE property names the model computes (``energy`` eV, ``forces`` eV/Å,
        ``stress`` eV/Å³ Voigt for cells of rank 3).
    max_atoms : int, optional
        Atoms per chunk (default: from the model's memory estimate).
    max_structures : int, optional
        Structures per chunk.
    output : str or path, optional
        extxyz file each chunk's results are appended to (input order,
        ``info["index"]``).
    failures : str or path, optional
        Where structures that cannot be evaluated go (default
        :func:`failed_path`).
    resume : bool
        Continue the run that wrote ``output`` (see the module docstring).
    distributed : bool or None
        Shard the structures across the ranks of a torch.distributed launch
        (``torchrun``); None: when launched so. See
        :mod:`nvalchemi_ase.runners.distributed`.

    Yields
    ------
    (int, ase.Atoms)
        Input index and a copy with a ``SinglePointCalculator``, in input
        order; a structure that cannot be evaluated (too large for the budget,
        rejected by :func:`~nvalchemi_ase.convert.check_images`) comes without
        results and with ``info["failure"]``.
    """
    from ase.calculators.singlepoint import SinglePointCalculator

    with opened_run(
        model,
        distributed=distributed,
        max_atoms=max_atoms,
        max_structures=max_structures,
        output=output,
        resume=resume,
        failures=failures,
        job=("single_points", {}, STRUCTURE_FIELDS),
    ) as run:
        wanted = checked_properties(properties, run.calc, allowed=None)
        admission = Admission(run.calc.model, 0.0)
        for chunk in _resumed_chunks(run, structures, admission):
            evaluate = [(i, a) for i, a, reason in chunk if reason is None]
            values = _evaluated(
                run.calc, [i for i, _ in evaluate], [a for _, a in evaluate], wanted
            )
            by_index = dict(zip([i for i, _ in evaluate], values, strict=True))
            for index, atoms, reason in chunk:
                if index in run.sink.done:
                    continue
                copy = atoms.copy()
                copy.info.update(index=index, failure=reason)
                if reason is None:
                    copy.calc = SinglePointCalculator(copy, **by_index[index])
                run.sink.write(copy)
                yield index, copy


def single_points(
    structures: Iterable[Atoms], model: Any, **kwargs: Any
) -> list[Atoms]:
    """Evaluate many structures (see :func:`isingle_points`); input order.

    Parameters
    ----------
    structures : iterable of ase.Atoms
        The structures (never modified).
    model : str, nvalchemi model, or NVAlchemiCalculator
        The model.
    **kwargs
        Every keyword of :func:`isingle_points`.

    Returns
    -------
    list of ase.Atoms
        Copies with a ``SinglePointCalculator``, in input order (with
        ``resume=True`` those found in ``output`` are read back from it); a
        structure that cannot be evaluated comes back without results and
        with ``info["failure"]``.
    """
    inputs = CountedInputs(structures)
    return in_input_order(isingle_points(inputs, model, **kwargs), kwargs, inputs)


def imd(
    structures: Iterable[Atoms],
    model: Any,
    *,
    dynamics: str | type = "Langevin",
    timestep: float,
    steps: int,
    max_atoms: int | None = None,
    max_structures: int | None = None,
    properties: Iterable[str] = ("energy", "forces"),
    output: str | Path | None = None,
    failures: str | Path | None = None,
    resume: bool = False,
    trajectory: str | None = None,
    logfile: str | Path | None = None,
    loginterval: int = 1,
    series: dict[int, dict[str, npt.NDArray[np.float64]]] | None = None,
    progress: bool | None = False,
    distributed: bool | None = None,
    restart: str | Path | None = None,
    restart_interval: int | None = None,
    stop: Callable[[], bool] | None = None,
    **kwargs: Any,
) -> Iterator[tuple[int, Atoms]]:
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
    max_structures : int, optional
        Structures per chunk.
    properties : iterable of str
        Results of the final states, from :data:`PROPERTIES` (``stress`` for
        cells of rank 3, evaluated when the last step did not compute it).
    output : str or path, optional
        extxyz file each chunk's final states are appended to (input order,
        ``info["index"]``).
    failures : str or path, optional
        Where failed structures go (default :func:`failed_path`).
    resume : bool
        Continue the run that wrote ``output`` (see the module docstring).
    trajectory : str, optional
        One ASE trajectory per structure, a path template with ``{i}`` (the
        input index): a frame every ``loginterval`` steps.
    logfile : str or path, optional
        The MD classes' log, appended to by every chunk (with several ranks,
        rank 0's; rank ``r`` writes ``md.rank<r>.log`` next to it, and
        ``"-"``, standard output, is rank 0's only).
    loginterval : int
        Steps between trajectory frames, log lines and ``series`` samples.
    series : dict, optional
        Filled with ``{index: {...}}`` per structure (arrays over samples:
        ``step``, ``time_ps``, ``epot_per_atom`` eV, ``temperature`` K,
        ``pressure_gpa``; see :class:`~nvalchemi_ase.dynamics.recorder.Recorder`).
    progress : bool or None
        A progress bar per chunk on standard error; None: only on a terminal.
    restart : str or path, optional
        Checkpoint of the chunk in flight (see
        :mod:`~nvalchemi_ase.runners.restart`): written every
        ``restart_interval`` steps, at the end of the chunk's run and on a
        stop, removed once the chunk's results are written. If it exists, the
        run continues from it (``resume=True`` implied): the first chunk not
        fully written goes on from the checkpoint's step instead of its start.
        With several ranks, rank ``r > 0`` uses ``stem.rank<r>.suffix``.
    restart_interval : int, optional
        Steps between checkpoint writes (default
        :data:`~nvalchemi_ase.dynamics.checkpoint.DEFAULT_RESTART_INTERVAL`).
    stop : callable, optional
        Asked after every step (and before every chunk); when it returns True
        the chunk in flight writes its checkpoint (with ``restart``), every
        file is flushed and closed, and :class:`RunStopped` is raised (its
        ``step`` and ``checkpoint`` say where). A stop asked for at the last
        step lets the chunk finish and write its results first.
    distributed : bool or None
        Shard the structures across the ranks of a torch.distributed launch
        (``torchrun``); None: when launched so. See
        :mod:`nvalchemi_ase.runners.distributed`.
    **kwargs
        Passed to the MD class (``temperature_K``, ``friction``, ...): scalars
        only, since chunks differ in size. ``seed`` is offset by the chunk
        number (and rank), so chunks draw different noise (stochastic paths
        therefore depend on the chunking and the number of ranks).

    Raises
    ------
    RunStopped
        When ``stop()`` returned True.

    Yields
    ------
    (int, ase.Atoms)
        Final states in input order: positions, momenta, a
        ``SinglePointCalculator`` (energy eV, forces eV/Å, stress when asked
        for), ``info["index"]``, ``info["steps"]`` (for a failure the step at
        which it failed) and ``info["failure"]`` (None or the reason; a failed
        structure keeps its last finite state).
    """
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    for reserved in ("model", "append_trajectory"):
        if reserved in kwargs:
            raise TypeError(f"imd() does not take {reserved}=")
    md_class = _md_class(dynamics)
    seed = kwargs.pop("seed", None)
    with opened_run(
        model,
        distributed=distributed,
        max_atoms=max_atoms,
        max_structures=max_structures,
        output=output,
        resume=resume or checkpoint_exists(restart),
        failures=failures,
        probe=False,  # chunks seed the noise: their layout must not depend on timings
        job=(
            "md",
            {
                "dynamics": md_class.__name__,
                "timestep": timestep,
                "steps": steps,
                "seed": seed,
                **kwargs,
            },
            MD_FIELDS,
        ),
    ) as run:
        checkpoint = (
            None
            if restart is None
            else ChunkRestart(rank_path(restart, run.shard), restart_interval)
        )
        chunk_run = _MDChunk(
            md_class,
            run.calc,
            timestep,
            steps,
            kwargs,
            stress="stress" in checked_properties(properties, run.calc),
            trajectory=trajectory,
            logfile=_rank_file(logfile, run.shard),
            loginterval=loginterval,
            series=series,
            progress=progress and run.shard.is_root,
            restart=checkpoint,
            stop=stop,
        )
        admission = Admission(run.calc.model, kwargs.get("neighbor_skin"))
        for number, chunk in _resumed_chunks(run, structures, admission, numbered=True):
            if stop is not None and stop():
                raise RunStopped(None, None)
            for atoms in chunk_run(chunk, run.shard.seed(seed, number), run.sink.done):
                run.sink.write(atoms)
                yield int(atoms.info["index"]), atoms
            if checkpoint is not None:
                checkpoint.written()  # after the results it protected
        if checkpoint is not None:
            checkpoint.written()  # every chunk written: a file left is stale


def md(structures: Iterable[Atoms], model: Any, **kwargs: Any) -> list[Atoms]:
    """Run MD on every structure in chunks (see :func:`imd`); input order.

    Parameters
    ----------
    structures : iterable of ase.Atoms
        The structures (never modified).
    model : str, nvalchemi model, or NVAlchemiCalculator
        The model.
    **kwargs
        Every keyword of :func:`imd` (``timestep`` and ``steps`` required).

    Returns
    -------
    list of ase.Atoms
        Final states in input order (with ``resume=True``, or a ``restart``
        file to continue from, those found in ``output`` are read back from it).
    """
    restart = kwargs.get("restart")
    if restart is not None and Path(restart).exists():
        kwargs["resume"] = True  # as imd() implies
    inputs = CountedInputs(structures)
    return in_input_order(imd(inputs, model, **kwargs), kwargs, inputs)


def _chunks(
    numbered: Iterable[tuple[int, Atoms]], budget: Budget, admission: Admission
) -> Iterator[list[_Entry]]:
    """Consecutive chunks within ``budget``; (index, atoms, refusal reason)."""
    chunk: list[_Entry] = []
    used = np.zeros(4)
    for index, atoms in numbered:
        reason = admission(atoms)  # the calculator's checks before any sizing
        cost = budget.cost(atoms) if reason is None else np.zeros(4)
        reason = reason or budget.refusal(cost)
        if reason is None and chunk and not budget.fits(used, cost):
            yield chunk
            chunk, used = [], np.zeros(4)
        chunk.append((index, atoms, reason))
        if reason is None:
            used = used + cost
    if chunk:
        yield chunk


def _resumed_chunks(
    run: Run,
    structures: Iterable[Atoms],
    admission: Admission,
    *,
    numbered: bool = False,
) -> Iterator[Any]:
    """Yield the chunks of this rank's inputs (numbered from 0) not fully done.

    Chunks are formed over every input of the rank, finished or not, so a
    resumed run evaluates the same chunks as the uninterrupted one.
    """
    check_written_first(run, structures)  # a list: before any work
    chunks = _chunks(run.shard.numbered(structures), run.budget, admission)
    for number, chunk in enumerate(chunks):
        run.sink.identify(
            [index for index, _, _ in chunk], [atoms for _, atoms, _ in chunk]
        )
        if all(index in run.sink.done for index, _, _ in chunk):
            continue
        yield (number, chunk) if numbered else chunk


def _rank_file(path: str | Path | None, shard: Shard) -> str | None:
    """Return this rank's log (``"-"`` on rank 0 only; see ``restart.rank_path``)."""
    if path is None:
        return None
    if str(path) == "-":
        return "-" if shard.is_root else None
    return str(rank_path(path, shard))


def _evaluated(
    calc: NVAlchemiCalculator,
    indices: list[int],
    images: list[Atoms],
    properties: list[str],
) -> list[dict[str, Any]]:
    """``calc.calculate_batch`` of one chunk; an error names the chunk's inputs."""
    if not images:
        return []
    with naming_inputs(indices):
        return calc.calculate_batch(images, properties)


class _MDChunk:
    """One batched MD run over a chunk; refused structures come back as failures."""

    def __init__(
        self,
        md_class: type,
        calc: NVAlchemiCalculator,
        timestep: float,
        steps: int,
        kwargs: dict[str, Any],
        *,
        stress: bool,
        trajectory: str | None,
        logfile: str | Path | None,
        loginterval: int,
        series: dict[int, dict[str, npt.NDArray[np.float64]]] | None,
        progress: bool | None,
        restart: ChunkRestart | None = None,
        stop: Callable[[], bool] | None = None,
    ) -> None:
        self.md_class = md_class
        self.calc = calc
        self.timestep = timestep
        self.steps = steps
        self.kwargs = kwargs
        self.stress = stress
        self.trajectory = trajectory
        self.logfile = logfile
        self.loginterval = loginterval
        self.series = series
        self.progress = progress
        self.restart = restart
        self.stop = stop

    def __call__(
        self, chunk: list[_Entry], seed: int | None, done: set[int]
    ) -> list[Atoms]:
        """Run the chunk; return the final states of the inputs not in ``done``."""
        slots = [Slot(index, atoms.copy(), np.zeros(4)) for index, atoms, _ in chunk]
        reasons = {index: reason for index, _, reason in chunk if reason}
        run = [slot for slot in slots if slot.index not in reasons]
        values: dict[int, dict[str, Any]] = {}
        if run:
            with naming_inputs([slot.index for slot in run]):
                values, failures = self._run(run, seed, done)
            reasons |= failures
        out = []
        for slot in slots:
            if slot.index in done:
                continue
            if slot.index in reasons:
                atoms = failed_atoms(slot, reasons[slot.index], values.get(slot.index))
            else:
                atoms = result_atoms(slot, values[slot.index], converged=True)
            atoms.info.pop("converged", None)
            out.append(atoms)
        return out

    def _run(
        self, run: list[Slot], seed: int | None, done: set[int]
    ) -> tuple[dict[int, dict[str, Any]], dict[int, str]]:
        from nvalchemi_ase.dynamics.recorder import Recorder
        from nvalchemi_ase.dynamics.trajectory import expand_template

        for slot in run:
            slot.atoms.calc = self.calc
            slot.steps = self.steps
        extra: dict[str, Any] = {} if seed is None else {"seed": seed}
        if self.trajectory is not None:
            paths = [
                Path(expand_template(self.trajectory, slot.index, "trajectory"))
                for slot in run
            ]
            for path in paths:
                path.parent.mkdir(parents=True, exist_ok=True)
            extra["trajectory"] = paths  # replaced: a chunk run again starts anew
        indices = [slot.index for slot in run]
        if self.restart is not None:
            extra |= self.restart.arguments(self.restart.continues(indices, done))
        with quiet_failures():
            dyn = self.md_class(
                [slot.atoms for slot in run],
                self.timestep,
                logfile=None if self.logfile is None else str(self.logfile),
                loginterval=self.loginterval,
                progress=self.progress,
                **self.kwargs,
                **extra,
            )
            recorder = (
                Recorder(dyn, self.loginterval) if self.series is not None else None
            )
            try:
                stopped = self._advance(dyn, indices)
            finally:
                dyn.close()
            if stopped:
                raise RunStopped(dyn.nsteps, self._written_checkpoint(dyn), indices)
            failures = {run[f.index].index: f for f in dyn.failures}
        for slot in run:
            if slot.index in failures:
                slot.steps = int(failures[slot.index].step)
        results = final_values(
            self.calc,
            [slot.atoms for slot in run],
            np.array([slot.index in failures for slot in run]),
            stress=self.stress,
        )
        if recorder is not None and self.series is not None:
            arrays = recorder.as_arrays()
            for column, slot in enumerate(run):
                self.series[slot.index] = {
                    key: value if value.ndim == 1 else value[:, column]
                    for key, value in arrays.items()
                }
        values = {slot.index: r for slot, r in zip(run, results, strict=True)}
        return values, {index: f.reason for index, f in failures.items()}

    def _advance(self, dyn: Any, indices: list[int]) -> bool:
        """Take the chunk's remaining steps; return whether ``stop()`` cut them short.

        A continued chunk starts at its checkpoint's step. On a stop the run
        is left at a yield, which writes the checkpoint of that step (see
        :meth:`BatchedDynamics.irun <nvalchemi_ase.md.md.MolecularDynamics.irun>`).
        """
        if self.restart is not None:
            dyn.checkpoint_tags = ChunkRestart.tags(indices)
        remaining = self.steps - int(dyn.nsteps)
        if remaining < 0:
            raise ValueError(
                f"restart file {dyn.restart}: the chunk is at step {dyn.nsteps}, "
                f"past steps={self.steps}; continue with the steps of the "
                "interrupted run"
            )
        if self.stop is None:
            dyn.run(remaining)
            return False
        # the generator run() uses (no write-back every step); closed at a stop
        with contextlib.closing(dyn.irun(remaining, sync_atoms=False)) as steps:
            for finished in steps:
                if not finished and self.stop():
                    return True
        return False

    def _written_checkpoint(self, dyn: Any) -> Path | None:
        """Return the checkpoint a stopped chunk left (None without ``restart``)."""
        if self.restart is None or not self.restart.exists():
            return None
        return self.restart.path


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
