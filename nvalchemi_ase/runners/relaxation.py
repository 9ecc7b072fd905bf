"""Relaxation through a refilled working batch: :func:`irelax`, :func:`relax`.

See :mod:`nvalchemi_ase.runners` for the design (one optimizer resized in
place at each refill) and the refill policy.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Generator, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from nvalchemi_ase.identity import (
    STRUCTURE_FIELDS,
    first_difference,
    inputs_checked_by_caller,
    structure_digests,
)
from nvalchemi_ase.runners._common import (
    NO_LIMIT,
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
    progress_bar,
    quiet_failures,
    result_atoms,
)
from nvalchemi_ase.runners.budget import Budget
from nvalchemi_ase.runners.restart import (
    FINISHED_TAG,
    FRAMES_TAG,
    IDENTITY_TAG,
    IDLE_TAG,
    INDICES_TAG,
    SERIES_LENGTHS_TAG,
    SERIES_TAG,
    STEPS_TAG,
    RunStopped,
    WorkingBatchRestart,
    checkpoint_exists,
    rank_path,
)

if TYPE_CHECKING:
    from ase import Atoms

    from nvalchemi_ase.calculator import NVAlchemiCalculator
    from nvalchemi_ase.convert import CheckedImages

__all__ = ["OPTIMIZERS", "irelax", "relax"]


#: Optimizer names :func:`irelax` accepts (classes of ``nvalchemi_ase.optimize``).
OPTIMIZERS = ("FIRE", "FIRE2", "LBFGS", "BFGS", "MDMin")


#: What a refill costs, in steps of the whole working batch, for a model that
#: computes its forces directly (LJ): refill once the finished structures'
#: atoms, summed over the steps they sat frozen in the batch, reach this many
#: batches' atoms (see the module docstring). Measured for LJ argon, 4096
#: atoms, on a CPU: a refill (the admitted structures' batch, neighbour lists
#: and first evaluation, resizing the batch, write-back) costs about 3-5
#: steps, and 6 beat 0.5-3 (docs/performance.md, section 10).
_REFILL_STEPS = 6.0

#: The same for a model whose forces come by autograd (machine-learned
#: potentials): an evaluation costs far more than the rest of a refill, so a
#: refill costs about one step (SevenNet-0 on a CPU: 1 evaluates 16-20 % fewer
#: atoms than 6 and is faster, docs/performance.md, TorchSim section).
_REFILL_STEPS_AUTOGRAD = 1.0


def irelax(
    structures: Iterable[Atoms],
    model: Any,
    *,
    optimizer: str | type = "FIRE",
    fmax: float = 0.05,
    steps: int = 1000,
    cell_filter: type | None = None,
    max_atoms: int | None = None,
    max_edges: int | None = None,
    max_structures: int | None = None,
    refill_steps: float | None = None,
    properties: Iterable[str] = ("energy", "forces"),
    output: str | Path | None = None,
    failures: str | Path | None = None,
    resume: bool = False,
    trajectory: str | None = None,
    series: dict[int, dict[str, npt.NDArray[np.float64]]] | None = None,
    progress: bool | None = None,
    distributed: bool | None = None,
    restart: str | Path | None = None,
    restart_interval: int | None = None,
    stop: Callable[[], bool] | None = None,
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
        Convergence threshold on each structure's largest force, eV/Å (cell
        forces included under a cell filter).
    steps : int
        Step limit of each structure (its own steps, counted from admission).
    cell_filter : class, optional
        ASE's ``FrechetCellFilter`` or ``UnitCellFilter``: relax the cells too
        (every optimizer takes one: FIRE, BFGS and MDMin follow ASE's path on
        ASE's filter, FIRE2 and LBFGS run nvalchemi's variable-cell engines;
        under a cell filter FIRE, BFGS and MDMin honour FixAtoms only). Refills then
        wait for the whole working batch (see the module docstring).
    max_atoms, max_edges : int, optional
        Working-batch limits (atoms; ordered pairs within the model's cutoff).
        Default: the model's memory estimate within the free memory.
    max_structures : int, optional
        Largest number of structures in the working batch.
    refill_steps : float, optional
        What a refill costs, in steps of the whole working batch: a refill is
        due once the finished structures' atoms, summed over the steps they
        sat frozen in the batch, reach this many batches' atoms. Default: 1
        for a model whose forces come by autograd (machine-learned
        potentials: an evaluation dominates a refill), :data:`_REFILL_STEPS`
        (6) for one that computes them directly (LJ, measured for batches of
        ~4000 atoms on a CPU, where building the batch and neighbour lists
        dominates a refill). Small batches want about 1 (the property
        workflows use 1). Only timing changes, never a structure's path.
    properties : iterable of str
        Results kept per structure, from :data:`PROPERTIES`: ``energy`` (eV)
        and ``forces`` (eV/Å) always; ``stress`` (Voigt, eV/Å³, cells of rank
        3) is evaluated for each structure as it finishes when the optimizer
        did not compute it.
    output : str or path, optional
        extxyz file each finished structure is appended to at once.
    failures : str or path, optional
        Where failed structures go (default :func:`failed_path` of ``output``).
    resume : bool
        Keep the input indices already in ``output`` (or ``failures``) and
        relax the others.
    trajectory : str, optional
        One ASE trajectory per structure: a path template with ``{i}``, the
        input index (``"traj/{i:05d}.traj"``). Frames as the optimizer alone
        would write them (the initial state, then every step until the
        structure finished); a structure that is resumed starts its file anew.
    series : dict, optional
        Filled with ``{index: {"epot_per_atom": (n + 1,) eV, "fmax": (n + 1,)
        eV/Å}}`` over each structure's own steps 0..n as it finishes (for
        plots; :func:`nvalchemi_ase.plotting.plot_relaxation`).
    progress : bool or None
        Progress bar over structures on standard error; None: only on a terminal.
    distributed : bool or None
        Shard the structures across the ranks of a torch.distributed launch
        (``torchrun``); None: when launched so. See
        :mod:`nvalchemi_ase.runners.distributed`.
    restart : str or path, optional
        Checkpoint of the working batch (format
        :mod:`nvalchemi_ase.dynamics.checkpoint`, runner bookkeeping as tags;
        see :mod:`nvalchemi_ase.runners.restart`): written every
        ``restart_interval`` batch steps and on a stop, removed once every
        structure is written. If it exists, the run continues from it
        (``resume=True`` implied): the structures in flight go on from their
        checkpointed state instead of starting again. Under ``torchrun``, one
        file per rank (``stem.rank<r>.npz`` on rank ``r > 0``).
    restart_interval : int, optional
        Batch steps between checkpoint writes (default
        :data:`~nvalchemi_ase.dynamics.checkpoint.DEFAULT_RESTART_INTERVAL`).
    stop : callable, optional
        Polled after every batch step between refills; when it returns True
        the working batch writes its checkpoint (with ``restart``) and
        :class:`~nvalchemi_ase.runners.RunStopped` is raised.
    **optimizer_kwargs
        Passed to the optimizer class (``dt``, ``maxstep``, ``memory``, ...);
        ``device`` and ``dtype`` build the calculator when ``model`` is not one.

    Yields
    ------
    (int, ase.Atoms)
        Input index and a new ``Atoms``: final positions (and cell), a
        ``SinglePointCalculator`` with ``energy`` (eV), ``forces`` [N, 3]
        (eV/Å) and, when asked for, ``stress``; ``info`` ``converged`` (bool),
        ``steps`` (int: the structure's own steps; for a failure the step at
        which it failed), ``failure`` (None or the reason) and ``index``.

    Raises
    ------
    RunStopped
        When ``stop()`` returned True (its ``checkpoint`` is the file written).
    CheckpointError
        If ``restart`` exists but does not match the inputs and arguments.
    """
    if not fmax > 0:
        raise ValueError(f"fmax must be positive (eV/Å), got {fmax}")
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    if restart_interval is not None and not restart_interval >= 1:
        raise ValueError(
            f"restart_interval must be >= 1 (batch steps), got {restart_interval}"
        )
    if refill_steps is not None and not refill_steps >= 0:
        raise ValueError(f"refill_steps must be >= 0 (batch steps), got {refill_steps}")
    device = optimizer_kwargs.pop("device", None)
    dtype = optimizer_kwargs.pop("dtype", None)
    for reserved in ("logfile", "model", "append_trajectory"):
        if reserved in optimizer_kwargs:
            raise TypeError(f"irelax() does not take {reserved}=")
    optimizer_class = _optimizer_class(optimizer)
    with opened_run(
        model,
        distributed=distributed,
        device=device,
        dtype=dtype,
        max_atoms=max_atoms,
        max_edges=max_edges,
        max_structures=max_structures,
        output=output,
        resume=resume or checkpoint_exists(restart),
        failures=failures,
        job=(
            "relax",
            {
                "optimizer": optimizer_class.__name__,
                "fmax": fmax,
                "steps": steps,
                "cell_filter": cell_filter,
                **optimizer_kwargs,
            },
            STRUCTURE_FIELDS,
        ),
    ) as run:
        checkpoint = (
            None
            if restart is None
            else WorkingBatchRestart(rank_path(restart, run.shard), restart_interval)
        )
        yield from _relaxed(
            run,
            structures,
            _Runner(
                run.calc,
                optimizer_class,
                optimizer_kwargs,
                fmax,
                steps,
                run.budget,
                cell_filter=cell_filter,
                stress="stress" in checked_properties(properties, run.calc),
                trajectory=trajectory,
                series=series,
                restart=checkpoint,
                stop=stop,
                refill_steps=(
                    _default_refill_steps(run.calc.model)
                    if refill_steps is None
                    else refill_steps
                ),
            ),
            progress,
        )
        if checkpoint is not None:
            checkpoint.written()  # every structure written: a file left is stale


def _relaxed(
    run: Run, structures: Iterable[Atoms], relaxation: _Runner, progress: bool | None
) -> Iterator[tuple[int, Atoms]]:
    """Run the working batch over this rank's structures, writing each result."""
    skin = relaxation.optimizer_kwargs.get("neighbor_skin")
    check_written_first(run, structures)  # a list: before any work
    queue = _Queue(
        _identified(run.shard.numbered(structures), run.sink),
        run.sink.done,
        run.budget,
        Admission(run.calc.model, skin),
        identify=relaxation.restart is not None,
    )
    bar = progress_bar(progress, "relax", structures, run)
    converged = failed = 0
    try:
        for index, atoms in relaxation.run(queue):
            run.sink.write(atoms)
            converged += bool(atoms.info["converged"])
            failed += atoms.info["failure"] is not None
            if bar is not None:
                bar.step(
                    f"converged {converged}, failed {failed}, "
                    f"in flight {relaxation.in_flight}"
                )
            yield index, atoms
    finally:
        relaxation.close()
        if bar is not None:
            bar.close()


def _check_inputs(
    restart: WorkingBatchRestart | None,
    slots: list[Slot],
    saved: npt.NDArray[Any] | None,
) -> None:
    """Refuse a checkpointed batch whose inputs are not those given now."""
    from nvalchemi_ase.dynamics.checkpoint import CheckpointError

    if saved is None or restart is None:
        return  # a file that predates job identities
    if any(slot.identity is None for slot in slots):
        return
    found = first_difference(saved, np.array([slot.identity for slot in slots]))
    if found is None:
        return
    row, fields = found
    raise CheckpointError(
        f"restart file {restart.path}: inputs[{slots[row].index}] is not the "
        "structure that run relaxed (it differs in "
        f"{', '.join(repr(f) for f in fields)}); continue with the inputs of the "
        "interrupted run, or start afresh: remove the file (on the command line: "
        "--overwrite) or give another restart path"
    )


def _identified(
    numbered: Iterable[tuple[int, Atoms]], sink: Any
) -> Iterator[tuple[int, Atoms]]:
    """Yield the inputs, each checked against its written result (``Sink.identify``)."""
    for index, atoms in numbered:
        sink.identify([index], [atoms])
        yield index, atoms


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
        One per input structure, in input order; with ``resume=True`` (or a
        ``restart`` file to continue from) those found in ``output`` are read
        back from it.
    """
    if checkpoint_exists(kwargs.get("restart")):
        kwargs["resume"] = True  # as irelax() implies
    inputs = CountedInputs(structures)
    return in_input_order(irelax(inputs, model, **kwargs), kwargs, inputs)


class _Queue:
    """Inputs read lazily, one ahead; skipped and refused ones sorted out.

    :meth:`peek` refuses a structure too large for the budget at once; the
    model's checks (:class:`Admission`) run in :meth:`admissible`, over all
    the structures a refill takes together.
    """

    def __init__(
        self,
        numbered: Iterable[tuple[int, Atoms]],
        skip: set[int],
        budget: Budget,
        admission: Admission,
        *,
        identify: bool = False,
    ) -> None:
        self._source = iter(numbered)
        self._identify = identify  # keep each input's digests (restart tags)
        self._skip = skip
        self._budget = budget
        self._admission = admission
        self._next: Slot | None = None
        self._pending: list[tuple[int, Atoms]] = []
        self.refused: list[tuple[Slot, str]] = []
        self.exhausted = False

    def peek(self) -> Slot | None:
        """Return the next admissible structure (refused ones go to ``refused``)."""
        while self._next is None and not self.exhausted:
            try:
                index, atoms = next(self._source)
            except StopIteration:
                self.exhausted = True
                break
            if index in self._skip:
                continue
            slot = self._slot(index, atoms)
            reason = self._budget.refusal(slot.cost)
            if reason is not None:  # the calculator's reason first, if it has one
                reason = self._admission(slot.atoms) or reason
                self.refused.append((slot, reason))
                continue
            self._next = slot
        return self._next

    @property
    def written(self) -> set[int]:
        """Input indices already written (skipped at admission)."""
        return self._skip

    def collect(self, indices: list[int]) -> list[Slot]:
        """Read the inputs up to the last of ``indices``; return theirs, in that order.

        Used to rebuild a checkpointed working batch: those structures are
        taken whether or not they are already written. Any other input read
        on the way that is not written yet is kept for the next admissions.
        """
        from nvalchemi_ase.dynamics.checkpoint import CheckpointError

        wanted = set(indices)
        found: dict[int, Slot] = {}
        while len(found) < len(wanted):
            try:
                index, atoms = next(self._source)
            except StopIteration:
                missing = sorted(wanted - set(found))
                raise CheckpointError(
                    f"the restart file holds input {missing[0]}, which the inputs "
                    "do not have; continue with the inputs of the interrupted "
                    "run, or remove the file to start afresh"
                ) from None
            if index in wanted:
                found[index] = self._slot(index, atoms)
            elif index not in self._skip:
                self._pending.append((index, atoms))
        if self._pending:
            self._source = itertools.chain(self._pending, self._source)
            self._pending = []
        return [found[index] for index in indices]

    def _slot(self, index: int, atoms: Atoms) -> Slot:
        working = atoms.copy()
        slot = Slot(index, working, self._budget.cost(working))
        if self._identify:
            slot.identity = structure_digests([atoms])[0]
        return slot

    def take(self) -> Slot:
        """Remove and return the structure :meth:`peek` showed."""
        slot = self.peek()
        if slot is None:
            raise IndexError("no structure left")
        self._next = None
        return slot

    def admissible(self, slots: list[Slot]) -> tuple[list[Slot], CheckedImages | None]:
        """Return the ``slots`` the model can run; the others go to ``refused``.

        Also their :class:`~nvalchemi_ase.convert.CheckedImages` when every
        one passed (their batch is built from it, without a second pass).
        """
        reasons, checked = self._admission.checked([slot.atoms for slot in slots])
        for slot, reason in zip(slots, reasons, strict=True):
            if reason is not None:
                self.refused.append((slot, reason))
        runnable = [
            slot for slot, reason in zip(slots, reasons, strict=True) if not reason
        ]
        return runnable, checked


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
        *,
        cell_filter: type | None = None,
        stress: bool = False,
        trajectory: str | None = None,
        series: dict[int, dict[str, npt.NDArray[np.float64]]] | None = None,
        restart: WorkingBatchRestart | None = None,
        stop: Callable[[], bool] | None = None,
        refill_steps: float = _REFILL_STEPS,
    ) -> None:
        self.refill_steps = float(refill_steps)
        self.calc = calc
        self.optimizer_class = optimizer_class
        self.optimizer_kwargs = optimizer_kwargs
        self.fmax = fmax
        self.steps = steps
        self.budget = budget
        self.cell_filter = cell_filter
        self.stress = stress
        self.trajectory = trajectory
        self.series = series
        self.slots: list[Slot] = []
        self.finished = np.zeros(0, dtype=bool)
        self.opt: Any = None
        self._run: Generator[bool, None, None] | None = None
        #: The batch was evaluated by an in-place refill (its first evaluation).
        self._evaluated = False
        self._survivors = 0
        self._sizes = np.zeros(0, dtype=np.int64)
        #: Each slot's own steps [B] (``Slot.steps`` is written when it finishes).
        self._steps = np.zeros(0, dtype=np.int64)
        #: Each slot's cost [B, 4] (``Slot.cost``).
        self._costs = np.zeros((0, 4))
        #: The admitted structures' checks, their batch built from them (or None).
        self._checked: CheckedImages | None = None
        self._idle = 0.0
        self.restart = restart
        self.stop = stop
        self._steps_since_checkpoint = 0
        #: A continued batch's first evaluation (the checkpoint's step, whose
        #: refill was judged before the checkpoint): True, or "drop" when
        #: structures written after the checkpoint must leave at once.
        self._continuing: bool | str = False
        #: Largest number of structures in flight so far.
        self.peak = 0

    @property
    def in_flight(self) -> int:
        """Structures in the working batch still moving."""
        return int((~self.finished).sum())

    def run(self, queue: _Queue) -> Iterator[tuple[int, Atoms]]:
        """Yield ``(index, result)`` for every input, in finish order."""
        if self.restart is not None and self.restart.exists():
            self._continue(queue, self.restart.tags())
            yield from self._advance_until_refill(queue)
        while True:
            admitted = self._admit(queue)
            yield from self._refused(queue)
            survivors = [
                s for s, d in zip(self.slots, self.finished, strict=True) if not d
            ]
            if not survivors and not admitted:
                return
            with naming_inputs([slot.index for slot in [*survivors, *admitted]]):
                self._rebuild(survivors, admitted)
            yield from self._advance_until_refill(queue)

    def close(self) -> None:
        """Stop the current optimizer run; close the trajectories in flight."""
        if self._run is not None:
            self._run.close()
            self._run = None
        for slot, done in zip(self.slots, self.finished, strict=True):
            if not done and slot.trajectory is not None:
                slot.trajectory.close()
                slot.trajectory = None

    # -- admission and rebuild --------------------------------------------------

    def _used(self) -> npt.NDArray[np.float64]:
        """(atoms, edges, bytes, structures) of the structures still moving."""
        return self._costs[~self.finished].sum(axis=0)

    def _admit(self, queue: _Queue) -> list[Slot]:
        used = self._used()
        if self.cell_filter is not None and used.any():
            return []  # variable cell: the whole batch finishes first
        admitted: list[Slot] = []
        self._checked = None
        checks = 0
        while True:  # again while refusals free room
            taken: list[Slot] = []
            while (slot := queue.peek()) is not None and (
                self.budget.fits(used, slot.cost)
                or (not admitted and not taken and not used.any())
            ):
                taken.append(queue.take())
                used = used + slot.cost
            if not taken:
                return admitted
            runnable, checked = queue.admissible(taken)
            admitted += runnable
            checks += 1
            if len(runnable) == len(taken):
                # one check that passed them all: their batch is built from it
                self._checked = checked if checks == 1 else None
                return admitted
            used = self._used() + sum((s.cost for s in admitted), np.zeros(4))

    def _refused(self, queue: _Queue) -> Iterator[tuple[int, Atoms]]:
        while queue.refused:
            slot, reason = queue.refused.pop(0)
            yield slot.index, failed_atoms(slot, reason, results=None)

    def _rebuild(self, survivors: list[Slot], admitted: list[Slot]) -> None:
        """Refill the working batch: the survivors go on, the admitted join.

        In place (:meth:`~nvalchemi_ase.dynamics.base.BatchedDynamics.resize`:
        one batch, one engine, the finished structures retired) whenever the
        optimizer allows it; otherwise (cell filters, constraints other than
        FixAtoms) a new optimizer over the survivors and the admitted
        structures, the survivors' run carried into it.
        """
        self._open_trajectories(admitted)
        if self.series is not None:
            for slot in admitted:
                slot.series = []
        keep = np.flatnonzero(~self.finished)
        steps = np.concatenate(
            [self._steps[keep], np.zeros(len(admitted), dtype=np.int64)]
        )
        if self.opt is not None and self.opt.resizable():
            self._resize(keep, survivors, admitted, steps)
        else:
            self._rebuild_optimizer(keep, survivors, admitted, steps)
        self._checked = None
        self._idle = 0.0  # batches' atoms frozen since this refill, summed

    def _open_trajectories(self, admitted: list[Slot]) -> None:
        """Give each admitted structure a fresh trajectory file (it starts here)."""
        if self.trajectory is None:
            return
        from ase.io.trajectory import Trajectory

        from nvalchemi_ase.dynamics.trajectory import expand_template

        for slot in admitted:
            path = Path(expand_template(self.trajectory, slot.index, "trajectory"))
            path.parent.mkdir(parents=True, exist_ok=True)
            slot.trajectory = Trajectory(path, "w")

    def _resize(
        self,
        keep: npt.NDArray[np.intp],
        survivors: list[Slot],
        admitted: list[Slot],
        steps: npt.NDArray[np.int64],
    ) -> None:
        """Retire the finished structures and admit new ones into the same run."""
        with quiet_failures():
            self.opt.resize(
                keep,
                [slot.atoms for slot in admitted],
                trajectories=(
                    None
                    if self.trajectory is None
                    else [slot.trajectory for slot in admitted]
                ),
                # _Queue.admissible checked them with this model: their batch
                # is built from that check when it passed them all at once
                checked=True if self._checked is None else self._checked,
            )
        live = self._run is not None
        self._adopt(
            slots=[*survivors, *admitted], survivors=len(survivors), steps=steps
        )
        # the resize evaluated the batch: a live run's next step is a step (a
        # new run's first yield is that evaluation, without a model call)
        self._evaluated = live

    def _rebuild_optimizer(
        self,
        keep: npt.NDArray[np.intp],
        survivors: list[Slot],
        admitted: list[Slot],
        steps: npt.NDArray[np.int64],
    ) -> None:
        """Build an optimizer over survivors + admitted; carry survivors' state."""
        previous = self.opt
        if self._run is not None:
            # survivors' positions for the new batch, which evaluates them anew;
            # the finished ones were written (with results) when they finished
            previous.sync_structures(np.ones(len(self.slots), bool), results=False)
            self._run.close()
            self._run = None
        slots = [*survivors, *admitted]
        kwargs = dict(self.optimizer_kwargs)
        if self.trajectory is not None:
            kwargs["trajectory"] = [slot.trajectory for slot in slots]
        self._start(slots, kwargs, survivors=len(survivors), steps=steps)
        if previous is not None:
            self.opt.batch_run.carry_from(previous.batch_run, keep, len(admitted))

    def _start(
        self,
        slots: list[Slot],
        kwargs: dict[str, Any],
        *,
        survivors: int,
        finished: npt.NDArray[np.bool_] | None = None,
        restart: Path | None = None,
        steps: npt.NDArray[np.int64] | None = None,
    ) -> None:
        """Build the optimizer over ``slots`` and the generator that runs it.

        ``survivors``: how many leading slots the first evaluation does not
        step (a continued batch: all of them); ``restart``: the checkpoint the
        optimizer continues from (it writes none itself: the runner does);
        ``steps``: each slot's steps (default: ``Slot.steps``).
        """
        images = [
            slot.atoms if self.cell_filter is None else self.cell_filter(slot.atoms)
            for slot in slots
        ]
        with (
            quiet_failures(),
            naming_inputs([slot.index for slot in slots]),
            inputs_checked_by_caller(),  # hook: the runner checks its inputs
        ):
            opt = self.optimizer_class(
                images,
                logfile=None,
                progress=False,
                restart=restart,
                model=self.calc.model,
                device=self.calc.device,
                dtype=self.calc.dtype,
                **kwargs,
            )
        opt.restart = None  # the runner writes its checkpoints itself
        self.opt = opt
        self._run = None
        self._adopt(slots, survivors=survivors, finished=finished, steps=steps)

    def _adopt(
        self,
        slots: list[Slot],
        *,
        survivors: int,
        finished: npt.NDArray[np.bool_] | None = None,
        steps: npt.NDArray[np.int64] | None = None,
    ) -> None:
        """Take ``slots`` as the working batch; start the optimizer's run if none.

        ``steps``: each slot's steps so far (default: ``Slot.steps``).
        """
        self.slots = slots
        self._survivors = survivors
        self._costs = np.array([slot.cost for slot in slots]).reshape(-1, 4)
        self._sizes = self._costs[:, 0].astype(np.int64)
        self._steps = (
            np.array([slot.steps for slot in slots], dtype=np.int64)
            if steps is None
            else steps
        )
        self.finished = (
            np.zeros(len(slots), dtype=bool) if finished is None else finished
        )
        self.peak = max(self.peak, len(slots))
        self._evaluated = False
        if self._run is None:
            self._run = self.opt.irun(self.fmax, NO_LIMIT, sync_atoms=False)

    # -- checkpoint (restart=) and stop ----------------------------------------------

    def _checkpoint_or_stop(self, *, stepped: bool) -> None:
        """Write the periodic checkpoint when due; stop when ``stop()`` asks.

        Called between refills only, when the batch is what the next step runs.
        """
        if self.restart is not None and stepped:
            self._steps_since_checkpoint += 1
            if self._steps_since_checkpoint >= self.restart.every:
                self._write_checkpoint(self.restart)
        if self.stop is None or not self.stop():
            return
        checkpoint = None
        if self.restart is not None:
            self._write_checkpoint(self.restart)
            checkpoint = self.restart.path
        raise RunStopped(
            int(self.opt.nsteps),
            checkpoint,
            [s.index for s, d in zip(self.slots, self.finished, strict=True) if not d],
        )

    def _write_checkpoint(self, restart: WorkingBatchRestart) -> None:
        restart.write(self.opt, self._tags())
        self._steps_since_checkpoint = 0

    def _tags(self) -> dict[str, npt.NDArray[Any]]:
        """Return the runner's bookkeeping of every structure in the batch."""
        series = [slot.series for slot in self.slots]
        tags = {
            INDICES_TAG: np.array([s.index for s in self.slots], dtype=np.int64),
            STEPS_TAG: self._steps.copy(),
            FINISHED_TAG: self.finished.copy(),
            IDLE_TAG: np.asarray(self._idle, dtype=np.float64),
            FRAMES_TAG: np.array(
                [-1 if s.trajectory is None else len(s.trajectory) for s in self.slots],
                dtype=np.int64,
            ),
        }
        if all(slot.identity is not None for slot in self.slots):  # hook: identity
            tags[IDENTITY_TAG] = np.array([slot.identity for slot in self.slots])
        if self.series is not None:
            tags[SERIES_LENGTHS_TAG] = np.array(
                [-1 if rows is None else len(rows) for rows in series], dtype=np.int64
            )
            rows = [row for rows in series if rows for row in rows]
            tags[SERIES_TAG] = np.array(rows, dtype=np.float64).reshape(-1, 2)
        return tags

    def _continue(self, queue: _Queue, tags: dict[str, npt.NDArray[Any]]) -> None:
        """Rebuild the checkpointed working batch; its optimizer continues the file."""
        from ase.io.trajectory import Trajectory

        from nvalchemi_ase.dynamics.trajectory import expand_template, truncate

        indices = [int(i) for i in tags[INDICES_TAG]]
        slots = queue.collect(indices)
        _check_inputs(self.restart, slots, tags.get(IDENTITY_TAG))  # hook: identity
        finished = tags[FINISHED_TAG].astype(bool)
        written = np.array([slot.index in queue.written for slot in slots])
        kwargs = dict(self.optimizer_kwargs)
        lengths = tags.get(SERIES_LENGTHS_TAG)
        rows = iter(tags.get(SERIES_TAG, np.zeros((0, 2))))
        for position, slot in enumerate(slots):
            slot.steps = int(tags[STEPS_TAG][position])
            if lengths is not None and lengths[position] >= 0:
                slot.series = [
                    (float(e), float(f))
                    for e, f in itertools.islice(rows, int(lengths[position]))
                ]
        if self.trajectory is not None:
            frames = tags[FRAMES_TAG]
            for position, slot in enumerate(slots):
                path = Path(expand_template(self.trajectory, slot.index, "trajectory"))
                if frames[position] >= 0 and not written[position]:
                    truncate(path, int(frames[position]))  # frames after it repeat
                    slot.trajectory = Trajectory(path, "a")
            kwargs["trajectory"] = [
                slot.trajectory if slot.trajectory is not None else _Discard()
                for slot in slots
            ]
        assert self.restart is not None  # noqa: S101 - called only with one
        self._start(
            slots,
            kwargs,
            survivors=len(slots),  # the first evaluation steps nobody
            finished=finished | written,
            restart=self.restart.path,
        )
        self._stop_evaluating(finished | written)
        self._continuing = "drop" if (written & ~finished).any() else True
        self._idle = float(tags.get(IDLE_TAG, np.zeros(())))

    # -- stepping -----------------------------------------------------------------

    def _advance_until_refill(self, queue: _Queue) -> Iterator[tuple[int, Atoms]]:
        moving = np.ones(len(self.slots), dtype=bool)
        first = True
        while True:
            first_call = first
            with quiet_failures(), naming_inputs([s.index for s in self.slots]):
                if not (first and self._evaluated):  # a resize evaluated it
                    self._step()
                if first:  # the initial evaluation: step 0 of the admitted only
                    stepped = np.arange(len(self.slots)) >= self._survivors
                else:
                    stepped = moving
                    self._steps[moving] += 1
                first = False
                if self.series is not None:
                    self._record(stepped)
                converged = self.opt.converged_mask
                failed = self.opt.failed_mask
                limit = self._steps >= self.steps
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
            self._checkpoint_or_stop(stepped=not first_call)

    def _step(self) -> None:
        """One optimizer step (the first call: the initial evaluation)."""
        try:
            next(self._run)  # type: ignore[arg-type]
        except StopIteration:
            self._run = None

    def _record(self, stepped: npt.NDArray[np.bool_]) -> None:
        """Append this step's energy per atom and fmax of the structures that moved."""
        energy = self.opt.energy_per_structure
        fmax = self.opt.fmax_per_structure
        for position in np.flatnonzero(stepped):
            slot = self.slots[position]
            if slot.series is not None:
                slot.series.append(
                    (float(energy[position]) / len(slot.atoms), float(fmax[position]))
                )

    def _refill_due(self, queue: _Queue, at_limit: npt.NDArray[np.bool_]) -> bool:
        """Whether to rebuild now: see the module docstring's refill policy."""
        if self._continuing:
            continuing, self._continuing = self._continuing, False
            return continuing == "drop"
        if not self.finished.any():
            return False
        if not (~self.finished).any():
            return True
        if self.cell_filter is not None:
            return False  # the batch finishes together (same step limit)
        if (at_limit & ~self.opt.failed_mask).any():
            return True
        sizes = self._sizes
        self._idle += sizes[self.finished].sum() / sizes.sum()
        if self._idle < self.refill_steps:
            return False
        slot = queue.peek()
        return slot is None or self.budget.fits(self._used(), slot.cost)

    def _stop_evaluating(self, structures: npt.NDArray[np.bool_]) -> None:
        """Empty the neighbour lists of finished ``structures`` [B] (results read).

        They stay in the batch, frozen, until the next refill; without
        neighbours the model spends next to nothing on them, so waiting for a
        refill costs less.
        """
        self.opt.batch_run.empty_neighbors(structures)

    def _finish(
        self,
        positions: npt.NDArray[np.intp],
        converged: npt.NDArray[np.bool_],
        failed: npt.NDArray[np.bool_],
    ) -> list[tuple[int, Atoms]]:
        ending = np.zeros(len(self.slots), dtype=bool)
        ending[positions] = True
        # written into new Atoms, the results: the working ones are not read again
        finals = self.opt.written_copies(ending)
        reasons = {f.index: f.reason for f in self.opt.failures}
        slots = [self.slots[position] for position in positions]
        for slot, steps in zip(slots, self._steps[positions].tolist(), strict=True):
            slot.steps = steps
        results = final_values(
            self.calc,
            [atoms for atoms, _ in finals],
            failed[positions],
            stress=self.stress,
            results=[given for _, given in finals],
        )
        self.finished[positions] = True
        self._stop_evaluating(ending)
        done = []
        for position, slot, result, (final, _) in zip(
            positions, slots, results, finals, strict=True
        ):
            if slot.trajectory is not None:
                slot.trajectory.close()
                slot.trajectory = None
            if self.series is not None and slot.series is not None:
                values = np.array(slot.series, dtype=np.float64).reshape(-1, 2)
                self.series[slot.index] = {
                    "epot_per_atom": values[:, 0],
                    "fmax": values[:, 1],
                }
                slot.series = None
            if failed[position]:
                atoms = failed_atoms(
                    slot, reasons.get(position, "failed"), result, atoms=final
                )
            else:
                atoms = result_atoms(
                    slot, result, converged=bool(converged[position]), atoms=final
                )
            done.append((slot.index, atoms))
        return done


class _Discard:
    """A trajectory target that is never written: a continued batch's finished slots.

    Their files are complete; an optimizer writes no frame to a structure
    that converged or failed, nor frame 0 into a target that has frames.
    """

    def __len__(self) -> int:
        return 1

    def write(self, atoms: Any) -> None:
        raise RuntimeError("a finished structure's trajectory is complete")

    def set_description(self, description: Any) -> None:
        pass

    def close(self) -> None:
        pass


def _default_refill_steps(model: Any) -> float:
    """``refill_steps`` for ``model``: see :func:`irelax`."""
    if "forces" in model.model_config.autograd_outputs:
        return _REFILL_STEPS_AUTOGRAD
    return _REFILL_STEPS


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
