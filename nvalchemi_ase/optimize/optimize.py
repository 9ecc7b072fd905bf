"""The optimizer half of the ASE contract (``ase.optimize.optimize.Optimizer``).

Every structure converges on its own: once its largest atomic force (and, under
a cell filter, its largest cell force) is below ``fmax`` it stops moving, while
the others go on. ``run`` returns True when all have converged;
:attr:`BatchedOptimizer.converged_mask` says which did.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import numpy.typing as npt
import torch
from ase.constraints import FixAtoms

from nvalchemi_ase._quiet import import_quietly
from nvalchemi_ase.compose import MDPart, RelaxThenMD
from nvalchemi_ase.dynamics.base import BatchedDynamics
from nvalchemi_ase.dynamics.checkpoint import host_array
from nvalchemi_ase.dynamics.failures import FailureLimits
from nvalchemi_ase.dynamics.images import integer_argument, real_argument
from nvalchemi_ase.dynamics.logs import is_template, open_log, per_structure_targets
from nvalchemi_ase.optimize.cell_filters import (
    FilterOptions,
    filter_coordinates,
    filter_options,
)
from nvalchemi_ase.pipeline import RelaxThenMDPipeline
from nvalchemi_ase.typing import ImagesLike, LogfileLike, TrajectoryLike

if TYPE_CHECKING:
    from nvalchemi_ase.engines.cell_filter import CellFilterCoordinates

__all__ = ["DEFAULT_MAX_STEPS", "BatchedOptimizer"]

#: ASE's default step limit of ``Optimizer.run``.
DEFAULT_MAX_STEPS = 100_000_000


class BatchedOptimizer(BatchedDynamics):
    """ASE ``Optimizer`` semantics over a batched nvalchemi optimizer.

    Parameters
    ----------
    images : ase.Atoms, cell filter, or sequence of them
        Structures to relax; ``FrechetCellFilter``/``UnitCellFilter`` objects
        relax the cell too.
    restart : str or path, optional
        Checkpoint file, ASE's argument: continued from when it exists, written
        every ``restart_interval`` steps and after every ``run()`` (see
        :class:`~nvalchemi_ase.dynamics.base.BatchedDynamics`; unlike ASE's
        JSON file it also holds the structures, so a new optimizer on the
        original input continues exactly).
    logfile : file, str, path or None
        ``"-"`` (stdout, ASE's default) or a path: ASE's optimizer log for one
        structure, a summary line per step for several (a template with
        ``{i}`` gives each structure its own ASE log).
    trajectory : str, path, Trajectory, sequence of them, or None
        Per-structure trajectories (see
        :class:`~nvalchemi_ase.dynamics.base.BatchedDynamics`).
    append_trajectory : bool
        Append to existing trajectory files.
    **kwargs
        ``loginterval``, ``model``, ``device``, ``dtype``, ``neighbor_skin``.
    """

    accepts_cell_filters = True
    velocities_are_momenta = False
    resizes_in_place = True
    # the convergence read after every step takes the failures in
    _reads_flags_after_step = True
    #: Whether the engine moves ASE's filter coordinates itself (this package's
    #: FIRE, BFGS, MDMin: ASE's path, in the user's frame) rather than
    #: nvalchemi's variable-cell engines (aligned cells, options as hooks).
    filter_in_engine: ClassVar[bool] = False
    #: The part it plays in ``optimizer + md`` / ``optimizer | md``.
    composition_role: ClassVar[str] = "optimizer"

    def __init__(
        self,
        images: ImagesLike,
        restart: str | None = None,
        logfile: LogfileLike = "-",
        trajectory: TrajectoryLike = None,
        append_trajectory: bool = False,
        **kwargs: Any,
    ) -> None:
        self.fmax: float | None = None
        self._filter_options: FilterOptions | None = None
        self._cell_coordinates: CellFilterCoordinates | None = None
        super().__init__(
            images,
            logfile=logfile,
            trajectory=trajectory,
            append_trajectory=append_trajectory,
            restart=restart,
            **kwargs,
        )
        count = len(self.images)
        # No ``status`` column until a structure is done (see _publish_status).
        self._converged_host = np.zeros(count, dtype=bool)
        self._moving = np.ones(count, dtype=bool)
        self._fmax_host = np.full(count, np.inf)
        self._converged_at = np.full(count, -1)
        self._energy_host = np.zeros(count)

    def _builtin_hooks(self, skin: float) -> list[Any]:
        hooks = super()._builtin_hooks(skin)
        self._filter_options = None
        if self.cell_filter is not None and self.filter_in_engine:
            self._cell_coordinates = filter_coordinates(
                self.cell_filter.filters, self.cell_filter.kind, self.batch
            )
        elif self.cell_filter is not None:
            self._filter_options = filter_options(
                self.cell_filter.filters, self.batch, self._alignment
            )
        if self._filter_options is not None:
            stages = import_quietly("nvalchemi.dynamics.base").DynamicsStage
            hooks += self._filter_options.hooks(stages)
        return hooks

    def _initial_batch(self) -> Any:
        batch = super()._initial_batch()
        # Optimizers move fictitious particles: like ASE's, they use unit masses
        # (nvalchemi's FIRE would otherwise integrate with the atomic masses).
        batch.atomic_masses.fill_(1.0)
        if self.cell_filter is not None and self.filter_in_engine:
            # the user's frame: nothing to rotate, nothing to undo
            self._alignment = np.ascontiguousarray(
                np.broadcast_to(np.eye(3), (len(self.images), 3, 3))
            )
            self._aligned_cell0 = batch.cell.detach().cpu().numpy().astype(np.float64)
        elif self.cell_filter is not None:
            self._align_cells(batch)
        return batch

    def _align_cells(self, batch: Any) -> None:
        """Rotate structures to lower-triangular cells, as nvalchemi's engines need.

        The rotation Q of each structure (ASE's ``Cell.standard_form``) is kept
        and undone whenever the state is written back, so the user's structures
        never come back rotated.
        """
        rotations = np.stack([atoms.cell.standard_form()[1] for atoms in self.images])
        # C order, as a checkpoint gives it back: einsum's rounding follows layout
        self._alignment = rotations = np.ascontiguousarray(rotations)
        rotation = torch.as_tensor(
            rotations, dtype=batch.positions.dtype, device=batch.device
        )
        per_atom = rotation[batch.batch_idx.long()]
        with torch.no_grad():
            batch.positions.copy_(torch.einsum("vj,vkj->vk", batch.positions, per_atom))
            batch.cell.copy_(torch.einsum("bij,bkj->bik", batch.cell, rotation))
        self._aligned_cell0 = batch.cell.detach().cpu().numpy().astype(np.float64)

    def _writeback_rotation(self) -> npt.NDArray[np.float64] | None:
        """Undo the alignment and the rotation the engine's cell update adds.

        nvalchemi keeps cells lower-triangular, so its cell updates are a
        symmetric strain followed by a rotation. ASE's cell filters apply the
        strain only; the rotating part R of the polar decomposition F = P R of
        the cell deformation is removed, so only the strain reaches the user.
        """
        if self.cell_filter is None or self.filter_in_engine:
            return None
        cell = self.batch.cell.detach().cpu().numpy().astype(np.float64)
        deformation = np.linalg.solve(self._aligned_cell0, cell)
        left, _, right = np.linalg.svd(deformation)
        rotating_part = left @ right
        return np.einsum("bji,bjk->bik", rotating_part, self._alignment)

    def _checkpoint_extras(self) -> dict[str, npt.NDArray[Any]]:
        """Convergence flags and, under a cell filter, the frame alignment."""
        extras = super()._checkpoint_extras() | {
            "converged": self._converged_host.copy(),
            "fmax": self._fmax_host.copy(),
        }
        if self.cell_filter is not None:
            extras["alignment"] = self._alignment
            extras["aligned_cell0"] = self._aligned_cell0
        if self._cell_coordinates is not None:  # the filters' orig_cell (ASE dumps it)
            extras["filter_reference"] = host_array(self._cell_coordinates.reference)
        return extras

    def _restore_checkpoint_extras(self, extras: dict[str, npt.NDArray[Any]]) -> None:
        # Convergence is recomputed from the restored forces when a run starts.
        super()._restore_checkpoint_extras(extras)
        if self.cell_filter is not None:
            self._alignment = extras["alignment"]
            self._aligned_cell0 = extras["aligned_cell0"]
        reference = extras.get("filter_reference")
        if reference is not None and self._cell_coordinates is not None:
            self._restore_filter_reference(reference)

    def _restore_filter_reference(self, reference: npt.NDArray[np.float64]) -> None:
        """Put the run's reference cells back in the engine and the user's filters.

        A filter built on the restarted structure takes its current cell as
        ``orig_cell``; ASE's BFGS restores the dumped one, so the filter
        coordinates, and with them the steps, are those of the uninterrupted run.
        """
        assert self._cell_coordinates is not None  # noqa: S101 - checked by caller
        assert self.cell_filter is not None  # noqa: S101 - coordinates imply one
        coordinates = self._cell_coordinates
        coordinates.set_reference(
            torch.as_tensor(
                reference,
                dtype=coordinates.reference.dtype,
                device=coordinates.reference.device,
            )
        )
        name = "origcell" if self.cell_filter.kind == "StrainFilter" else "orig_cell"
        for cell_filter, cell in zip(self.cell_filter.filters, reference, strict=True):
            setattr(cell_filter, name, np.array(cell, dtype=np.float64))

    def _resize_mirror(
        self,
        kept: npt.NDArray[np.intp],
        arrivals: list[Any],
        at_write: tuple[torch.Tensor, torch.Tensor],
        trajectories: list[Any],
    ) -> None:
        """Resize the convergence arrays too (admitted structures: unconverged)."""
        super()._resize_mirror(kept, arrivals, at_write, trajectories)
        count = len(self.images)

        def grown(values: npt.NDArray[Any], fill: Any) -> npt.NDArray[Any]:
            result = np.full(count, fill, dtype=values.dtype)
            result[: len(kept)] = values[kept]
            return result

        batch = self.batch
        self._converged_host = grown(self._converged_host, False)
        self._moving = grown(self._moving, True)
        self._fmax_host = grown(self._fmax_host, np.inf)
        self._converged_at = grown(self._converged_at, -1)
        self._energy_host = grown(self._energy_host, 0.0)
        if "status" in batch:
            self._publish_status(self._converged_host | self._guard.known_mask)

    def resizable(self) -> bool:
        """Whether :meth:`resize` can work in place (not with ``downhill_check``).

        Returns
        -------
        bool
            See :meth:`~nvalchemi_ase.dynamics.base.BatchedDynamics.resizable`;
            FIRE's ``downhill_check`` keeps per-atom positions outside the
            engine's state.
        """
        return super().resizable() and not getattr(self, "downhill_check", False)

    def _prime_admitted(self, n_kept: int) -> None:
        """Evaluate the resized batch; the admitted structures' convergence at once."""
        super()._prime_admitted(n_kept)
        if self.fmax is not None:
            self._update_convergence()

    # -- ASE API ---------------------------------------------------------------

    @property
    def converged_mask(self) -> npt.NDArray[np.bool_]:
        """Which structures have converged, shape (B,) (a copy)."""
        return self._converged_host.copy()

    @property
    def converged_at_step(self) -> npt.NDArray[np.int64]:
        """Step at which each structure first converged in this run, -1 if not, (B,)."""
        return self._converged_at.copy()

    @property
    def fmax_per_structure(self) -> npt.NDArray[np.float64]:
        """Latest largest force per structure, eV/Å, shape (B,) (cell included)."""
        return self._fmax_host.copy()

    @property
    def energy_per_structure(self) -> npt.NDArray[np.float64]:
        """Latest potential energy per structure, eV, shape (B,)."""
        return self._energy_host.copy()

    def todict(self) -> dict[str, Any]:
        """Describe the run as ASE's ``Optimizer.todict`` does."""
        description: dict[str, Any] = {
            "type": "optimization",
            "optimizer": type(self).__name__,
            "restart": self.restart,
        }
        for attr in ("maxstep", "alpha", "max_steps", "fmax"):
            if hasattr(self, attr):
                description[attr] = getattr(self, attr)
        return description

    def then(
        self,
        md: MDPart,
        *,
        fmax: float = 0.05,
        md_steps: int | None = None,
        trajectory: TrajectoryLike = None,
        logfile: LogfileLike = None,
        loginterval: int = 1,
        **restart: Any,
    ) -> RelaxThenMD:
        """Fuse with an MD object: each structure relaxes to ``fmax``, then runs MD.

        Parameters
        ----------
        md : MDPart
            MD over the same ``Atoms`` objects and model (this package's MD
            classes, ``nvalchemi_ase.compose.MDPart``).
        fmax : float
            Hand-over threshold on the largest force, eV/Å.
        md_steps : int, optional
            MD steps per structure after it relaxed (None: until ``run`` ends).
        trajectory, logfile, loginterval
            Output of the fused run (see
            :class:`~nvalchemi_ase.compose.RelaxThenMD`).
        **restart
            ``restart``, ``restart_interval``, ``append_trajectory`` of
            :class:`~nvalchemi_ase.compose.RelaxThenMD`.

        Returns
        -------
        RelaxThenMD
            One run on nvalchemi's ``FusedStage``; ``optimizer + md`` is
            ``optimizer.then(md)``.
        """
        return RelaxThenMD(
            self,
            md,
            fmax=fmax,
            md_steps=md_steps,
            trajectory=trajectory,
            logfile=logfile,
            loginterval=loginterval,
            **restart,
        )

    def __add__(self, md: MDPart) -> RelaxThenMD:
        """``optimizer + md``: :meth:`then` with its defaults."""
        return self.then(md)

    def pipe(
        self,
        md: MDPart,
        *,
        fmax: float = 0.05,
        md_steps: int | None = None,
        trajectory: Any = None,
        logfile: Any = None,
        loginterval: int = 1,
        restart: Any = None,
        restart_interval: int | None = None,
    ) -> RelaxThenMDPipeline:
        """Relax on rank 0 and run MD on rank 1 (two ranks started by torchrun).

        Parameters
        ----------
        md : MDPart
            MD over the same ``Atoms`` objects and model (this package's MD
            classes, ``nvalchemi_ase.compose.MDPart``).
        fmax : float
            Hand-over threshold on the largest force, eV/Å.
        md_steps : int, optional
            MD steps per structure after it relaxed (None: until ``run`` ends).
        trajectory, logfile, loginterval
            As for ``optimizer + md``: one trajectory per structure with its
            relaxation then MD frames; see
            :class:`~nvalchemi_ase.pipeline.RelaxThenMDPipeline` for the logs.
        restart, restart_interval
            The pipeline's checkpoint (a manifest, with one file per rank
            beside it) and the steps between its writes; see
            :class:`~nvalchemi_ase.pipeline.RelaxThenMDPipeline`.

        Returns
        -------
        RelaxThenMDPipeline
            This optimizer on rank 0 feeding ``md`` (one batch resized in
            place) on rank 1, behind an ASE-style ``run()``; ``optimizer | md``
            is ``optimizer.pipe(md)``.
        """
        return RelaxThenMDPipeline(
            self,
            md,
            fmax=fmax,
            md_steps=md_steps,
            trajectory=trajectory,
            logfile=logfile,
            loginterval=loginterval,
            restart=restart,
            restart_interval=restart_interval,
        )

    def __or__(self, md: MDPart) -> RelaxThenMDPipeline:
        """``optimizer | md``: :meth:`pipe` with its defaults."""
        return self.pipe(md)

    @property
    def optimizable(self) -> Any:
        """ASE's ``Optimizable`` of the structure, or a list of one per structure.

        For one ``Atoms`` (or cell filter) given alone, exactly what ASE's
        optimizer holds (``atoms.__ase_optimizable__()``); for many, one each.
        It reads and writes the ``Atoms``: call :meth:`sync_atoms` first after
        steps taken with ``run``.
        """
        targets = [self.atoms] if not isinstance(self.atoms, list) else self.atoms
        optimizables = [target.__ase_optimizable__() for target in targets]
        return optimizables if isinstance(self.atoms, list) else optimizables[0]

    def converged(self, forces: Any = None, *, gradient: Any = None) -> bool:
        """Whether every structure has converged (ASE's ``converged``).

        Parameters
        ----------
        forces : array_like or sequence of them, optional
            Forces to judge instead of the current ones: (N, 3) eV/Å for one
            structure, or one array per structure (rows of a cell filter's
            optimizable included, as ASE's).
        gradient : array_like or sequence of them, optional
            The same as ``-forces``, flattened (ASE's deprecated keyword; a
            ``FutureWarning``, as ASE 3.29 gives).

        Returns
        -------
        bool
            With neither argument, whether every structure converged at the
            last step; otherwise whether every given force set is below
            ``fmax`` (ASE's criterion).
        """
        if gradient is not None:
            warnings.warn(
                "The gradient keyword will be removed in 3.29.0",
                FutureWarning,
                stacklevel=2,
            )
        elif forces is not None:
            gradient = [
                -np.asarray(f, dtype=np.float64).ravel() for f in _each(forces, self)
            ]
        else:
            return bool(self._converged_host.all())
        return self.gradient_converged(gradient)

    def gradient_converged(self, gradient: Any) -> bool:
        """ASE's ``gradient_converged``: every largest force below ``fmax``.

        Parameters
        ----------
        gradient : array_like or sequence of them
            Flat gradient(s), eV/Å: one for one structure, or one per structure.

        Returns
        -------
        bool
        """
        if self.fmax is None:
            raise ValueError("fmax is not set yet: call run(fmax=...) or irun first")
        norms = [
            np.linalg.norm(np.asarray(g, dtype=np.float64).reshape(-1, 3), axis=1).max()
            for g in _each(gradient, self)
        ]
        return bool(all(norm < self.fmax for norm in norms))

    def step(self, f: Any = None) -> None:
        """One step of every structure (ASE's ``step``; ``nsteps`` unchanged).

        Called directly, it moves every structure that has not failed, a
        converged one included (as ASE's ``step`` does), and leaves the
        ``Atoms`` holding the new positions, cell and the results there (see
        :meth:`~nvalchemi_ase.dynamics.base.BatchedDynamics.step`).

        Parameters
        ----------
        f : None
            Must be None: the forces of a batched step come from the model on
            the device (ASE's optimizers accept given forces here).
        """
        if f is not None:
            raise ValueError(
                "step(f) with given forces is not supported: batched optimizers "
                "evaluate the model themselves; call step() without forces"
            )
        if not self._run_is_stepping and "status" in self.batch:
            # a run froze its converged structures; ASE's step moves them
            self._publish_status(self._guard.known_mask)
        super().step()

    def irun(
        self,
        fmax: float = 0.05,
        steps: int = DEFAULT_MAX_STEPS,
        *,
        sync_atoms: bool = True,
    ) -> Iterator[bool]:
        """Run as a generator, yielding like ASE's ``Optimizer.irun``.

        Parameters
        ----------
        fmax : float
            Convergence threshold on the largest force, eV/Å.
        steps : int
            Step limit.
        sync_atoms : bool
            True (ASE's behaviour): the structures hold the current state at
            every yield. False: they are written only when an observer needs
            them and when the run ends; in between read the batch
            (``converged_mask``, ``fmax_per_structure``, ...) or write chosen
            structures with :meth:`sync_structures` (the runners' loop).

        Yields
        ------
        bool
            Whether all structures have converged.
        """
        return self._irun(fmax, steps, sync_every_step=sync_atoms)

    def run(self, fmax: float = 0.05, steps: int = DEFAULT_MAX_STEPS) -> bool:
        """Relax every structure until its largest force is below ``fmax``.

        Parameters
        ----------
        fmax : float
            Convergence threshold, eV/Å (ASE's criterion: max atomic force norm
            < fmax, cell forces included under a cell filter).
        steps : int
            Step limit for the whole batch.

        Returns
        -------
        bool
            True when every structure converged.
        """
        converged = False
        for converged in self._irun(fmax, steps, sync_every_step=False):  # noqa: B007
            pass
        return converged

    # -- run loop ----------------------------------------------------------------

    def _irun(self, fmax: float, steps: int, sync_every_step: bool) -> Iterator[bool]:
        fmax = real_argument("fmax", fmax, "eV/Å")
        steps = integer_argument("steps", steps)
        if not fmax >= 0:  # ASE accepts 0: nothing converges, `steps` are run
            raise ValueError(f"fmax must be >= 0 (eV/Å), got {fmax}")
        if steps < 0:
            raise ValueError(f"steps must be >= 0, got {steps}")
        self.fmax = float(fmax)
        self.max_steps = self.nsteps + steps
        with self._running():
            self._prime()
            self._converged_host = np.zeros(len(self.images), dtype=bool)
            self._converged_at[:] = -1
            done = self._update_convergence()
            if self.nsteps == 0:
                self._moving[:] = True
                if self._fresh_start():  # a run continued at step 0 logged it
                    self.log()
                # ASE writes the initial frame only into an empty trajectory
                # (no duplicate on a restart); here each structure's own file
                fresh = (
                    self.trajectories.empty_mask()
                    if self.trajectories
                    else self._moving.copy()
                )
                if fresh.any():
                    self._moving = fresh
                    self._sync_if(sync_every_step or self._observers_due(0))
                    self.call_observers()
                    self._moving = np.ones(len(self.images), dtype=bool)
            self._sync_if(sync_every_step)
            yield self.converged()
            while not done and self.nsteps < self.max_steps:
                self._moving = ~self._converged_host & ~self._guard.known_mask
                self._advance()
                done = self._update_convergence()
                self.log()
                self._sync_if(sync_every_step or self._observers_due(self.nsteps))
                self.call_observers()
                yield self.converged()
                # a resize between yields may have admitted structures
                done = bool((self._converged_host | self._guard.known_mask).all())

    def _update_convergence(self) -> bool:
        """Freeze structures below ``fmax``; one small device-to-host transfer.

        Returns whether every structure is done: converged or failed. On a
        CPU the failures are taken in first, where ``_advance`` takes them in
        for the other classes (one read of the flags per step, not two).
        """
        reads_are_free = self._reads_are_free
        if reads_are_free:
            self._absorb_failures()
        fmax = self._fmax_per_structure()
        energy = self.batch.energy.detach().reshape(-1)
        failed = self._guard.failed
        if reads_are_free:  # the tensors' own memory: no stacking
            self._fmax_host = fmax.numpy().astype(np.float64)
            self._energy_host = energy.numpy().astype(np.float64)
            failed_host = failed.numpy().copy()
        else:  # one transfer; stack promotes bool and float32 exactly
            host = torch.stack([fmax, energy, failed]).cpu().numpy()
            self._fmax_host, self._energy_host, flags = host.astype(np.float64)
            failed_host = flags > 0.5
        below = self._fmax_host < _rounded(self._threshold(), fmax.dtype)
        self._converged_host |= below & ~failed_host
        done_host = self._converged_host | failed_host
        if done_host.any() or "status" in self.batch:
            self._publish_status(done_host)
        newly = self._converged_host & (self._converged_at < 0)
        self._converged_at[newly] = self.nsteps
        if not reads_are_free:
            self._absorb_failures(failed_host)
        if self._bar is not None:
            failures = int(failed_host.sum())
            self._bar.note(
                f"converged {int(self._converged_host.sum())}/{len(self.images)}"
                + (f", failed {failures}" if failures else "")
                + f", fmax {self._largest_running_fmax():.3g} eV/Å"
            )
        return bool(done_host.all())

    def _publish_status(self, done: npt.NDArray[np.bool_]) -> None:
        """Write ``done`` (B,) into nvalchemi's ``status`` column (1: frozen).

        The column is created only once a structure is done: with it,
        nvalchemi's ``step`` takes its masked path every step (graph masks,
        saved and restored fields, masked output publishing), which costs
        about 0.6 ms per step on 32 x 108 atoms on a CPU; before it exists no
        structure is frozen, and the unmasked path computes the same numbers.
        """
        batch = self.batch
        if "status" not in batch:
            batch["status"] = torch.zeros(
                batch.num_graphs, 1, dtype=torch.long, device=batch.device
            )
        batch["status"][:, 0] = torch.from_numpy(done.astype(np.int64)).to(batch.device)

    def _largest_running_fmax(self) -> float:
        """Largest fmax among structures still running (all, once every one is done)."""
        running = ~self._converged_host & ~self._guard.known_mask
        chosen = self._fmax_host[running] if running.any() else self._fmax_host
        return float(chosen.max())

    def _threshold(self) -> float:
        if self.fmax is None:
            raise RuntimeError("fmax is set by run()/irun()")
        return self.fmax

    def _fmax_per_structure(self) -> torch.Tensor:
        """Largest force norm per structure, (B,), eV/Å (NaN propagates)."""
        if self._cell_coordinates is not None:
            return self._filter_fmax(self._cell_coordinates)
        batch = self.batch
        norms = torch.linalg.vector_norm(batch.forces.detach(), dim=1)
        # every structure has atoms: one segment of rows each
        fmax = torch.segment_reduce(norms, "max", offsets=batch.batch_ptr)
        if self.cell_filter is not None:
            fmax = torch.maximum(fmax, self._cell_fmax())
        return fmax

    def _filter_fmax(self, coordinates: CellFilterCoordinates) -> torch.Tensor:
        """ASE's fmax under its filter: largest row of ``filter.get_forces()``, (B,)."""
        rows_module = import_quietly("nvalchemi_ase.engines._rows")
        rows = rows_module.Rows(self.batch, coordinates)
        return rows.max(torch.linalg.vector_norm(rows.forces(), dim=1))

    def _cell_fmax(self) -> torch.Tensor:
        """Largest cell-force row, ``|σ V| / cell_factor`` (ASE's filters)."""
        batch = self.batch
        stress = batch.stress.detach()
        if self._filter_options is not None:  # the stress ASE's filter converges on
            stress = self._filter_options.effective_stress(stress)
        volume = torch.linalg.det(batch.cell.detach()).abs()
        virial = -volume[:, None, None] * stress
        cell_filter = self.cell_filter
        if cell_filter is None:
            raise RuntimeError("cell forces exist only under a cell filter")
        factor = cell_filter.cell_factor.to(virial.device, virial.dtype)
        return virial.norm(dim=2).amax(dim=1) / factor

    def _writing_mask(self) -> npt.NDArray[np.bool_]:
        return self._moving

    def _check_inputs(self) -> None:
        if self.cell_filter is None:
            return
        if "stress" not in self.model.model_config.outputs:
            raise ValueError(
                f"a cell filter needs stress, but {type(self.model).__name__} does not "
                "output it"
            )
        self._check_filter_constraints()
        for index, atoms in enumerate(self.images):
            if not self.filter_in_engine and np.linalg.det(atoms.cell.array) <= 0:
                raise ValueError(
                    f"images[{index}] has a left-handed cell; nvalchemi's "
                    "variable-cell "
                    "optimizers need right-handed cells (swap two lattice vectors)"
                )

    def default_skin(self) -> float:
        """Verlet skin of the neighbour list when none is given, Å."""
        return 0.0 if self.cell_filter is not None else super().default_skin()

    def default_failure_limits(self) -> FailureLimits:
        """No force limit, and displacements up to twice ``maxstep``.

        An optimizer with a ``maxstep`` caps every step, so a large force
        cannot blow a structure up: ASE's own FIRE in ASE's ``test_fire``
        (2x2x2 gold, ``maxstep=100``) passes through forces of 1.8e4 eV/Å and
        50 Å steps on its way to the minimum. Non-finite values still count,
        and so does a step longer than twice ``maxstep`` (the factor leaves
        room for a cell filter's strain of the positions).

        Returns
        -------
        FailureLimits
        """
        limits = super().default_failure_limits()
        maxstep = getattr(self, "maxstep", None)
        if maxstep is None:
            return limits
        return dataclasses.replace(
            limits,
            max_force=math.inf,
            max_displacement=max(limits.max_displacement, 2.0 * float(maxstep)),
        )

    def _engine_freezes_atoms(self) -> bool:
        """Under a filter FIRE, BFGS and MDMin keep frozen rows themselves.

        ASE's ``FixAtoms`` under a filter keeps an atom's filter row (its
        position in the undeformed cell), so the atom moves with the cell;
        nvalchemi's ``FreezeAtomsHook`` would hold its Cartesian position.
        """
        return self.filter_in_engine and self.cell_filter is not None

    def _adopt_new_constraints(self) -> None:
        self._check_filter_constraints()
        super()._adopt_new_constraints()

    def _check_filter_constraints(self) -> None:
        """Under a filter, FIRE, BFGS and MDMin honour ``FixAtoms`` only."""
        if not self._engine_freezes_atoms():
            return
        for index, atoms in enumerate(self.images):
            names = [
                type(c).__name__ for c in atoms.constraints if type(c) is not FixAtoms
            ]
            if names:
                raise ValueError(
                    f"images[{index}] has constraint {', '.join(names)}: "
                    f"{type(self).__name__} with a cell filter honours FixAtoms "
                    "only; remove it, or use ASE's own optimizer for this structure"
                )

    def engine_outputs(self) -> set[str]:
        """Model outputs every engine step needs (engine protocol)."""
        outputs = super().engine_outputs()
        if self.cell_filter is not None:
            outputs.add("stress")
        return outputs

    # -- logging ---------------------------------------------------------------

    def _setup_logging(self, logfile: Any) -> None:
        self._logs: list[Any] = []
        self._summary_log = None
        if not logfile:
            return
        if is_template(logfile):
            self._logs = [
                open_log(path)
                for path in per_structure_targets(logfile, len(self.images))
            ]
        elif len(self.images) == 1:
            self._logs = [open_log(logfile)]
        else:
            self._summary_log = open_log(logfile)

    def log(self, gradient: Any = None) -> None:
        """Write the step's log line(s), as ASE's ``Optimizer.log`` does."""
        name = type(self).__name__
        clock = time.localtime()
        if self._logs:
            rows = (
                np.flatnonzero(self._moving) if self.nsteps else range(len(self._logs))
            )
            for index in rows:
                _write_ase_line(
                    self._logs[index],
                    name,
                    self.nsteps,
                    clock,
                    self._energy_host[index],
                    self._fmax_host[index],
                )
        if self._summary_log is not None:
            self._write_summary(name, clock)

    def _write_summary(self, name: str, clock: time.struct_time) -> None:
        log = self._summary_log
        if log is None:
            return
        if self.nsteps == 0:
            log.write(
                "%s  %4s %8s %11s %15s  %12s\n"
                % (" " * len(name), "Step", "Time", "Converged", "Epot/N[eV]", "fmax")
            )
        natoms = np.array([len(atoms) for atoms in self.images])
        fmax = self._largest_running_fmax()
        log.write(
            "%s:  %3d %02d:%02d:%02d %5d/%-5d %15.6f %15.6f\n"
            % (
                name,
                self.nsteps,
                clock[3],
                clock[4],
                clock[5],
                int(self._converged_host.sum()),
                len(self.images),
                float(np.mean(self._energy_host / natoms)),
                float(fmax),
            )
        )


@functools.lru_cache(maxsize=16)
def _rounded(value: float, dtype: torch.dtype) -> float:
    """``value`` rounded to ``dtype``, as torch compares a tensor with a number."""
    return float(torch.tensor(value, dtype=dtype))


def _write_ase_line(
    log: Any,
    name: str,
    nsteps: int,
    clock: time.struct_time,
    energy: float,
    fmax: float,
) -> None:
    """One line of ASE's optimizer log (header first at step 0)."""
    if nsteps == 0:
        header = (" " * len(name), "Step", "Time", "Energy", "fmax")
        log.write("%s  %4s %8s %15s  %12s\n" % header)
    row = (name, nsteps, clock[3], clock[4], clock[5], energy, fmax)
    log.write("%s:  %3d %02d:%02d:%02d %15.6f %15.6f\n" % row)


def _each(values: Any, optimizer: BatchedOptimizer) -> list[Any]:
    """One array per structure: ``values`` itself for a single structure."""
    if not isinstance(optimizer.atoms, list):
        return [values]
    if len(values) != len(optimizer.images):
        raise ValueError(
            f"give one force (or gradient) array per structure: "
            f"{len(optimizer.images)} structures, {len(values)} arrays"
        )
    return list(values)
