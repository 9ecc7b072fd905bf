"""The ASE ``Dynamics`` contract over one batched nvalchemi engine.

:class:`BatchedDynamics` is what ``nvalchemi_ase.md`` and ``nvalchemi_ase.optimize``
classes share. It is an ``ase.optimize.optimize.BaseDynamics`` (so ``attach``,
``insert_observer``, ``observers``, ``call_observers``, ``nsteps``,
``get_number_of_steps`` and the context-manager behaviour are ASE's own code)
whose ``step`` advances B structures at once on an nvalchemi engine.

State lives in the engine's ``Batch`` while the run goes on; it is copied into
the user's ``Atoms`` (positions, momenta for MD, cell, and the calculator
results) only when something reads them: a due observer, a trajectory frame,
the end of a run, or — under :meth:`irun` — every yield, because the caller may
look at the structures between steps. Changes the caller makes to the
structures between runs are picked up when the next run starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import torch
from ase import Atoms
from ase.optimize.optimize import BaseDynamics as AseBaseDynamics

from nvalchemi_ase import devices
from nvalchemi_ase._compat import promises_noop_post_update
from nvalchemi_ase._quiet import import_quietly
from nvalchemi_ase.convert import (
    FROZEN_CATEGORY,
    CheckedImages,
    atoms_to_batch,
    batch_from_checked,
    check_images,
    update_atoms,
)
from nvalchemi_ase.devices import DtypeLike
from nvalchemi_ase.dynamics.checkpoint import (
    DEFAULT_RESTART_INTERVAL,
    Checkpoint,
    capture,
    check_matches,
    read_checkpoint,
    write_checkpoint,
)
from nvalchemi_ase.dynamics.constraints import BatchConstraints
from nvalchemi_ase.dynamics.driver import freeze_hook
from nvalchemi_ase.dynamics.failures import (
    DynamicsFailureError,
    FailureGuard,
    FailureLimits,
    OnFailure,
    StructureFailure,
    resolve_on_failure,
    warn_failures,
)
from nvalchemi_ase.dynamics.hooks import StageHook
from nvalchemi_ase.dynamics.images import (
    CellFilterSpec,
    check_constraints,
    integer_argument,
    resolve_images,
    resolve_model_setup,
)
from nvalchemi_ase.dynamics.job import start_job
from nvalchemi_ase.dynamics.logs import internal, log_paths
from nvalchemi_ase.dynamics.neighbors import is_neighbor_hook, neighbor_hooks
from nvalchemi_ase.dynamics.observers import (
    StageObserverHook,
    is_due,
    is_nvalchemi_hook,
)
from nvalchemi_ase.dynamics.progress import ProgressBar, progress_enabled
from nvalchemi_ase.dynamics.raw_results import RawResults, SaveHook
from nvalchemi_ase.dynamics.run import BatchRun, atom_rows
from nvalchemi_ase.dynamics.trajectory import TrajectorySet
from nvalchemi_ase.models.locks import model_lock
from nvalchemi_ase.typing import (
    DeviceLike,
    ImagesLike,
    LogfileLike,
    ModelLike,
    TrajectoryLike,
)
from nvalchemi_ase.units import kinetic_temperature_K

if TYPE_CHECKING:
    from nvalchemi.data import Batch
    from nvalchemi.dynamics.base import BaseDynamics as EngineType
    from nvalchemi.models.base import BaseModelMixin

__all__ = ["DEFAULT_SKIN", "BatchedDynamics"]

#: Default Verlet skin of the neighbour list in dynamics, Å. The list is built to
#: ``cutoff + skin`` and rebuilt only when an atom has moved more than half of
#: it; without a skin the list is 56-78 % of a CPU step (measured with
#: nvalchemi 0.3 LJ on 1-32 argon cells of 108 atoms, 2 CPU cores).
DEFAULT_SKIN = 1.0


class BatchedDynamics(AseBaseDynamics):
    """ASE ``BaseDynamics`` stepping B structures at once on an nvalchemi engine.

    Parameters
    ----------
    images : ase.Atoms or sequence of ase.Atoms
        The structures (any sizes; periodic or not, mixed). Optimizers also take
        ``FrechetCellFilter``/``UnitCellFilter`` objects.
    logfile : file, str, path or None
        As in ASE (``"-"`` is stdout). For several structures a path template
        with ``{i}`` writes ASE's own log per structure; anything else gets a
        one-line-per-step summary of the batch.
    trajectory : str, path, Trajectory, sequence of them, or None
        One trajectory per structure: a template with ``{i}``, a list, or (one
        structure) a single path or ``Trajectory``.
    loginterval : int
        Write a trajectory frame (and, for MD, a log line) every ``loginterval``
        steps, as in ASE.
    append_trajectory : bool
        Append to existing trajectory files instead of replacing them.
    model : BaseModelMixin or str, optional
        The nvalchemi model; by default the one wrapped by the
        ``NVAlchemiCalculator`` attached to the structures.
    device : torch.device or str, optional
        Default: the calculator's device, else CUDA when available.
    dtype : torch.dtype or str, optional
        Default: the calculator's dtype, else the model's weight dtype, else
        float64.
    neighbor_skin : float, optional
        Verlet skin of the neighbour list, Å (default :data:`DEFAULT_SKIN`;
        variable-cell runs use 0).
    progress : bool or None
        Draw a progress bar on standard error (steps, rate, structures
        converged); None draws one only when standard error is a terminal.
    on_failure : {"isolate", "raise"}
        ``"isolate"`` (default): a structure whose state becomes non-finite or
        crosses ``failure_limits`` stops, keeps its last finite state (in its
        ``Atoms`` and trajectory) and is listed in :attr:`failures`, while the
        others go on; ``"raise"``: raise
        :class:`~nvalchemi_ase.dynamics.failures.DynamicsFailureError` instead.
    failure_limits : FailureLimits, optional
        Largest force (eV/Å), largest displacement per step (Å) and largest
        volume factor before a structure counts as exploded (defaults in
        :class:`~nvalchemi_ase.dynamics.failures.FailureLimits`).
    restart : str or path, optional
        Checkpoint file (ASE's ``restart``). If it exists, the run continues
        from it: structures, velocities, cells, the engine's per-structure
        state, neighbour lists, failure flags and ``nsteps``, so the continued
        run is bit-identical to an uninterrupted one; a file written for other
        structures, another class, model or arguments is refused
        (:class:`~nvalchemi_ase.dynamics.checkpoint.CheckpointError`). Either
        way it is (re)written every ``restart_interval`` steps and at the end
        of every ``run()``. Format: :mod:`nvalchemi_ase.dynamics.checkpoint`.
        With ``append_trajectory=True`` a continued run writes no frame for
        the step it starts from (the earlier run wrote it), so the trajectory
        holds the frames of one uninterrupted run (ASE's MD restarted from
        its last frame writes that frame twice); frames a killed run wrote
        after its last checkpoint are cut from the files first (each ``.traj``
        file is rewritten with the frames the checkpoint counted). Log files
        given by path continue the same way: no header again, and lines
        logged after the checkpoint cut (the file is truncated to its size
        at the checkpoint).
    restart_interval : int, optional
        Steps between checkpoint writes (default
        :data:`~nvalchemi_ase.dynamics.checkpoint.DEFAULT_RESTART_INTERVAL`,
        100; ASE writes every step, ``restart_interval=1``).
    """

    #: Engine protocol: whether structures may be given as cell filters.
    accepts_cell_filters = False
    #: Whether the engine's velocities are physical (MD) and go to momenta.
    velocities_are_momenta = True
    #: Engine protocol: whether the engine keeps every per-structure quantity
    #: in nvalchemi's state (``_sync_state_to_batch`` resizes it), so that
    #: :meth:`resize` may change the structures in place.
    resizes_in_place = False
    #: Frames in the trajectory files when a continued run started (restart=).
    _trajectory_frames0: npt.NDArray[np.int64] | None

    def __init__(
        self,
        images: ImagesLike,
        logfile: LogfileLike = None,
        trajectory: TrajectoryLike = None,
        loginterval: int = 1,
        *,
        append_trajectory: bool = False,
        model: ModelLike | None = None,
        device: DeviceLike = None,
        dtype: DtypeLike = None,
        neighbor_skin: float | None = None,
        progress: bool | None = False,
        on_failure: OnFailure = "isolate",
        failure_limits: FailureLimits | None = None,
        restart: str | os.PathLike[str] | None = None,
        restart_interval: int | None = None,
    ) -> None:
        self.on_failure: OnFailure = resolve_on_failure(on_failure)
        if failure_limits is not None and not isinstance(failure_limits, FailureLimits):
            raise TypeError(
                "failure_limits must be a nvalchemi_ase.dynamics.failures."
                f"FailureLimits, got {type(failure_limits).__name__}"
            )
        # a restart file that cannot be used is named first, as ASE does
        checkpoint = (
            read_checkpoint(restart)
            if restart is not None and os.path.exists(restart)
            else None
        )
        atoms_list, cell_filter, single = resolve_images(
            images, allow_cell_filters=self.accepts_cell_filters
        )
        check_constraints(atoms_list)
        self.images: list[Atoms] = atoms_list
        self.cell_filter: CellFilterSpec | None = cell_filter
        skin = self.default_skin() if neighbor_skin is None else float(neighbor_skin)
        # the structures are checked against the model as the batch is built
        self.setup = resolve_model_setup(
            atoms_list, model, device, dtype, neighbor_skin=skin, check=False
        )
        self.neighbor_skin = skin
        self._check_inputs()
        super().__init__(
            atoms=images if single else atoms_list,  # type: ignore[arg-type]
            logfile=None,
            trajectory=None,
            loginterval=loginterval,
        )
        self.loginterval = loginterval
        self.progress = progress_enabled(progress)
        self._bar: ProgressBar | None = None
        batch = self._initial_batch()
        self._hook_nsteps = 0
        #: The working batch, its engine, failure guard and neighbour lists.
        self.batch_run = BatchRun(
            batch,
            FailureGuard(
                batch,
                failure_limits or self.default_failure_limits(),
                ase_step=lambda: self._hook_nsteps,
            ),
        )
        self._failures: list[StructureFailure] = []
        self._frame_steps = np.full(len(atoms_list), -1)
        self._positions_at_write = self.batch.positions.detach().clone()
        self._cell_at_write = self.batch.cell.detach().clone()
        self.batch_run.attach_engine(
            self.build_engine(self._builtin_hooks(skin)),
            neighbor_hooks=lambda: neighbor_hooks(self.model, self.neighbor_skin),
        )
        # engines that read stress (barostats, cell filters) move cells
        self._guard.variable_cell = "stress" in self.engine_outputs()
        self._changes_key: tuple[Any, ...] = ()
        self._changes: tuple[str, ...] | None = None
        self._guard.changes_after_compute = self._changes_after_compute
        self._stage_hooks: dict[Any, StageObserverHook] = {}
        self._pending_checkpoint: Checkpoint | None = None
        self._synced_nsteps: int | None = None
        #: True while ``run``/``irun`` calls :meth:`step` (False: the user does).
        self._run_is_stepping = False
        #: ``nsteps`` at which each structure was last written back (-1: never).
        self._written_at = np.full(len(atoms_list), -1)
        self._written = self._snapshot_atoms()
        self._constraints_written = _constraint_state(self.images)
        self.trajectories = TrajectorySet(
            trajectory,
            len(atoms_list),
            append=append_trajectory,
            description=lambda: self.todict() | {"interval": loginterval},
        )
        if self.trajectories:
            self.attach(
                internal(self._write_trajectories, needs_stress=True),
                interval=loginterval,
            )
        #: Log files this object appends to; a continued run cuts them back
        #: to their size at the checkpoint and writes no header again.
        self._log_paths = log_paths(logfile, len(atoms_list))
        #: Continued from a checkpoint (``restart=`` names an existing file;
        #: a file that does not match is refused before this object exists).
        self._continued = checkpoint is not None
        self._setup_logging(logfile)
        self._setup_restart(restart, restart_interval, checkpoint)

    # ------------------------------------------------------------------
    # Engine protocol: what an md/ or optimize/ class tells the run machinery
    # ------------------------------------------------------------------

    def build_engine(self, hooks: list[Any]) -> EngineType:
        """Build this class's nvalchemi engine with ``hooks`` registered.

        The one method every ASE-style class implements. It is called once per
        dynamics object (nvalchemi sizes engine state on the first batch), and
        again by compositions such as :class:`~nvalchemi_ase.compose.RelaxThenMD`
        with their own hooks.

        Parameters
        ----------
        hooks : list
            nvalchemi hooks to register (failure guard, neighbour list, frozen
            atoms), in that order, before any the user attaches.

        Returns
        -------
        nvalchemi.dynamics.base.BaseDynamics
            The engine; its time step in fs, temperatures in K (nvalchemi's
            kB), pressures in eV/Å³ (convert with :mod:`nvalchemi_ase.units`).
        """
        raise NotImplementedError

    def _setup_logging(self, logfile: Any) -> None:
        """Attach the log writers (subclasses)."""

    def _check_inputs(self) -> None:
        """Validate arguments against the structures before any work (subclasses)."""

    def engine_outputs(self) -> set[str]:
        """Model outputs every engine step needs (``stress`` for barostats).

        Returns
        -------
        set of str
            nvalchemi output names; engines that read ``stress`` are taken to
            move cells.
        """
        needs = set(getattr(self.engine, "__needs_keys__", ()))
        return {"energy", "forces"} | (needs & {"stress"})

    def default_skin(self) -> float:
        """Verlet skin of the neighbour list when none is given, Å."""
        return DEFAULT_SKIN

    def default_failure_limits(self) -> FailureLimits:
        """Failure limits when ``failure_limits`` is not given (engine protocol).

        Returns
        -------
        FailureLimits
            :class:`~nvalchemi_ase.dynamics.failures.FailureLimits`' defaults;
            optimizers widen them to the steps their own algorithm takes.
        """
        return FailureLimits()

    def _engine_freezes_atoms(self) -> bool:
        """Whether the engine keeps frozen atoms itself (no ``FreezeAtomsHook``)."""
        return False

    def _post_update_writes(self) -> tuple[str, ...] | None:
        """Batch fields the engine's ``post_update`` writes (None: unknown, any).

        Nothing for engines that promise a no-op ``post_update`` (this
        package's optimizers); a class that knows its engine says more.
        """
        return () if promises_noop_post_update(self.engine) else None

    def _after_priming(self) -> None:
        """Adjust the engine's fresh state before the first step (subclasses)."""

    def _progress_note(self) -> str | None:
        """Text shown after the progress bar (optimizers: structures converged)."""
        return None

    def _momenta_mask(self) -> bool | npt.NDArray[np.bool_]:
        """Which structures' velocities are physical momenta to write back."""
        return self.velocities_are_momenta

    def _writeback_rotation(self) -> npt.NDArray[np.float64] | None:
        """Rotations (B, 3, 3) taking the batch's frame to the user's, or None."""
        return None

    # ------------------------------------------------------------------
    # Public ASE-style API
    # ------------------------------------------------------------------

    @property
    def model(self) -> BaseModelMixin:
        """The nvalchemi model every structure is evaluated with."""
        return self.setup.model

    @property
    def batch(self) -> Batch:
        """The nvalchemi ``Batch`` the engine evolves in place (graph i: images[i])."""
        return self.batch_run.batch

    @property
    def engine(self) -> EngineType:
        """The nvalchemi engine (``BaseDynamics``) stepping :attr:`batch`."""
        return self.batch_run.engine

    @property
    def stress_step(self) -> int:
        """The ASE step whose evaluation computed the batch's stress (-1: none)."""
        return self.batch_run.stress_step

    @property
    def _guard(self) -> FailureGuard:
        return self.batch_run.guard

    @property
    def _primed(self) -> bool:
        return self.batch_run.primed

    @_primed.setter
    def _primed(self, value: bool) -> None:
        self.batch_run.primed = value

    @property
    def failures(self) -> list[StructureFailure]:
        """Every structure that failed so far: index, ASE step and reason (a copy)."""
        self._absorb_failures(raise_now=False)
        return list(self._failures)

    @property
    def failed_mask(self) -> npt.NDArray[np.bool_]:
        """Which structures failed and stopped, shape (B,) (a copy)."""
        self._absorb_failures(raise_now=False)
        return self._guard.known_mask

    def attach(
        self, function: Any, interval: int = 1, *args: Any, **kwargs: Any
    ) -> None:
        """Attach an observer, exactly as ASE's ``attach`` (or an nvalchemi hook).

        Parameters
        ----------
        function : callable, object with ``write``, or nvalchemi ``Hook``
            ASE-style callables are called as ``function(*args, **kwargs)`` after
            the steps where ASE would call them, with the ``Atoms`` updated to
            that step. An object following nvalchemi's ``Hook`` protocol (has
            ``stage`` and ``frequency``) is registered on the engine instead and
            runs natively at its stage with a ``DynamicsContext``.
        interval : int
            ASE's interval: every ``interval`` steps if positive (including step
            0), only at step ``|interval|`` otherwise. Ignored for nvalchemi
            hooks, which keep their own ``frequency``.
        *args, **kwargs
            Passed to ``function``.
        """
        if is_nvalchemi_hook(function):
            self.engine.register_hook(self._guard.routed(function))  # failures
            return
        super().attach(function, interval, *args, **kwargs)

    def insert_observer(
        self,
        function: Any,
        position: int = 0,
        interval: int = 1,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        """Insert an observer at ``position`` in ``observers`` (ASE's semantics).

        Parameters
        ----------
        function : callable or object with ``write``
            The observer.
        position : int
            Index in the observer list (observers run in list order).
        interval : int
            ASE's interval rule (see :meth:`attach`).
        *args, **kwargs
            Passed to ``function``.
        """
        if is_nvalchemi_hook(function):
            self.engine.register_hook(self._guard.routed(function))  # failures
            return
        super().insert_observer(function, position, interval, *args, **kwargs)

    def attach_at(
        self, stage: Any, function: Any, interval: int = 1, *args: Any, **kwargs: Any
    ) -> None:
        """Attach an ASE-style observer at any nvalchemi ``DynamicsStage``.

        Parameters
        ----------
        stage : DynamicsStage or str
            E.g. ``DynamicsStage.AFTER_COMPUTE`` or ``"AFTER_COMPUTE"``.
        function : callable or object with ``write``
            Called as ``function(*args, **kwargs)`` with the ``Atoms`` updated to
            the batch as it is at that stage.
        interval : int
            ASE's interval rule, applied to the ASE step the stage belongs to
            (the initial evaluation and ``ON_ADMISSION`` belong to step 0).
        *args, **kwargs
            Passed to ``function``.
        """
        stages = import_quietly("nvalchemi.dynamics.base").DynamicsStage
        resolved = stages[stage] if isinstance(stage, str) else stages(stage)
        if not callable(function):
            function = function.write
        hook = self._stage_hooks.get(resolved)
        if hook is None:
            hook = StageObserverHook(
                resolved, ase_step=lambda: self._hook_nsteps, sync_atoms=self.sync_atoms
            )
            self._stage_hooks[resolved] = hook
            self.engine.register_hook(hook)
        hook.observers.append((function, interval, args, kwargs))

    def resizable(self) -> bool:
        """Whether :meth:`resize` can change this object's structures in place.

        Not under a cell filter, with ASE constraints other than ``FixAtoms``,
        or with one log file per structure: their per-structure hooks and
        files are sized at construction; and only for classes whose engine
        keeps all its per-structure state in nvalchemi's resizable state
        (``resizes_in_place``: the optimizers, velocity Verlet and the NVT
        thermostats, whose per-structure arguments follow the structures).
        """
        return (
            self.resizes_in_place
            and self.cell_filter is None
            and not self._constraints.any
            and len(self._log_paths) <= 1
        )

    def resize(
        self,
        keep: npt.ArrayLike,
        images: list[Atoms],
        *,
        trajectories: list[Any] | None = None,
        checked: bool | CheckedImages = False,
    ) -> None:
        """Keep the structures ``keep`` (in that order) and append ``images``, in place.

        Between the steps of a run (or between runs): the structures that
        stay go on exactly as they would have (the engine, its per-structure
        state, neighbour lists, failure flags, velocities and model outputs
        stay, in place, see :meth:`~nvalchemi_ase.dynamics.run.BatchRun.resize`);
        the new ones are checked, evaluated once (alone, where the others'
        outputs are current) and start at their own step 0, a frame of which
        goes to their trajectories. The structures
        that leave are not written back: write them first
        (:meth:`sync_structures`). ``nsteps`` goes on counting.

        Parameters
        ----------
        keep : array of int
            Indices into :attr:`images` of the structures that stay.
        images : list of ase.Atoms
            The structures to admit (no cell filters; ``FixAtoms`` only).
        trajectories : list of path or Trajectory, optional
            One per admitted structure; required when this object writes
            trajectories.
        checked : bool or CheckedImages
            The caller has already run :func:`~nvalchemi_ase.convert.check_images`
            on ``images`` with this object's model and neighbour skin (the
            runners do, for all a refill admits); not again here. What that
            call returned (for these very ``images``) also builds their batch,
            without converting them again
            (:func:`~nvalchemi_ase.convert.batch_from_checked`).

        Raises
        ------
        ValueError
            If this object is not :meth:`resizable`, or an admitted structure
            cannot be run (named by its position in ``images``).
        """
        if not self.resizable():
            raise ValueError(
                f"{type(self).__name__}.resize: structures under a cell filter, with "
                "constraints other than FixAtoms, or with a log file each are sized "
                "at construction; create a new object instead"
            )
        kept = np.asarray(keep, dtype=np.intp).reshape(-1)
        arrivals, _, _ = (
            resolve_images(images, allow_cell_filters=False)
            if images
            else ([], None, False)
        )
        check_constraints(arrivals)
        names = {type(c).__name__ for atoms in arrivals for c in atoms.constraints}
        if names - {"FixAtoms"}:
            raise ValueError(
                "resize admits structures with FixAtoms constraints only; create a "
                "new object for others"
            )
        prechecked = (
            checked
            if isinstance(checked, CheckedImages) and checked.holds(arrivals)
            else None
        )
        if arrivals and not (checked is True or prechecked is not None):
            check_images(arrivals, model=self.model, skin=self.neighbor_skin)
        if bool(self.trajectories) and (
            trajectories is None or len(trajectories) != len(arrivals)
        ):
            raise ValueError(
                "this object writes trajectories: give one per admitted structure"
            )
        self._absorb_failures(raise_now=False)  # flags read before renumbering
        old = self.batch
        rows = torch.as_tensor(kept, dtype=torch.long, device=old.device)
        kept_atoms = atom_rows(old, rows)
        at_write = (
            self._positions_at_write.index_select(0, kept_atoms),
            self._cell_at_write.index_select(0, rows),
        )
        raw = self._raw_results.select(old, kept_atoms, rows)
        fresh = self._batch_of(arrivals, checked=prechecked) if arrivals else None
        self.batch_run.resize(kept, fresh, fresh_engine=self._engine_for_resize())
        self._resize_mirror(kept, arrivals, at_write, trajectories or [])
        self._raw_results.carry(raw)
        self._prime_admitted(len(kept))

    def _engine_for_resize(self) -> Any:
        """Engine whose initial state gives the admitted structures' rows (or None).

        None: the engine makes them itself (the optimizers and velocity
        Verlet, whose per-structure state does not depend on per-structure
        arguments). The MD classes with per-structure parameters build one
        for the resized batch (see
        :meth:`~nvalchemi_ase.md.md.BatchedMolecularDynamics.resize`).
        """
        return None

    def _resize_mirror(
        self,
        kept: npt.NDArray[np.intp],
        arrivals: list[Atoms],
        at_write: tuple[torch.Tensor, torch.Tensor],
        trajectories: list[Any],
    ) -> None:
        """Resize the per-structure host state to the batch (subclasses extend)."""
        count = len(kept) + len(arrivals)
        position = {int(old): new for new, old in enumerate(kept)}
        self.images = [self.images[k] for k in kept] + list(arrivals)
        self._failures = [
            dataclasses.replace(failure, index=position[failure.index])
            for failure in self._failures
            if failure.index in position
        ]

        def grown(values: npt.NDArray[Any], fill: Any) -> npt.NDArray[Any]:
            result = np.full(count, fill, dtype=values.dtype)
            result[: len(kept)] = values[kept]
            return result

        self._frame_steps = grown(self._frame_steps, -1)
        self._written_at = grown(self._written_at, -1)
        batch = self.batch
        with torch.no_grad():
            self._positions_at_write = batch.positions.detach().clone()
            self._positions_at_write[: at_write[0].shape[0]] = at_write[0]
            self._cell_at_write = batch.cell.detach().clone()
            self._cell_at_write[: len(kept)] = at_write[1]
        self._written = [self._written[k] for k in kept] + [
            _snapshot(atoms) for atoms in arrivals
        ]
        self._constraints_written = _constraint_state(self.images)
        self._constraints = BatchConstraints(self.images, batch)
        frozen = bool((batch.atom_categories == FROZEN_CATEGORY).any())
        has_hook = any(_is_freeze_hook(hook) for hook in self.engine.hooks)
        if frozen and not has_hook and not self._engine_freezes_atoms():
            self.engine.register_hook(
                freeze_hook(zero_velocities=self.velocities_are_momenta)
            )
        self._configure_raw_results()
        if self.trajectories:
            self.trajectories = self.trajectories.resized(kept, trajectories)
        self._trajectory_frames0 = (
            self.trajectories.frame_counts()
            if self.restart is not None and self.trajectories
            else None
        )
        self._synced_nsteps = None

    def _prime_admitted(self, n_kept: int) -> None:
        """Evaluate the resized batch; write the admitted structures' first frames."""
        admitted = np.zeros(len(self.images), dtype=bool)
        admitted[n_kept:] = True
        frames = (
            admitted & self.trajectories.empty_mask()
            if self.trajectories
            else np.zeros_like(admitted)
        )
        opened = self.batch_run.open_hooks()
        try:
            self._prime(stress=bool(frames.any()))
        finally:
            if opened:
                self.batch_run.close_hooks()
        if frames.any():
            self._write_back(frames)
            self.trajectories.write(self.images, frames)
            self._frame_steps[frames] = self.nsteps

    def sync_atoms(self) -> None:
        """Copy the batch's current state and results into the user's ``Atoms``.

        Positions and cells are written only for structures that moved since
        the last write, so a structure that did not move keeps its exact
        float64 input. Failures recorded on the device are read back here.
        """
        self._absorb_failures(raise_now=False)
        self._write_back(np.ones(len(self.images), dtype=bool))
        self._synced_nsteps = self.nsteps
        self._absorb_failures()

    def sync_structures(
        self, selected: npt.NDArray[np.bool_], *, results: bool = True
    ) -> None:
        """Copy the state and results of the ``selected`` structures only.

        :meth:`sync_atoms` for a subset: the other ``Atoms`` are not touched
        (a runner writes back the structures that finished, not the whole
        batch). A structure written at the current step is not written again
        when the run ends (after ``results=False`` its calculator keeps the
        results it had).

        Parameters
        ----------
        selected : numpy.ndarray, shape (B,), bool
            The structures to write.
        results : bool
            Also give their calculators the batch's results (False: positions,
            cells and momenta only, for structures about to be evaluated anew).
        """
        selected = np.asarray(selected, dtype=bool)
        if selected.all() and results:
            self.sync_atoms()
            return
        self._absorb_failures(raise_now=False)
        self._write_back(selected, results=results)
        self._absorb_failures()

    def written_copies(
        self, selected: npt.NDArray[np.bool_]
    ) -> list[tuple[Atoms, dict[str, Any]]]:
        """Return copies of selected structures as :meth:`sync_structures` writes them.

        The batch's state is written into new ``Atoms`` (copies of those this
        object runs, which are not touched, nor its record of what it wrote):
        positions and cells only where they moved since the last write,
        momenta where :meth:`sync_structures` writes them. For structures
        leaving the run (a runner's finished ones), whose results are all that
        is read of them.

        Parameters
        ----------
        selected : numpy.ndarray, shape (B,), bool
            The structures to copy.

        Returns
        -------
        list of (ase.Atoms, dict)
            One per selected structure, in batch order: the copy (no
            calculator) and the results :meth:`sync_structures` would give its
            calculator (ASE keys: ``energy``, ``free_energy`` eV, ``forces``
            [N, 3] eV/Å, ``stress`` Voigt eV/Å³ when current).
        """
        keep = np.flatnonzero(np.asarray(selected, dtype=bool))
        self._absorb_failures(raise_now=False)
        copies = [self.images[k].copy() for k in keep]
        holders = [_ResultsHolder() for _ in copies]
        if copies:
            targets = list(self.images)
            for k, atoms, holder in zip(keep, copies, holders, strict=True):
                atoms.calc = holder
                targets[k] = atoms
            update_atoms(
                targets,
                self.batch,
                momenta=np.broadcast_to(self._momenta_mask(), selected.shape),
                stress=self.stress_step == self.nsteps,
                rotation=self._writeback_rotation(),
                positions=self._moved_since_write(keep),
                only=keep,
                outputs=self._raw_results.outputs(self.batch),
            )
            for atoms in copies:
                atoms.calc = None
        self._absorb_failures()
        return [(atoms, h.results) for atoms, h in zip(copies, holders, strict=True)]

    def _write_back(
        self,
        selected: npt.NDArray[np.bool_],
        *,
        results: bool = True,
        stress: bool | None = None,
    ) -> None:
        """Write the batch into the ``Atoms`` of the ``selected`` structures.

        ``stress``: whether the batch's stress is current (default: it was
        computed for step ``nsteps``).
        """
        keep = np.flatnonzero(selected)
        if not keep.size:
            return
        self._attach_calculators()
        moved = self._moved_since_write()
        rotation = self._writeback_rotation()
        every = keep.size == len(self.images)
        update_atoms(
            self.images,
            self.batch,
            results=results,
            momenta=np.broadcast_to(self._momenta_mask(), selected.shape),
            stress=self.stress_step == self.nsteps if stress is None else stress,
            rotation=rotation,
            positions=moved,
            only=None if every else keep,
            outputs=self._raw_results.outputs(self.batch),
        )
        self._written_at[keep] = self.nsteps
        with torch.no_grad():
            if every:
                self._positions_at_write.copy_(self.batch.positions)
                self._cell_at_write.copy_(self.batch.cell)
            else:  # the others keep their reference: they were not written
                chosen = torch.as_tensor(selected, device=self.batch.device)
                rows = chosen[self.batch.batch_idx.long()]
                self._positions_at_write[rows] = self.batch.positions[rows]
                self._cell_at_write[chosen] = self.batch.cell[chosen]
        if every:
            self._written = self._snapshot_atoms()
        else:
            for index in keep:
                self._written[index] = _snapshot(self.images[index])

    def _moved_since_write(
        self, only: npt.NDArray[np.intp] | None = None
    ) -> npt.NDArray[np.bool_]:
        """Which structures' positions or cell changed since the last write, (B,).

        ``only``: answer for these structures (the others: False), comparing
        their atoms' rows only instead of the whole batch's.
        """
        batch = self.batch
        if only is not None:
            return self._moved_among(only)
        with torch.no_grad():
            atom_moved = (batch.positions != self._positions_at_write).any(dim=1)
            moved = torch.zeros(batch.num_graphs, dtype=torch.long, device=batch.device)
            moved.index_add_(0, batch.batch_idx.long(), atom_moved.long())
            cell_moved = (
                (batch.cell != self._cell_at_write)
                .reshape(batch.num_graphs, -1)
                .any(dim=1)
            )
            return ((moved > 0) | cell_moved).cpu().numpy()

    def _moved_among(self, only: npt.NDArray[np.intp]) -> npt.NDArray[np.bool_]:
        """:meth:`_moved_since_write` for the structures ``only`` (others False)."""
        batch = self.batch
        graphs = torch.as_tensor(only, dtype=torch.long, device=batch.device)
        with torch.no_grad():
            rows = atom_rows(batch, graphs)
            atom_moved = (
                batch.positions.index_select(0, rows)
                != self._positions_at_write.index_select(0, rows)
            ).any(dim=1)
            moved = torch.zeros(batch.num_graphs, dtype=torch.long, device=batch.device)
            moved.index_add_(
                0, batch.batch_idx.index_select(0, rows).long(), atom_moved.long()
            )
            cell_moved = torch.zeros(
                batch.num_graphs, dtype=torch.bool, device=batch.device
            )
            cell_moved[graphs] = (
                (
                    batch.cell.index_select(0, graphs)
                    != self._cell_at_write.index_select(0, graphs)
                )
                .reshape(graphs.numel(), -1)
                .any(dim=1)
            )
            return ((moved > 0) | cell_moved).cpu().numpy()

    # ------------------------------------------------------------------
    # Failure isolation
    # ------------------------------------------------------------------

    def _absorb_failures(
        self,
        failed_host: npt.NDArray[np.bool_] | None = None,
        *,
        raise_now: bool = True,
    ) -> None:
        """Take in failures the device recorded: freeze, report, warn or raise."""
        fresh = self._guard.new_failures(failed_host)
        if fresh:
            self._failures = sorted(
                [*self._failures, *fresh], key=lambda failure: failure.index
            )
            self._freeze_failed()
            self._write_last_good_frames(fresh)
            if self.on_failure == "isolate":
                warn_failures(fresh, type(self).__name__)
        if raise_now and self.on_failure == "raise" and self._failures:
            raise DynamicsFailureError(self._failures)

    def _freeze_failed(self) -> None:
        """Stop failed structures with nvalchemi's ``status`` column."""
        frozen = self._failed_status()
        failed = self._guard.failed.view(-1, 1)
        with torch.no_grad():
            if "status" not in self.batch:
                self.batch["status"] = torch.zeros(
                    self.batch.num_graphs, 1, dtype=torch.long, device=self.batch.device
                )
            status = self.batch["status"]
            status.copy_(torch.where(failed, torch.full_like(status, frozen), status))

    def _failed_status(self) -> int:
        """Return the ``status`` value at which the engine leaves a structure alone."""
        return int(getattr(self.engine, "exit_status", 1))

    def _write_last_good_frames(self, fresh: list[StructureFailure]) -> None:
        """Give each newly failed structure's trajectory its last finite state."""
        if not self.trajectories:
            return
        mask = np.zeros(len(self.images), dtype=bool)
        for failure in fresh:
            last_good = max(failure.step - 1, 0)
            mask[failure.index] = self._frame_steps[failure.index] != last_good
        if not mask.any():
            return
        if self._synced_nsteps != self.nsteps:
            self._write_back(np.ones(len(self.images), dtype=bool))
            self._synced_nsteps = self.nsteps
        self.trajectories.write(self.images, mask)
        for failure in fresh:
            if mask[failure.index]:
                self._frame_steps[failure.index] = max(failure.step - 1, 0)

    def close(self) -> None:
        """Close trajectory and log files this object opened (as ASE's ``close``)."""
        self.trajectories.close()
        super().close()

    # ------------------------------------------------------------------
    # Run machinery shared by MD and optimizers
    # ------------------------------------------------------------------

    @contextlib.contextmanager
    def _running(self) -> Iterator[None]:
        """Prepare the engine for a run; write the final state back after it."""
        self._adopt_external_changes()
        ok = stopped = False
        self.batch_run.open_hooks()
        if self.progress:
            self._bar = ProgressBar(type(self).__name__, self.max_steps - self.nsteps)
        try:
            yield
            ok = True
        except GeneratorExit:
            stopped = True  # the caller left irun() at a yield: the state is whole
            raise
        finally:
            if self._bar is not None:
                self._bar.close()
                self._bar = None
            self.batch_run.close_hooks()
            try:
                self._finish_run(ok)
                if (ok or stopped) and self._primed:
                    self._checkpoint_if_new()
            finally:
                # files are complete after every run, and reopened to append
                self.trajectories.close()

    def _prime(self, *, stress: bool = False) -> None:
        """Evaluate the initial state once (ASE's first ``get_forces``).

        ``stress``: compute the stress too (frames written right after).
        """
        if self._primed:
            return
        self._hook_nsteps = self.nsteps
        outputs = self._outputs_at(self.nsteps)
        if stress and "stress" in self.model.model_config.outputs:
            outputs.add("stress")
            self.batch_run.stress_step = self.nsteps
        with (
            model_lock(self.model),  # threads sharing a model take turns
            self.model.narrowed_outputs(outputs),
        ):
            self.batch_run.prime()
        if self._pending_checkpoint is not None:
            checkpoint, self._pending_checkpoint = self._pending_checkpoint, None
            self.batch_run.restore_engine(checkpoint)
        self._after_priming()
        self._primed = True
        self._written_at[:] = -1  # new results: nothing is up to date
        if self._reads_are_free:
            self._absorb_failures()

    def step(self) -> None:
        """Advance every structure by one step (ASE's ``step``; ``nsteps`` unchanged).

        ``irun``/``run`` call it once per step, then count the step, as ASE's
        loops do, so a subclass may override it (calling ``super().step()``).
        Inside a run the batch holds the new state on the device and the
        ``Atoms`` are written when an observer or the end of the run needs
        them. Called directly (``for _ in range(n): dyn.step()``), it takes in
        what the caller changed in the ``Atoms``, evaluates the initial state
        first if nothing has been evaluated yet, and leaves every ``Atoms``
        holding the new positions, momenta (MD), cell and results, as ASE's
        ``step`` does. No observer is called and ``nsteps`` stays, as in ASE.
        """
        if self._run_is_stepping:
            self._step_engine()
        else:
            self._step_directly()

    def _step_engine(self) -> None:
        """One engine step over the batch; the ``Atoms`` are not touched."""
        self._hook_nsteps = self.nsteps + 1
        try:
            with (
                model_lock(self.model),  # threads sharing a model take turns
                self.model.narrowed_outputs(self._outputs_at(self.nsteps + 1)),
            ):
                self.batch_run.step()
        except RuntimeError as error:
            raise RuntimeError(
                f"{type(self).__name__}, step {self.nsteps + 1}: {error}\n(graph i of "
                "the batch is images[i]; structures that stayed finite keep their "
                "latest state, the others their last written one)"
            ) from error

    def _step_directly(self) -> None:
        """:meth:`step` called by the user: one step, then every ``Atoms`` written.

        On an error the ``Atoms`` keep their last written state.
        """
        self._adopt_external_changes()
        opened = self.batch_run.open_hooks()
        try:
            self._prime()
            self._step_engine()
        finally:
            if opened:
                self.batch_run.close_hooks()
        self._absorb_failures(raise_now=False)
        self._write_back(
            np.ones(len(self.images), dtype=bool),
            stress=self.batch_run.stress_step == self.nsteps + 1,
        )
        # the batch's results are those of this step, not of step ``nsteps``
        self.batch_run.stress_step = -1
        self._synced_nsteps = self.nsteps
        self._absorb_failures()

    #: Whether the run loop reads the failure flags itself right after each
    #: step (the optimizers' convergence read), so :meth:`_advance` need not.
    _reads_flags_after_step = False

    def _advance(self) -> None:
        """One step (:meth:`step`); ``nsteps`` counts it."""
        self._run_is_stepping = True
        try:
            self.step()
        finally:
            self._run_is_stepping = False
        self.nsteps += 1
        if self._reads_are_free and not self._reads_flags_after_step:
            self._absorb_failures()
        if self._bar is not None:
            self._bar.step(self._progress_note())

    @property
    def _reads_are_free(self) -> bool:
        """Whether reading a flag back costs no synchronisation (CPU runs)."""
        return devices.host_reads_are_free(self.batch.device)

    def _outputs_at(self, nsteps: int) -> set[str]:
        """Model outputs for the evaluation that produces step ``nsteps``.

        The engine's needs, plus stress on steps where an observer that reads
        it (trajectory frames, recorders) is due.
        """
        supported = set(self.model.model_config.outputs)
        wanted = self.engine_outputs()
        if "stress" in supported and any(
            is_due(interval, nsteps)
            for function, interval, _, _ in self.observers
            if getattr(function, "needs_stress", False)
        ):
            wanted.add("stress")
        if "stress" in wanted:
            self.batch_run.stress_step = nsteps
        return wanted & supported

    def _observers_due(self, nsteps: int) -> bool:
        """Whether an observer reading the ``Atoms`` is due at ``nsteps``."""
        return any(
            is_due(interval, nsteps)
            for function, interval, _, _ in self.observers
            if getattr(function, "needs_atoms", True)
        )

    def _changes_after_compute(self) -> tuple[str, ...] | None:
        """Fields that may change between the guard's two checks of a step.

        The guard checks the batch at ``AFTER_COMPUTE`` and again at
        ``AFTER_STEP``; in between run the engine's ``post_update``
        (:meth:`_post_update_writes`) and the hooks of the stages from
        ``AFTER_COMPUTE`` to ``AFTER_STEP``. When every such hook is one of
        this package's that leave the batch alone (the guard's own, the raw
        results' copy, observers that write the ``Atoms``) and the others
        run before the first check, only ``post_update``'s fields may change;
        any other hook (constraints, a user's nvalchemi hook, nvalchemi's
        ``FreezeAtomsHook``) may change anything (None). Asked every step
        (hooks attached mid-run count), answered again when the engine or its
        hooks changed.
        """
        key = (self.engine, *self.engine.hooks)
        known = self._changes_key
        if len(key) != len(known) or any(
            new is not old for new, old in zip(key, known, strict=True)
        ):
            self._changes_key = key
            self._changes = self._find_changes_after_compute()
        return self._changes

    def _find_changes_after_compute(self) -> tuple[str, ...] | None:
        fields = self._post_update_writes()
        if fields is None:
            return None
        late = _late_stages()
        own = self._guard.owns
        for hook in self.engine.hooks:
            if own(hook) or is_neighbor_hook(hook):
                continue  # the guard; neighbour lists (BEFORE_COMPUTE)
            if isinstance(hook, SaveHook | StageObserverHook):
                continue  # copies the raw outputs; writes the Atoms only
            if isinstance(hook, StageHook) and hook.stage not in late:
                continue  # acts before the first check
            return None
        return fields

    def _sync_if(self, needed: bool) -> None:
        if needed and self._synced_nsteps != self.nsteps:
            self.sync_atoms()

    def _finish_run(self, ok: bool) -> None:
        """Leave every ``Atoms`` holding the latest state.

        After an error (e.g. a NaN caught by a user's hook) only structures
        whose positions are still finite are written; the others keep their
        last good state. Structures that did not move keep their exact input.
        """
        if ok:
            if self._synced_nsteps != self.nsteps:
                self.sync_atoms()
            self._absorb_failures()
            return
        if self._synced_nsteps == self.nsteps:
            return
        # structures written at this step (sync_structures) are up to date
        self._write_back(self._finite_structures() & (self._written_at != self.nsteps))

    def _finite_structures(self) -> npt.NDArray[np.bool_]:
        bad_atoms = ~torch.isfinite(self.batch.positions.detach()).all(dim=1)
        bad = torch.zeros(
            self.batch.num_graphs, dtype=torch.long, device=bad_atoms.device
        )
        bad.index_add_(0, self.batch.batch_idx.long(), bad_atoms.long())
        return (bad == 0).cpu().numpy()

    # ------------------------------------------------------------------
    # Internals
    # ------------------------------------------------------------------

    def _initial_batch(self) -> Batch:
        return self._batch_of(self.images)

    def _batch_of(
        self, images: list[Atoms], *, checked: CheckedImages | None = None
    ) -> Batch:
        """Build the batch of ``images`` on the run's device and dtype.

        ``checked``: their :func:`~nvalchemi_ase.convert.check_images` result
        with this model and skin, built from without a second pass.
        """
        batch = (
            atoms_to_batch(
                images,
                device=self.setup.device,
                dtype=self.setup.dtype,
                warn_dropped=False,
                model=self.model,
                skin=self.neighbor_skin,
            )
            if checked is None
            else batch_from_checked(
                checked, device=self.setup.device, dtype=self.setup.dtype
            )
        )
        if not self.velocities_are_momenta:
            batch.velocities.zero_()
        return batch

    def _builtin_hooks(self, skin: float) -> list[Any]:
        stages = import_quietly("nvalchemi.dynamics.base").DynamicsStage
        # the raw model outputs are copied before any constraint hook adjusts them
        self._raw_results = RawResults(put_back=lambda: self._guard.put_back())
        hooks = [
            *self._guard.hooks(stages),
            self._raw_results.hook(stages),
            *neighbor_hooks(self.model, skin),
        ]
        frozen = bool((self.batch.atom_categories == FROZEN_CATEGORY).any())
        if frozen and not self._engine_freezes_atoms():
            hooks.append(freeze_hook(zero_velocities=self.velocities_are_momenta))
        self._constraints = BatchConstraints(
            self.images,
            self.batch,
            timestep=lambda: getattr(self, "dt", None),
            guard=self._guard,
        )
        if self._constraints.any:
            hooks += self._constraints.hooks(
                stages, momenta=self.velocities_are_momenta
            )
        self._configure_raw_results()
        return hooks

    def _configure_raw_results(self) -> None:
        """Keep the model's raw forces/stress while constraints adjust the batch's."""
        frozen = bool((self.batch.atom_categories == FROZEN_CATEGORY).any())
        self._raw_results.configure(
            forces=(frozen and not self._engine_freezes_atoms())
            or self._constraints.any,
            stress=self._constraints.symmetry is not None,
        )

    def _attach_calculators(self) -> None:
        for atoms in self.images:
            if atoms.calc is None:
                atoms.calc = self.setup.calculator

    def _snapshot_atoms(self) -> list[tuple[npt.NDArray[Any], ...]]:
        return [_snapshot(atoms) for atoms in self.images]

    def _adopt_external_changes(self) -> None:
        """Take in positions, momenta or cells the caller changed since our write."""
        changed = [
            index
            for index, (atoms, old) in enumerate(
                zip(self.images, self._written, strict=True)
            )
            if _differs(atoms, old, momenta=self.velocities_are_momenta)
        ]
        if _constraint_state(self.images) != self._constraints_written:
            self._adopt_new_constraints()
        if not changed:
            return
        for index in changed:
            if len(self.images[index]) != len(
                self._written[index][0]
            ) or not np.array_equal(
                self.images[index].numbers, self._written[index][3]
            ):
                raise ValueError(
                    f"images[{index}] changed its atoms since this dynamics object was "
                    "created; create a new dynamics object for the new structures"
                )
        check_constraints(self.images)
        fresh = self._initial_batch()
        with torch.no_grad():
            for key in ("positions", "velocities", "cell"):
                self.batch[key].copy_(fresh[key])
        self._refresh_neighbor_hooks()
        self._primed = False
        self._raw_results.carry({})  # positions changed: every row is evaluated
        self._written = self._snapshot_atoms()
        with torch.no_grad():
            self._positions_at_write.copy_(self.batch.positions)
            self._cell_at_write.copy_(self.batch.cell)
        self._guard.reset_volumes(self.batch)

    def _adopt_new_constraints(self) -> None:
        """Honour constraints the caller changed since the last run."""
        check_constraints(self.images)
        fresh = self._initial_batch()
        with torch.no_grad():
            self.batch.atom_categories.copy_(fresh.atom_categories)
        frozen = bool((self.batch.atom_categories == FROZEN_CATEGORY).any())
        has_hook = any(_is_freeze_hook(hook) for hook in self.engine.hooks)
        if frozen and not has_hook and not self._engine_freezes_atoms():
            self.engine.register_hook(
                freeze_hook(zero_velocities=self.velocities_are_momenta)
            )
        had_constraints = self._constraints.any
        self._constraints.refresh(self.images)
        if self._constraints.any and not had_constraints:
            stages = import_quietly("nvalchemi.dynamics.base").DynamicsStage
            for hook in self._constraints.hooks(
                stages, momenta=self.velocities_are_momenta
            ):
                self.engine.register_hook(hook)
        self._configure_raw_results()
        self._constraints_written = _constraint_state(self.images)
        self._primed = False

    def _refresh_neighbor_hooks(self) -> None:
        """Replace the neighbour-list hooks so the next evaluation rebuilds the list."""
        fresh = iter(neighbor_hooks(self.model, self.neighbor_skin))
        hooks = self.engine.hooks
        for position, hook in enumerate(hooks):
            if is_neighbor_hook(hook):
                hooks[position] = next(fresh)

    # ------------------------------------------------------------------
    # Checkpoints (restart=)
    # ------------------------------------------------------------------

    def write_checkpoint(self, path: str | os.PathLike[str] | None = None) -> None:
        """Write a checkpoint of the current state now (atomically).

        Parameters
        ----------
        path : str or path, optional
            Destination; default ``restart``. A new object given it as
            ``restart=`` continues from this state exactly.
        """
        target = self.restart if path is None else path
        if target is None:
            raise ValueError("give a path, or create this object with restart=PATH")
        if not self._primed:
            raise RuntimeError(
                f"{type(self).__name__}.write_checkpoint: nothing to checkpoint "
                "before the first evaluation; call run() (run(0) is enough) first"
            )
        meta, arrays = capture(
            self,
            self.batch_run,
            nsteps=self.nsteps,
            extras=self._checkpoint_extras(),
            job_inputs=self._job_inputs,
        )
        write_checkpoint(target, meta, arrays)
        if path is None:
            self._checkpoint_nsteps = self.nsteps

    def continue_from(self, path: str | os.PathLike[str]) -> None:
        """Take the state of a checkpoint written by :meth:`write_checkpoint`.

        What ``restart=path`` does at construction, for an object already
        built (the stage pipeline continues each rank's part this way, after
        resizing the MD batch to the structures of the checkpoint): the next
        run starts at the checkpoint's step and goes on bit for bit as the
        run that wrote it. The file is only read (this object's own
        ``restart``, if any, is unchanged).

        Parameters
        ----------
        path : str or path
            A checkpoint of an object with these structures, class, model and
            arguments.

        Raises
        ------
        CheckpointError
            If the file cannot be read or does not match (named field, fix).
        """
        checkpoint = read_checkpoint(path)
        check_matches(self, checkpoint)
        self._continue_from(checkpoint)
        self._continued = True

    def _setup_restart(
        self,
        restart: str | os.PathLike[str] | None,
        interval: int | None,
        checkpoint: Checkpoint | None,
    ) -> None:
        """Continue from ``checkpoint`` (``restart``, read); schedule its writes."""
        self.restart: str | None = None if restart is None else os.fspath(restart)
        self.restart_interval = (
            DEFAULT_RESTART_INTERVAL
            if interval is None
            else integer_argument("restart_interval", interval, "steps")
        )
        if self.restart_interval < 1:
            raise ValueError(
                f"restart_interval must be >= 1 (steps), got {self.restart_interval}"
            )
        self._checkpoint_nsteps = -1
        #: Arrays every checkpoint of this object carries (``extra/tag/<name>``),
        #: for a caller that must tell its checkpoints apart (the runners store
        #: the input indices of the chunk in flight); not compared on restart.
        self.checkpoint_tags: dict[str, npt.NDArray[Any]] = {}
        self._trajectory_frames0: npt.NDArray[np.int64] | None = None
        #: Digests of the structures the run started from (``dynamics.job``).
        self._job_inputs: npt.NDArray[np.uint64] | None = None
        if self.restart is None:
            return
        if checkpoint is not None:
            check_matches(self, checkpoint)
            self._continue_from(checkpoint)
        # hook: the job identity its checkpoints carry (the checkpoint's, if any)
        self._job_inputs = start_job(
            self.images, None if checkpoint is None else checkpoint.job_inputs
        )
        if self.trajectories:
            # frames already in the files (appending), for the checkpoint's count
            self._trajectory_frames0 = self.trajectories.frame_counts()
        self.attach(internal(self._checkpoint_observer), interval=self.restart_interval)

    def _continue_from(self, checkpoint: Checkpoint) -> None:
        """Take a checkpoint's state; the engine's follows at the first evaluation."""
        self.batch_run.restore_structures(checkpoint)
        self._restore_checkpoint_extras(checkpoint.group("extra"))
        self.nsteps = int(checkpoint.meta["nsteps"])
        seed = checkpoint.meta.get("random_seed")
        if seed is not None and hasattr(self, "seed"):
            self.seed = int(seed)
        self._failures = self._guard.new_failures()  # known: not warned again
        update_atoms(
            self.images,
            self.batch,
            results=False,
            momenta=np.broadcast_to(self._momenta_mask(), (len(self.images),)),
            rotation=self._writeback_rotation(),
        )
        with torch.no_grad():
            self._positions_at_write.copy_(self.batch.positions)
            self._cell_at_write.copy_(self.batch.cell)
        self._written = self._snapshot_atoms()
        self._primed = False
        self._pending_checkpoint = checkpoint
        self._checkpoint_nsteps = self.nsteps

    def _fresh_start(self) -> bool:
        """Whether ``irun`` starts at step 0 of a run not continued from a checkpoint.

        ASE logs and calls the observers at step 0; a run continued from a
        checkpoint taken at step 0 (stopped before its first step) did so
        before the checkpoint, so doing it again would repeat frame 0.
        """
        return self.nsteps == 0 and not self._continued

    def _checkpoint_observer(self) -> None:
        if self.nsteps > 0:
            self._checkpoint_if_new()

    def _checkpoint_if_new(self) -> None:
        if self.restart is not None and self._checkpoint_nsteps != self.nsteps:
            self.write_checkpoint()

    def _checkpoint_extras(self) -> dict[str, npt.NDArray[Any]]:
        """Class-specific arrays a checkpoint keeps (subclasses extend)."""
        extras = {"frame_steps": self._frame_steps.copy()}
        if self._log_paths:  # every writer has flushed: lines up to this step
            extras["log_sizes"] = np.array(
                [_file_size(path) for path in self._log_paths], dtype=np.int64
            )
        for name, value in self.checkpoint_tags.items():
            extras[f"tag/{name}"] = np.asarray(value)
        if self._trajectory_frames0 is not None:
            counts = self._trajectory_frames0 + self.trajectories.written
            extras["trajectory_frames"] = np.where(
                self._trajectory_frames0 < 0, -1, counts
            )
        return extras

    def _restore_checkpoint_extras(self, extras: dict[str, npt.NDArray[Any]]) -> None:
        """Take back what :meth:`_checkpoint_extras` saved (subclasses extend)."""
        if "frame_steps" in extras:
            self._frame_steps = extras["frame_steps"].astype(np.int64)
        sizes = extras.get("log_sizes")
        if sizes is not None and len(sizes) == len(self._log_paths):
            for path, size in zip(self._log_paths, sizes, strict=True):
                # lines a killed run logged after this checkpoint would repeat
                _cut_file(path, int(size))
        if "trajectory_frames" in extras and self.trajectories:
            # frames a killed run wrote after this checkpoint would repeat
            self.trajectories.truncate(extras["trajectory_frames"])

    def per_structure_thermo(self) -> dict[str, npt.NDArray[np.float64]]:
        """Per-structure energies and temperature, read from the batch in one transfer.

        Returns
        -------
        dict of numpy.ndarray, each shape (B,)
            ``natoms``; ``epot`` and ``ekin`` in eV; ``temperature`` in K with
            ASE's degrees of freedom (``atoms.get_number_of_degrees_of_freedom``:
            3 per atom not fixed by ``FixAtoms``, less what ``FixCom`` and
            ``FixCartesian`` remove).
        """
        batch = self.batch
        index = batch.batch_idx.long()
        count = batch.num_graphs
        velocities = batch.velocities.detach()
        masses = batch.atomic_masses.detach()
        kinetic_atom = 0.5 * masses * (velocities * velocities).sum(dim=1)
        free = (batch.atom_categories != FROZEN_CATEGORY).to(velocities.dtype)
        stacked = torch.zeros(3, count, dtype=torch.float64, device=velocities.device)
        stacked[0].index_add_(0, index, kinetic_atom.to(torch.float64))
        stacked[1].index_add_(0, index, free.to(torch.float64))
        stacked[2] = batch.energy.detach().reshape(-1).to(torch.float64)
        ekin, free_atoms, epot = stacked.cpu().numpy()
        natoms = batch.num_nodes_per_graph.cpu().numpy().astype(np.float64)
        dof = np.maximum(3.0 * free_atoms - self._constraints.removed_dof, 1.0)
        return {
            "natoms": natoms,
            "epot": epot,
            "ekin": ekin,
            "temperature": kinetic_temperature_K(ekin, dof),
        }

    def _write_trajectories(self, description: dict[str, Any] | None = None) -> None:
        self._sync_if(True)
        # a structure admitted before a run's first step has its frame of
        # this step already (the resize wrote it): ASE writes it once
        written = self._frame_steps == self.nsteps
        mask = self._writing_mask() & ~self._guard.known_mask & ~written
        self.trajectories.write(self.images, mask)
        self._frame_steps[mask] = self.nsteps

    def _writing_mask(self) -> npt.NDArray[np.bool_]:
        """Structures whose frames are written at this step (all, for MD)."""
        return np.ones(len(self.images), dtype=bool)


@functools.cache
def _late_stages() -> frozenset[Any]:
    """Return the stages from ``AFTER_COMPUTE`` to ``AFTER_STEP``, in order."""
    stages = import_quietly("nvalchemi.dynamics.base").DynamicsStage
    return frozenset(
        {
            stages.AFTER_COMPUTE,
            stages.BEFORE_POST_UPDATE,
            stages.AFTER_POST_UPDATE,
            stages.AFTER_STEP,
        }
    )


class _ResultsHolder:
    """Stands in for a copy's calculator while ``update_atoms`` gives it results.

    ``update_atoms`` hands a calculator with ``store_results`` its results
    dict; this one only keeps it (no copy of the ``Atoms``, no view).
    """

    def __init__(self) -> None:
        self.results: dict[str, Any] = {}

    def store_results(self, atoms: Atoms, results: dict[str, Any]) -> None:
        self.results = results


def _snapshot(atoms: Atoms) -> tuple[npt.NDArray[Any], ...]:
    """Return what :meth:`BatchedDynamics._adopt_external_changes` compares."""
    return (
        atoms.positions.copy(),
        atoms.get_momenta().copy(),
        atoms.cell.array.copy(),
        atoms.numbers.copy(),
    )


def _constraint_state(images: list[Atoms]) -> list[list[Any]]:
    """Describe every structure's constraints comparably."""
    return [[repr(c.todict()) for c in atoms.constraints] for atoms in images]


def _is_freeze_hook(hook: Any) -> bool:
    return type(hook).__name__ == "FreezeAtomsHook"


def _differs(atoms: Atoms, old: tuple[npt.NDArray[Any], ...], *, momenta: bool) -> bool:
    positions, old_momenta, cell, numbers = old
    if atoms.positions.shape != positions.shape:
        return True
    if not np.array_equal(atoms.positions, positions) or not np.array_equal(
        atoms.cell.array, cell
    ):
        return True
    if not np.array_equal(atoms.numbers, numbers):
        return True
    return momenta and not np.array_equal(atoms.get_momenta(), old_momenta)


def _file_size(path: str) -> int:
    """Size of ``path`` in bytes (0 if it does not exist yet)."""
    return os.path.getsize(path) if os.path.exists(path) else 0


def _cut_file(path: str, size: int) -> None:
    """Truncate ``path`` to ``size`` bytes if it is longer (appending writers go on)."""
    if os.path.exists(path) and os.path.getsize(path) > size:
        os.truncate(path, size)
