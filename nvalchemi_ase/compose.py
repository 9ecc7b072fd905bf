"""Relax, then run MD, structure by structure, in one batch: ``optimizer + md``.

``FIRE(images) + Langevin(images, ...)`` (or ``optimizer.then(md, fmax=...,
md_steps=...)``) runs both algorithms on one batch with one model evaluation per
step, on nvalchemi's ``FusedStage``: every structure starts in the optimizer,
moves to MD as soon as its largest force drops to ``fmax``, and finishes after
``md_steps`` MD steps of its own, while the others go on. Each structure enters
MD with the momenta its ``Atoms`` had when the composition was made (zero if
none), not with the optimizer's fictitious velocities.

This module sits below ``nvalchemi_ase.md`` and ``nvalchemi_ase.optimize``
and imports neither: ``BatchedOptimizer.then`` imports it, and nothing leads
back. The parts are read through two protocols, :class:`OptimizerPart` and
:class:`MDPart`: the engine protocol of
:class:`~nvalchemi_ase.dynamics.base.BatchedDynamics` (``build_engine``,
``engine_outputs``) and the few public attributes the composition reads; a
class says which part it can play with its ``composition_role``
(``"optimizer"`` or ``"md"``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any, ClassVar, Protocol

import numpy as np
import numpy.typing as npt
import torch

from nvalchemi_ase._compat import ensure_bookkeeping_fields, ensure_substage_states
from nvalchemi_ase._quiet import import_quietly
from nvalchemi_ase.dynamics.base import BatchedDynamics
from nvalchemi_ase.dynamics.logs import internal, open_log
from nvalchemi_ase.typing import LogfileLike, TrajectoryLike

__all__ = [
    "FINISHED",
    "RELAXING",
    "RUNNING_MD",
    "MDPart",
    "OptimizerPart",
    "RelaxThenMD",
    "check_parts",
]

#: Stage codes of :attr:`RelaxThenMD.stage` (nvalchemi's ``status`` values).
RELAXING, RUNNING_MD, FINISHED = 0, 1, 2


class _Part(Protocol):
    """What ``optimizer + md`` and ``optimizer | md`` read of either part."""

    composition_role: ClassVar[str]
    images: list[Any]
    setup: Any
    nsteps: int
    neighbor_skin: float

    @property
    def model(self) -> Any:
        """The nvalchemi model both parts share."""

    def build_engine(self, hooks: list[Any]) -> Any:
        """Build a fresh nvalchemi engine with ``hooks`` (engine protocol)."""

    def engine_outputs(self) -> set[str]:
        """Model outputs every engine step needs (engine protocol)."""

    def todict(self) -> dict[str, Any]:
        """ASE's description of the part."""

    # what optimizer | md drives on each rank (BatchedDynamics' public API)
    trajectories: Any

    @property
    def failures(self) -> list[Any]:
        """Structures that failed: ``StructureFailure`` (index, step, reason)."""

    @property
    def failed_mask(self) -> npt.NDArray[np.bool_]:
        """Which structures failed, shape (B,)."""

    def attach(self, function: Any, interval: int = 1) -> None:
        """Attach an ASE observer."""

    def sync_structures(
        self, selected: npt.NDArray[np.bool_], *, results: bool = True
    ) -> None:
        """Write the ``selected`` structures' state into their ``Atoms``."""

    def per_structure_thermo(self) -> dict[str, npt.NDArray[np.float64]]:
        """Energies, atom counts and temperatures per structure."""

    def resizable(self) -> bool:
        """Whether ``resize`` can change the structures in place."""


class OptimizerPart(_Part, Protocol):
    """The relaxing part (``composition_role = "optimizer"``), fixed cell."""

    cell_filter: Any

    @property
    def converged_at_step(self) -> npt.NDArray[np.int64]:
        """Step at which each structure converged, -1 if not, shape (B,)."""

    @property
    def fmax_per_structure(self) -> npt.NDArray[np.float64]:
        """Latest largest force per structure, eV/Å, shape (B,)."""

    def irun(
        self, fmax: float = 0.05, steps: int = 1, *, sync_atoms: bool = True
    ) -> Iterator[bool]:
        """Relax as a generator (ASE's ``Optimizer.irun``)."""


class MDPart(_Part, Protocol):
    """The MD part (``composition_role = "md"``); ``dt`` in ASE time units."""

    dt: float

    @property
    def schedules(self) -> dict[str, Any]:
        """Targets that follow a schedule, by name (refused here)."""

    def irun(self, steps: int = 50, *, sync_atoms: bool = True) -> Iterator[bool]:
        """Run MD as a generator (ASE's ``MolecularDynamics.irun``)."""

    def parameter_table(self) -> dict[str, npt.NDArray[np.float64]]:
        """Per-structure arguments (``temperature_K``, ...), one value each."""

    def resize(
        self,
        keep: Any,
        images: list[Any],
        *,
        trajectories: list[Any] | None = None,
        parameters: dict[str, Any] | None = None,
    ) -> None:
        """Keep ``keep``, append ``images`` (with their ``parameters``), in place."""


class RelaxThenMD(BatchedDynamics):
    """An optimizer and an MD integrator fused: each structure relaxes, then runs MD.

    Parameters
    ----------
    optimizer : OptimizerPart
        Relaxes the structures (its parameters are used; it must not have run):
        one of this package's optimizers (``composition_role = "optimizer"``).
    md : MDPart
        Runs MD on the same ``Atoms`` objects (same model; must not have run):
        one of this package's MD classes (``composition_role = "md"``).
    fmax : float
        Force threshold, eV/Å, at which a structure moves from relaxation to MD
        (nvalchemi's criterion: largest atomic force norm <= fmax).
    md_steps : int, optional
        MD steps each structure runs after relaxing; None runs MD until
        ``run(steps)`` ends.
    trajectory, logfile, loginterval
        As for :class:`~nvalchemi_ase.dynamics.base.BatchedDynamics`; frames of
        every structure, whatever its stage. The log has one line per logged
        step: counts per stage, mean potential energy per atom and mean
        temperature of the structures in MD.
    restart, restart_interval, append_trajectory
        As for :class:`~nvalchemi_ase.dynamics.base.BatchedDynamics`: an
        existing checkpoint is continued from, bit for bit (each structure's
        stage, both engines' states and step counters, the per-stage step
        counts and the momenta each structure enters MD with).
    """

    _entry_velocities: torch.Tensor
    #: Checkpoint extras for the fused engine, loaded once it is primed.
    _pending_fused: dict[str, npt.NDArray[Any]] | None = None

    def __init__(
        self,
        optimizer: OptimizerPart,
        md: MDPart,
        *,
        fmax: float = 0.05,
        md_steps: int | None = None,
        trajectory: TrajectoryLike = None,
        logfile: LogfileLike = None,
        loginterval: int = 1,
        append_trajectory: bool = False,
        restart: str | os.PathLike[str] | None = None,
        restart_interval: int | None = None,
    ) -> None:
        check_parts(optimizer, md)
        if not fmax > 0:
            raise ValueError(f"fmax must be positive (eV/Å), got {fmax}")
        if md_steps is not None and md_steps < 1:
            raise ValueError(f"md_steps must be >= 1 or None, got {md_steps}")
        if md.schedules:
            raise ValueError(
                f"{type(md).__name__} follows a schedule ({', '.join(md.schedules)}), "
                "which counts the steps of the MD, but here each structure enters "
                "its MD at another step; relax first, then run the scheduled MD"
            )
        self.optimizer, self.md = optimizer, md
        self.fmax, self.md_steps = float(fmax), md_steps
        self.dt = md.dt
        super().__init__(
            md.images,
            logfile=logfile,
            trajectory=trajectory,
            loginterval=loginterval,
            model=md.model,
            device=md.setup.device,
            dtype=md.setup.dtype,
            neighbor_skin=min(optimizer.neighbor_skin, md.neighbor_skin),
            append_trajectory=append_trajectory,
            restart=restart,
            restart_interval=restart_interval,
        )
        ensure_bookkeeping_fields(self.engine, self.batch)
        self.batch["status"].zero_()  # a checkpoint's comes back after priming

    # -- ASE API ---------------------------------------------------------------

    @property
    def stage(self) -> npt.NDArray[np.int64]:
        """Stage of each structure, shape (B,): 0 relaxing, 1 in MD, 2 finished."""
        return self.batch["status"].detach().reshape(-1).cpu().numpy().copy()

    def todict(self) -> dict[str, Any]:
        """Both parts' descriptions and the hand-over parameters."""
        return {
            "type": "relax-then-md",
            "optimizer": self.optimizer.todict(),
            "md": self.md.todict(),
            "fmax": self.fmax,
            "md_steps": self.md_steps,
        }

    def get_time(self) -> float:
        """Elapsed time of the fused run, ASE time units (``nsteps * timestep``)."""
        return self.nsteps * self.dt

    def irun(self, steps: int = 100_000_000) -> Iterator[bool]:
        """Run as a generator; yields whether every structure has finished.

        Parameters
        ----------
        steps : int
            Limit on fused steps.

        Yields
        ------
        bool
            True once every structure has done its MD steps.
        """
        return self._irun(steps, sync_every_step=True)

    def run(self, steps: int = 100_000_000) -> bool:
        """Relax every structure, then run its MD, in one batch.

        Parameters
        ----------
        steps : int
            Limit on fused steps (each is one model evaluation for the batch).

        Returns
        -------
        bool
            True when every structure has relaxed and done ``md_steps`` MD steps.
        """
        done = False
        for done in self._irun(steps, sync_every_step=False):  # noqa: B007
            pass
        return done

    def _irun(self, steps: int, sync_every_step: bool) -> Iterator[bool]:
        if steps < 0:
            raise ValueError(f"steps must be >= 0, got {steps}")
        self.max_steps = self.nsteps + steps
        with self._running():
            self._prime()
            if self._fresh_start():
                self._sync_if(sync_every_step or self._observers_due(0))
                self.call_observers()
            done = self._all_finished()
            yield done
            while not done and self.nsteps < self.max_steps:
                self._advance()
                done = self._all_finished()
                self._sync_if(sync_every_step or self._observers_due(self.nsteps))
                self.call_observers()
                yield done

    # -- engine -------------------------------------------------------------------

    def _initial_batch(self) -> Any:
        batch = super()._initial_batch()
        if hasattr(self, "_entry_velocities"):  # re-read after the user changed atoms
            self._entry_velocities.copy_(batch.velocities)
        else:
            self._entry_velocities = batch.velocities.detach().clone()
        batch.velocities.zero_()  # the optimizer's velocities start at rest
        return batch

    def build_engine(self, hooks: list[Any]) -> Any:
        """Build the nvalchemi engine (engine protocol, see ``BatchedDynamics``)."""
        dynamics = import_quietly("nvalchemi.dynamics")
        relax = self.optimizer.build_engine([])
        relax.convergence_hook = dynamics.ConvergenceHook.from_fmax(threshold=self.fmax)
        integrate = self.md.build_engine([])
        integrate.n_steps = self.md_steps
        stages = dynamics.DynamicsStage
        entry = _EnterMDWithInitialMomenta(self._entry_velocities, stages.BEFORE_STEP)
        return dynamics.FusedStage(
            sub_stages=[(RELAXING, relax), (RUNNING_MD, integrate)],
            hooks=[*hooks, entry],
        )

    def engine_outputs(self) -> set[str]:
        """Model outputs every engine step needs (engine protocol)."""
        outputs = set(self.optimizer.engine_outputs()) | set(self.md.engine_outputs())
        return outputs

    def _momenta_mask(self) -> npt.NDArray[np.bool_]:
        """Structures whose velocities are MD's: those that took an MD step.

        A structure that has just converged is already in stage 1, but its
        velocities are the optimizer's until its first MD step gives it its
        entry momenta; until then its ``Atoms`` (and frames) keep their own.
        """
        if "status" not in self.batch:  # restoring, before the engine's columns
            return np.zeros(len(self.images), dtype=bool)
        entered = self._entry_hook().entered
        if entered is None:
            return np.zeros(len(self.images), dtype=bool)
        return entered.detach().cpu().numpy().astype(bool)

    # -- checkpoints (restart=) ------------------------------------------------

    def _checkpoint_extras(self) -> dict[str, npt.NDArray[Any]]:
        """Return the base extras and the fused engine's (entry momenta, counters)."""
        extras = super()._checkpoint_extras()
        extras["fused/entry_velocities"] = _host(self._entry_velocities)
        entered = self._entry_hook().entered
        if entered is not None:
            extras["fused/entered"] = _host(entered)
        for code, sub_stage in self.engine.sub_stages:
            counter = f"n_steps_counter_{code}"
            if counter in self.batch:
                extras[f"fused/{counter}"] = _host(self.batch[counter])
            state = sub_stage.state_dict()
            extras[f"fused/{code}/step_count"] = np.asarray(state["step_count"])
            if state.get("random_seed") is not None:
                extras[f"fused/{code}/random_seed"] = np.asarray(state["random_seed"])
            for key, value in state["state"].items():
                extras[f"fused/{code}/state/{key}"] = _host(value)
        return extras

    def _restore_checkpoint_extras(self, extras: dict[str, npt.NDArray[Any]]) -> None:
        """Take the entry momenta now, the engine's state once it is primed."""
        super()._restore_checkpoint_extras(extras)
        fused = {
            key.removeprefix("fused/"): value
            for key, value in extras.items()
            if key.startswith("fused/")
        }
        if "entry_velocities" in fused:
            with torch.no_grad():
                self._entry_velocities.copy_(
                    torch.as_tensor(fused["entry_velocities"]).to(
                        self._entry_velocities
                    )
                )
        self._pending_fused = fused

    def _after_priming(self) -> None:
        super()._after_priming()
        fused, self._pending_fused = self._pending_fused, None
        if fused is None:
            return
        batch, device = self.batch, self.batch.device
        ensure_bookkeeping_fields(self.engine, batch)
        ensure_substage_states(self.engine, batch)
        for code, sub_stage in self.engine.sub_stages:
            counter = f"n_steps_counter_{code}"
            if counter in fused and counter in batch:
                with torch.no_grad():
                    batch[counter].copy_(torch.as_tensor(fused[counter], device=device))
            prefix = f"{code}/state/"
            state: dict[str, Any] = {
                "step_count": int(fused.get(f"{code}/step_count", 0)),
                "state": {
                    key.removeprefix(prefix): torch.as_tensor(value, device=device)
                    for key, value in fused.items()
                    if key.startswith(prefix)
                },
            }
            if f"{code}/random_seed" in fused:
                state["random_seed"] = int(fused[f"{code}/random_seed"])
            sub_stage.load_state_dict(state)
        if "entered" in fused:
            self._entry_hook().entered = torch.as_tensor(
                fused["entered"], device=device
            )

    def _entry_hook(self) -> _EnterMDWithInitialMomenta:
        for hook in self.engine.hooks:
            if isinstance(hook, _EnterMDWithInitialMomenta):
                return hook
        raise RuntimeError("RelaxThenMD: the engine lost its MD entry hook")

    def _failed_status(self) -> int:
        return FINISHED

    def _all_finished(self) -> bool:
        return bool((self.batch["status"] >= FINISHED).all())

    # -- logging ----------------------------------------------------------------

    def _setup_logging(self, logfile: Any) -> None:
        if not logfile:
            return
        log = open_log(logfile)
        if not self._continued:  # a continued run: the header is there
            log.write(
                "%-9s %6s %6s %6s %12s %8s\n"
                % ("Time[ps]", "relax", "md", "done", "Epot/N[eV]", "T_md[K]")
            )
        self.attach(internal(self._write_log), self.loginterval, log)

    def _write_log(self, log: Any) -> None:
        from nvalchemi_ase.units import ase_time_to_ps

        thermo = self.per_structure_thermo()
        stage = self.stage
        in_md = stage == RUNNING_MD
        temperature = thermo["temperature"][in_md].mean() if in_md.any() else 0.0
        log.write(
            "%-10.4f %6d %6d %6d %12.6f %8.1f\n"
            % (
                ase_time_to_ps(self.get_time()),
                int((stage == RELAXING).sum()),
                int(in_md.sum()),
                int((stage >= FINISHED).sum()),
                float(np.mean(thermo["epot"] / thermo["natoms"])),
                temperature,
            )
        )


class _EnterMDWithInitialMomenta:
    """nvalchemi hook: structures entering MD get their initial velocities back.

    Runs at ``BEFORE_STEP`` on the fused stage, with tensor operations only (no
    host synchronisation).
    """

    frequency = 1

    def __init__(self, initial_velocities: torch.Tensor, stage: Any) -> None:
        self.stage = stage
        self._initial = initial_velocities
        self.entered: torch.Tensor | None = None

    def __call__(self, ctx: Any, stage: Any) -> None:
        batch = ctx.batch
        in_md = batch["status"].reshape(-1) >= RUNNING_MD
        if self.entered is None:
            self.entered = torch.zeros_like(in_md)
        entering = (in_md & ~self.entered)[batch.batch_idx.long()]
        with torch.no_grad():
            velocities = batch.velocities
            velocities.copy_(torch.where(entering[:, None], self._initial, velocities))
        self.entered = self.entered | in_md


def _host(value: torch.Tensor) -> npt.NDArray[Any]:
    return value.detach().cpu().numpy().copy()


def check_parts(optimizer: Any, md: Any, *, operator: str = "+") -> None:
    """Refuse an optimizer and an MD object that cannot be composed (``+`` or ``|``).

    Raises
    ------
    TypeError
        If they are not this package's optimizer and MD classes.
    ValueError
        If they run different ``Atoms`` or models, relax the cell, or have run.
    """
    if (
        getattr(optimizer, "composition_role", None) != "optimizer"
        or getattr(md, "composition_role", None) != "md"
    ):
        raise TypeError(
            f"relax {operator} md needs an nvalchemi_ase optimizer followed by an "
            f"nvalchemi_ase MD object, got {type(optimizer).__name__} {operator} "
            f"{type(md).__name__}"
        )
    if len(optimizer.images) != len(md.images) or any(
        a is not b for a, b in zip(optimizer.images, md.images, strict=True)
    ):
        raise ValueError(
            "the optimizer and the MD object must run the same Atoms objects, in the "
            "same order"
        )
    if optimizer.model is not md.model:
        raise ValueError("the optimizer and the MD object must share one model")
    if optimizer.cell_filter is not None:
        raise ValueError(f"relax {operator} md supports fixed-cell relaxation only")
    if optimizer.nsteps or md.nsteps:
        raise ValueError("compose the optimizer and the MD object before running them")
    for index, atoms in enumerate(md.images):
        rigid = [c for c in atoms.constraints if type(c).__name__ in _RIGID]
        if rigid:
            raise ValueError(
                f"images[{index}] has constraint {type(rigid[0]).__name__}: relax "
                f"{operator} md applies one set of constraint hooks to both stages, "
                "and this one is applied differently in optimizers and MD; run the "
                "optimizer and the MD one after the other"
            )


#: RATTLE-type constraints, applied differently by optimizers and MD.
_RIGID = ("FixBondLengths", "FixLinearTriatomic")
