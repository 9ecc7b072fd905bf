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
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import torch
from ase import Atoms
from ase.optimize.optimize import BaseDynamics as AseBaseDynamics

from nvalchemi_ase._quiet import import_quietly
from nvalchemi_ase.convert import FROZEN_CATEGORY, atoms_to_batch, update_atoms
from nvalchemi_ase.devices import DtypeLike
from nvalchemi_ase.dynamics.engine import EngineDriver, freeze_hook
from nvalchemi_ase.dynamics.images import (
    CellFilterSpec,
    check_constraints,
    resolve_images,
    resolve_model_setup,
)
from nvalchemi_ase.dynamics.logs import internal
from nvalchemi_ase.dynamics.neighbors import is_neighbor_hook, neighbor_hooks
from nvalchemi_ase.dynamics.observers import (
    StageObserverHook,
    is_due,
    is_nvalchemi_hook,
)
from nvalchemi_ase.dynamics.progress import ProgressBar, progress_enabled
from nvalchemi_ase.dynamics.trajectory import TrajectorySet, TrajectorySpec
from nvalchemi_ase.units import kinetic_temperature_K

if TYPE_CHECKING:
    from nvalchemi.data import Batch
    from nvalchemi.dynamics.base import BaseDynamics as EngineType
    from nvalchemi.models.base import BaseModelMixin

__all__ = ["DEFAULT_SKIN", "BatchedDynamics"]

#: Default Verlet skin of the neighbour list in dynamics, Å. The list is built to
#: ``cutoff + skin`` and rebuilt only when an atom has moved more than half of
#: it; without a skin the list is 56-78 % of a CPU step (survey §5e).
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
    """

    #: Whether structures may be given as cell filters (optimizers only).
    _accepts_cell_filters = False
    #: Whether the engine's velocities are physical (MD) and go to momenta.
    _velocities_are_momenta = True

    def __init__(
        self,
        images: Any,
        logfile: Any = None,
        trajectory: TrajectorySpec = None,
        loginterval: int = 1,
        *,
        append_trajectory: bool = False,
        model: BaseModelMixin | str | None = None,
        device: torch.device | str | None = None,
        dtype: DtypeLike = None,
        neighbor_skin: float | None = None,
        progress: bool | None = False,
    ) -> None:
        atoms_list, cell_filter, single = resolve_images(
            images, allow_cell_filters=self._accepts_cell_filters
        )
        check_constraints(atoms_list)
        self.images: list[Atoms] = atoms_list
        self.cell_filter: CellFilterSpec | None = cell_filter
        self.setup = resolve_model_setup(atoms_list, model, device, dtype)
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
        self.batch: Batch = self._initial_batch()
        skin = self._default_skin() if neighbor_skin is None else float(neighbor_skin)
        self.neighbor_skin = skin
        self.engine: EngineType = self._build_engine(self._builtin_hooks(skin))
        self._driver = EngineDriver(self.engine, self.batch)
        self._stage_hooks: dict[Any, StageObserverHook] = {}
        self._hook_nsteps = 0
        self._stress_step = -1
        self._primed = False
        self._synced_nsteps: int | None = None
        self._written = self._snapshot_atoms()
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
        self._setup_logging(logfile)

    # ------------------------------------------------------------------
    # Subclass interface
    # ------------------------------------------------------------------

    def _build_engine(self, hooks: list[Any]) -> EngineType:
        """Return the nvalchemi engine (subclasses), registered with ``hooks``."""
        raise NotImplementedError

    def _setup_logging(self, logfile: Any) -> None:
        """Attach the log writers (subclasses)."""

    def _check_inputs(self) -> None:
        """Validate arguments against the structures before any work (subclasses)."""

    def _engine_outputs(self) -> set[str]:
        """Model outputs every engine step needs."""
        needs = set(getattr(self.engine, "__needs_keys__", ()))
        return {"energy", "forces"} | (needs & {"stress"})

    def _default_skin(self) -> float:
        return DEFAULT_SKIN

    def _progress_note(self) -> str | None:
        """Text shown after the progress bar (optimizers: structures converged)."""
        return None

    def _momenta_mask(self) -> bool | npt.NDArray[np.bool_]:
        """Which structures' velocities are physical momenta to write back."""
        return self._velocities_are_momenta

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
            self.engine.register_hook(function)
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
            self.engine.register_hook(function)
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

    def sync_atoms(self) -> None:
        """Copy the batch's current state and results into the user's ``Atoms``."""
        self._attach_calculators()
        update_atoms(
            self.images,
            self.batch,
            results=True,
            momenta=self._momenta_mask(),
            stress=self._stress_step == self.nsteps,
            rotation=self._writeback_rotation(),
        )
        self._written = self._snapshot_atoms()
        self._synced_nsteps = self.nsteps

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
        ok = False
        self._driver.open()
        if self.progress:
            self._bar = ProgressBar(type(self).__name__, self.max_steps - self.nsteps)
        try:
            yield
            ok = True
        finally:
            if self._bar is not None:
                self._bar.close()
                self._bar = None
            self._driver.close()
            self._finish_run(ok)
            # files are complete after every run, and reopened to append
            self.trajectories.close()

    def _prime(self) -> None:
        """Evaluate the initial state once (ASE's first ``get_forces``)."""
        if self._primed:
            return
        self._hook_nsteps = self.nsteps
        self.engine.check_initial_batch(self.batch)
        with self.model.narrowed_outputs(self._outputs_at(self.nsteps)):
            self._driver.prime()
        self._primed = True

    def _advance(self) -> None:
        """One engine step; ``nsteps`` counts it."""
        self._hook_nsteps = self.nsteps + 1
        try:
            with self.model.narrowed_outputs(self._outputs_at(self.nsteps + 1)):
                self._driver.step()
        except RuntimeError as error:
            raise RuntimeError(
                f"{type(self).__name__}, step {self.nsteps + 1}: {error}\n(graph i of "
                "the batch is images[i]; structures that stayed finite keep their "
                "latest state, the others their last written one)"
            ) from error
        self.nsteps += 1
        if self._bar is not None:
            self._bar.step(self._progress_note())

    def _outputs_at(self, nsteps: int) -> set[str]:
        """Model outputs for the evaluation that produces step ``nsteps``.

        The engine's needs, plus stress on steps where an observer that reads
        it (trajectory frames, recorders) is due.
        """
        supported = set(self.model.model_config.outputs)
        wanted = self._engine_outputs()
        if "stress" in supported and any(
            is_due(interval, nsteps)
            for function, interval, _, _ in self.observers
            if getattr(function, "needs_stress", False)
        ):
            wanted.add("stress")
        self._stress_step = nsteps if "stress" in wanted else self._stress_step
        return wanted & supported

    def _observers_due(self, nsteps: int) -> bool:
        """Whether an observer reading the ``Atoms`` is due at ``nsteps``."""
        return any(
            is_due(interval, nsteps)
            for function, interval, _, _ in self.observers
            if getattr(function, "needs_atoms", True)
        )

    def _sync_if(self, needed: bool) -> None:
        if needed and self._synced_nsteps != self.nsteps:
            self.sync_atoms()

    def _finish_run(self, ok: bool) -> None:
        """Leave every ``Atoms`` holding the latest state.

        After an error (e.g. a NaN caught by a hook) only structures whose
        positions are still finite are written; the others keep their last
        good state.
        """
        if self._synced_nsteps == self.nsteps:
            return
        finite = self._finite_structures()
        if ok or finite.all():
            self.sync_atoms()
            return
        keep = np.flatnonzero(finite)
        rotation = self._writeback_rotation()
        if keep.size:
            self._attach_calculators()
            update_atoms(
                [self.images[i] for i in keep],
                self.batch.index_select(
                    torch.as_tensor(keep, device=self.batch.device)
                ),
                results=True,
                momenta=np.broadcast_to(self._momenta_mask(), finite.shape)[keep],
                stress=self._stress_step == self.nsteps,
                rotation=None if rotation is None else rotation[keep],
            )

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
        batch = atoms_to_batch(
            self.images,
            device=self.setup.device,
            dtype=self.setup.dtype,
            warn_dropped=False,
        )
        if not self._velocities_are_momenta:
            batch.velocities.zero_()
        return batch

    def _builtin_hooks(self, skin: float) -> list[Any]:
        hooks = neighbor_hooks(self.model, skin)
        if bool((self.batch.atom_categories == FROZEN_CATEGORY).any()):
            hooks.append(freeze_hook(zero_velocities=self._velocities_are_momenta))
        return hooks

    def _attach_calculators(self) -> None:
        for atoms in self.images:
            if atoms.calc is None:
                atoms.calc = self.setup.calculator

    def _snapshot_atoms(self) -> list[tuple[npt.NDArray[Any], ...]]:
        return [
            (
                atoms.positions.copy(),
                atoms.get_momenta().copy(),
                atoms.cell.array.copy(),
                atoms.numbers.copy(),
            )
            for atoms in self.images
        ]

    def _adopt_external_changes(self) -> None:
        """Take in positions, momenta or cells the caller changed since our write."""
        changed = [
            index
            for index, (atoms, old) in enumerate(
                zip(self.images, self._written, strict=True)
            )
            if _differs(atoms, old, momenta=self._velocities_are_momenta)
        ]
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
        self._written = self._snapshot_atoms()

    def _refresh_neighbor_hooks(self) -> None:
        """Replace the neighbour-list hooks so the next evaluation rebuilds the list."""
        fresh = iter(neighbor_hooks(self.model, self.neighbor_skin))
        hooks = self.engine.hooks
        for position, hook in enumerate(hooks):
            if is_neighbor_hook(hook):
                hooks[position] = next(fresh)

    def per_structure_thermo(self) -> dict[str, npt.NDArray[np.float64]]:
        """Per-structure energies and temperature, read from the batch in one transfer.

        Returns
        -------
        dict of numpy.ndarray, each shape (B,)
            ``natoms``; ``epot`` and ``ekin`` in eV; ``temperature`` in K with
            ASE's degrees of freedom (3 per atom not fixed by ``FixAtoms``).
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
        dof = np.maximum(3.0 * free_atoms, 1.0)
        return {
            "natoms": natoms,
            "epot": epot,
            "ekin": ekin,
            "temperature": kinetic_temperature_K(ekin, dof),
        }

    def _write_trajectories(self, description: dict[str, Any] | None = None) -> None:
        self._sync_if(True)
        self.trajectories.write(self.images, self._writing_mask())

    def _writing_mask(self) -> npt.NDArray[np.bool_]:
        """Structures whose frames are written at this step (all, for MD)."""
        return np.ones(len(self.images), dtype=bool)


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
