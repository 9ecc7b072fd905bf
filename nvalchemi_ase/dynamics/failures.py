"""Failure isolation: one structure that blows up costs that structure only.

A batched engine evolves B structures at once; without a guard, one structure
whose forces turn NaN (or that flies apart) silently poisons its own state, and a
hook that raises on it (nvalchemi's ``NaNDetectorHook``) stops all B. Here every
dynamics object carries a :class:`FailureGuard`, three small nvalchemi hooks
that work on the device with tensor operations only:

* ``BEFORE_STEP``: snapshot positions, velocities, cell, energy, forces and
  stress of every structure (the last state known to be good);
* ``AFTER_COMPUTE`` and ``AFTER_STEP``: flag each structure whose state crossed
  one of the :class:`FailureLimits` (always: non-finite positions, velocities,
  cell, energy or forces), remember the ASE step and the reason, and put every
  flagged structure back to its snapshot.

A flagged structure therefore keeps its last finite state while the others go
on. Flags are read back to the host only where the dynamics object reads the
batch anyway (optimizers every step, for convergence; MD at observer and log
steps and at the end of a run; every step on a CPU, where a read costs
nothing); from then on the structure is frozen with nvalchemi's own ``status``
mechanism, reported in ``dyn.failures`` and warned about once
(:class:`StructureFailedWarning`). With ``on_failure="raise"`` the first
failure read back raises :class:`DynamicsFailureError` instead.
"""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import numpy.typing as npt
import torch

from nvalchemi_ase import devices
from nvalchemi_ase.convert import batch_field
from nvalchemi_ase.dynamics.hooks import StageHook

if TYPE_CHECKING:
    from nvalchemi.data import Batch

__all__ = [
    "CONSTRAINTS_DID_NOT_CONVERGE",
    "FAILURE_REASONS",
    "DynamicsFailureError",
    "FailureGuard",
    "FailureLimits",
    "OnFailure",
    "RoutedHook",
    "StructureFailedWarning",
    "StructureFailure",
    "resolve_on_failure",
]

#: What to do when a structure fails: keep going without it, or raise.
OnFailure = Literal["isolate", "raise"]

#: Reason codes stored on the device, and their text.
FAILURE_REASONS: dict[int, str] = {
    1: "positions became non-finite",
    2: "velocities became non-finite",
    3: "the cell became non-finite",
    4: "the energy became non-finite",
    5: "forces became non-finite",
    6: "the largest force exceeded max_force",
    7: "an atom moved more than max_displacement in one step",
    8: "the cell volume changed by more than max_volume_factor",
    9: "its bond constraints (FixBondLengths) did not converge within maxiter "
    "iterations",
}

#: Reason code of a structure whose RATTLE-type constraints did not converge.
CONSTRAINTS_DID_NOT_CONVERGE = 9

# Fields restored from the snapshot (the state the next step depends on).
_ATOM_FIELDS = ("positions", "velocities", "forces")
_SYSTEM_FIELDS = ("cell", "energy", "stress")

# Fields the quick test reads (a cell's volume with the cell).
_CHECKED_FIELDS = ("positions", "velocities", "forces", "cell", "energy")

# A largest component below limit * _COMPONENT_BOUND keeps the norm below the
# limit, with room for the round-off of the exact test's sum of squares.
_COMPONENT_BOUND = (1.0 - 1e-6) / math.sqrt(3.0)
_FINITE = (-sys.float_info.max, sys.float_info.max)


@dataclass(frozen=True)
class FailureLimits:
    """Documented limits past which a structure counts as exploded.

    Non-finite positions, velocities, cell, energy or forces always count.

    Attributes
    ----------
    max_force : float
        Largest atomic force norm, eV/Å (default 1e4). At 1e4 eV/Å a hydrogen
        atom moves about 50 Å in one 1 fs step: no integrator can follow such
        a structure. Optimizers with a ``maxstep`` default to no limit (their
        steps are capped whatever the force; ``math.inf``).
    max_displacement : float
        Largest distance one atom may move in one step, Å (default 2.0). MD
        steps move atoms by ~0.01-0.1 Å; 2 Å per step means the trajectory has
        stopped being physical. Optimizers default to the larger of 2 Å and
        twice their ``maxstep`` (ASE's default 0.2 Å; ASE's own tests use up
        to 100 Å). When the cell moves, the distance is the atom's own, past
        the step's homogeneous strain (``x_old L_old⁻¹ L_new``), which the
        volume limit bounds: a cell filter's strain step moves a large cell's
        far atoms by many Å.
    max_volume_factor : float
        Largest factor by which the cell volume may grow or shrink over a run
        relative to its start (default 4.0; variable-cell runs only can reach it).
    """

    max_force: float = 1e4
    max_displacement: float = 2.0
    max_volume_factor: float = 4.0

    def __post_init__(self) -> None:
        for name in ("max_force", "max_displacement", "max_volume_factor"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError(f"FailureLimits.{name} must be a number, got {value!r}")
            if not value > 0:
                raise ValueError(f"FailureLimits.{name} must be positive, got {value}")
        if not self.max_volume_factor > 1:
            raise ValueError(
                "FailureLimits.max_volume_factor must be > 1, got "
                f"{self.max_volume_factor}"
            )


@dataclass(frozen=True)
class StructureFailure:
    """One structure that failed.

    Attributes
    ----------
    index : int
        Position of the structure in the dynamics object's ``images``.
    step : int
        ASE step (``nsteps``) whose result was rejected; the structure holds
        the state of step ``step - 1`` (0: the initial evaluation was rejected
        and the structure never moved).
    reason : str
        What was wrong (see :data:`FAILURE_REASONS`).
    restored : bool
        Whether the structure was put back to its state of step ``step - 1``;
        False when the evaluation rejected followed no step (a later run's
        first evaluation, or its own first after a ``resize`` admitted it):
        it keeps the state it was given.
    """

    index: int
    step: int
    reason: str
    restored: bool = True

    def __str__(self) -> str:
        if self.step == 0:
            kept = "its input state"
        elif self.restored:
            kept = f"its state of step {self.step - 1}"
        else:
            kept = "the state it was given"
        return (
            f"images[{self.index}] failed at step {self.step}: {self.reason}; "
            f"it keeps {kept}"
        )


class StructureFailedWarning(UserWarning):
    """A structure of a batched run failed and stopped; the others go on."""


class DynamicsFailureError(RuntimeError):
    """Raised with ``on_failure="raise"`` when a structure fails.

    Attributes
    ----------
    failures : list of StructureFailure
        Every failure known when it was raised.
    """

    def __init__(self, failures: list[StructureFailure]) -> None:
        self.failures = list(failures)
        text = "; ".join(str(failure) for failure in self.failures)
        super().__init__(
            f"{text} (on_failure='raise'; pass on_failure='isolate' to let the other "
            "structures go on)"
        )


def resolve_on_failure(value: Any) -> OnFailure:
    """Validate the ``on_failure`` argument.

    Parameters
    ----------
    value : str
        ``"isolate"`` or ``"raise"``.

    Returns
    -------
    str
        The same value.

    Raises
    ------
    ValueError
        For anything else.
    """
    if value not in ("isolate", "raise"):
        raise ValueError(
            f"on_failure must be 'isolate' (a failed structure stops, the others go "
            f"on) or 'raise', got {value!r}"
        )
    return value  # type: ignore[no-any-return]


class FailureGuard:
    """Per-structure failure flags and the hooks that keep them, on the device.

    Parameters
    ----------
    batch : nvalchemi.data.Batch
        The batch of the run (B graphs), with its initial state.
    limits : FailureLimits
        When a structure counts as exploded.
    ase_step : callable
        Returns the ASE step the engine is currently computing.
    variable_cell : bool
        Whether the engine moves cells (only then is the volume checked); may
        be set later, once the engine is known.

    Notes
    -----
    On a CPU, where reading a number back costs nothing, each check first asks
    whether anything at all is off in the batch (a few whole-batch reductions)
    and skips the per-structure work when nothing is, and structures are put
    back only once one has failed. On an accelerator every check runs in full
    with tensor operations only, so it never synchronises.
    """

    def __init__(
        self,
        batch: Batch,
        limits: FailureLimits,
        ase_step: Callable[[], int],
        *,
        variable_cell: bool = True,
    ) -> None:
        count = batch.num_graphs
        device = batch.device
        self.limits = limits
        self._ase_step = ase_step
        self.variable_cell = variable_cell
        self._host_branching = devices.host_reads_are_free(device)
        self._any_failed = False
        self.failed = torch.zeros(count, dtype=torch.bool, device=device)
        self.step = torch.full((count,), -1, dtype=torch.long, device=device)
        self.code = torch.zeros(count, dtype=torch.long, device=device)
        #: Whether each failed structure was put back to its state before
        #: the step (False: rejected at an evaluation that followed no step).
        self.restored = torch.zeros(count, dtype=torch.bool, device=device)
        self._volume0 = _volumes(batch)
        self._snapshot: dict[str, torch.Tensor] = {}
        self._has_snapshot = False
        self._known = np.zeros(count, dtype=bool)
        self._own_hooks: list[StageHook] = []
        #: What may change the batch between the ``AFTER_COMPUTE`` check and
        #: ``AFTER_STEP`` (set by the dynamics object that knows its engine and
        #: hooks): None, anything (the whole check again); else the fields
        #: that may change (empty: nothing, so the check would repeat itself
        #: and is skipped; else the quick test covers those fields only).
        self.changes_after_compute: Callable[[], tuple[str, ...] | None] = (
            _anything_may_change
        )

    # -- hooks ------------------------------------------------------------------

    def hooks(self, stages: Any) -> list[StageHook]:
        """Return the three hooks for ``DynamicsStage`` ``stages`` (register first)."""
        hooks = [
            StageHook(stages.BEFORE_STEP, self.take_snapshot),
            StageHook(stages.AFTER_COMPUTE, self.check),
            StageHook(stages.AFTER_STEP, self.check_after_step),
        ]
        self._own_hooks += hooks
        return hooks

    def owns(self, hook: object) -> bool:
        """Whether ``hook`` is one of this guard's (:meth:`hooks`)."""
        return any(hook is own for own in self._own_hooks)

    def take_snapshot(self, batch: Batch) -> None:
        """Remember the state every structure has before the step."""
        with torch.no_grad():
            for key in (*_ATOM_FIELDS, *_SYSTEM_FIELDS):
                value = batch_field(batch, key)
                if value is None:
                    continue
                saved = self._snapshot.get(key)
                if saved is None or saved.shape != value.shape:
                    self._snapshot[key] = value.detach().clone()
                else:
                    saved.copy_(value)
        self._has_snapshot = True

    def check(self, batch: Batch) -> None:
        """Flag structures past the limits; put every flagged one back."""
        with torch.no_grad():
            if not (self._host_branching and self._all_within_limits(batch)):
                self._record(self._reason_codes(batch))
            if self._any_failed or not self._host_branching:
                self._restore(batch)

    def check_after_step(self, batch: Batch) -> None:
        """:meth:`check` at ``AFTER_STEP``, over what changed since ``AFTER_COMPUTE``.

        The ``AFTER_COMPUTE`` check has seen every field as the step left it,
        except what the engine's ``post_update`` and the hooks after that
        check may change (:attr:`changes_after_compute`): nothing (an
        optimizer's step is done before the evaluation), and the check is
        skipped; some fields (velocity Verlet's second half kick changes
        velocities only), and the quick whole-batch test reads those alone
        (the exact test, when it fails, reads everything as before); or
        anything, and the check runs in full.
        """
        changed = self.changes_after_compute()
        if changed is None:
            self.check(batch)
        elif changed:
            with torch.no_grad():
                if not (
                    self._host_branching and self._all_within_limits(batch, changed)
                ):
                    self._record(self._reason_codes(batch))
                if self._any_failed or not self._host_branching:
                    self._restore(batch)

    def flag(self, bad: torch.Tensor, code: int) -> None:
        """Flag structures ``bad`` [B] bool as failed for reason ``code``.

        For failures found by other hooks (constraints that did not
        converge); the structures are put back at the next check, as if the
        guard had found them.
        """
        with torch.no_grad():
            self._record(torch.where(bad, code, 0))

    def routed(self, hook: Any) -> RoutedHook:
        """Return ``hook`` (a user's nvalchemi hook) seeing only live structures."""
        return hook if isinstance(hook, RoutedHook) else RoutedHook(hook, self)

    def check_now(self, batch: Batch) -> torch.Tensor:
        """Check ``batch`` at once (the error path of a :class:`RoutedHook`).

        Returns
        -------
        torch.Tensor, shape (B,), bool
            The flags afterwards (read back once: the host knows of them).
        """
        with torch.no_grad():
            self._record(self._reason_codes(batch))
            self._restore(batch)
            self._any_failed = bool(self.failed.any())  # one read: error path only
        return self.failed

    @property
    def failures_on_host(self) -> bool:
        """Whether the host knows of a flagged structure (no device read)."""
        return self._any_failed or bool(self._known.any())

    def forget_snapshot(self) -> None:
        """Drop the snapshot before a (re-)evaluation that follows no step.

        The evaluation that primes a run is checked like any other, but a
        structure it rejects has nothing to go back to: it keeps the state it
        was given and never moves.
        """
        self._has_snapshot = False

    def put_back(self) -> torch.Tensor:
        """Return which structures the latest check put back, shape (B,), bool.

        Every failed structure once a step has been taken (its snapshot);
        none at an evaluation that follows no step (a run's priming), where
        a structure the check rejects keeps the state it was given and the
        outputs the model gave for it.
        """
        return self.failed if self._has_snapshot else torch.zeros_like(self.failed)

    def reset_volumes(self, batch: Batch) -> None:
        """Take the batch's current cells as the reference for the volume limit."""
        self._volume0 = _volumes(batch)

    def state(self) -> dict[str, torch.Tensor]:
        """Return flags, failure steps, reasons and reference volumes (checkpoints).

        Returns
        -------
        dict of torch.Tensor, each shape (B,)
            ``failed`` and ``restored`` (bool), ``step`` and ``code`` (int64),
            ``volume0`` (Å³).
        """
        return {
            "failed": self.failed.clone(),
            "restored": self.restored.clone(),
            "step": self.step.clone(),
            "code": self.code.clone(),
            "volume0": self._volume0.clone(),
        }

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        """Take back what :meth:`state` returned; the failures count as unread."""
        device = self.failed.device
        self.failed = state["failed"].to(device=device, dtype=torch.bool)
        # checkpoints written before the flag existed: every failure put back
        restored = state.get("restored", self.failed)
        self.restored = restored.to(device=device, dtype=torch.bool)
        self.step = state["step"].to(device=device, dtype=torch.long)
        self.code = state["code"].to(device=device, dtype=torch.long)
        self._volume0 = state["volume0"].to(device=device, dtype=self._volume0.dtype)
        self._any_failed = bool(self.failed.any())
        self._known[:] = False

    def resize(self, kept: torch.Tensor, batch: Batch) -> None:
        """Follow a batch resized in place: rows ``kept`` lead, arrivals follow.

        Parameters
        ----------
        kept : torch.Tensor
            Indices (long) of the structures that stay, in their new order.
        batch : Batch
            The resized batch; the structures after the kept ones are new
            (no failure, their current cells the volume reference).
        """
        count = batch.num_graphs
        n_kept = int(kept.numel())
        device = self.failed.device
        kept = kept.to(device)

        def grown(old: torch.Tensor, fill: float) -> torch.Tensor:
            fresh = torch.full((count,), fill, dtype=old.dtype, device=device)
            fresh[:n_kept] = old.index_select(0, kept)
            return fresh

        self.failed = grown(self.failed, False)
        self.restored = grown(self.restored, False)
        self.step = grown(self.step, -1)
        self.code = grown(self.code, 0)
        volume0 = _volumes(batch)
        volume0[:n_kept] = self._volume0.index_select(0, kept)
        self._volume0 = volume0
        known = np.zeros(count, dtype=bool)
        known[:n_kept] = self._known[kept.cpu().numpy()]
        self._known = known
        self._any_failed = bool(self.failed.any())
        self._snapshot = {}
        self._has_snapshot = False

    # -- host side ----------------------------------------------------------------

    def new_failures(
        self, failed_host: npt.NDArray[np.bool_] | None = None
    ) -> list[StructureFailure]:
        """Failures not reported before (reads the flags back to the host).

        Parameters
        ----------
        failed_host : numpy.ndarray, optional
            The failed flags if the caller has already read them (saves a
            transfer when nothing new failed).

        Returns
        -------
        list of StructureFailure
            Newly known failures, by index.
        """
        if self._host_branching and not self._any_failed:
            return []  # a CPU's checks keep `_any_failed`: nothing is flagged
        failed = self.failed.cpu().numpy() if failed_host is None else failed_host
        fresh = np.flatnonzero(failed & ~self._known)
        if not fresh.size:
            return []
        steps = self.step.cpu().numpy()
        codes = self.code.cpu().numpy()
        restored = self.restored.cpu().numpy()
        self._known[fresh] = True
        return [
            StructureFailure(
                index=int(i),
                step=int(steps[i]),
                reason=_reason_text(int(codes[i]), self.limits),
                restored=bool(restored[i]),
            )
            for i in fresh
        ]

    @property
    def none_failed(self) -> bool:
        """Whether the host knows that no structure has failed so far.

        Only a CPU run keeps this on the host (its checks read a flag back);
        on an accelerator it is always False, so a caller branching on it
        never synchronises and falls back to its tensor-only path.
        """
        return self._host_branching and not self._any_failed

    @property
    def known_mask(self) -> npt.NDArray[np.bool_]:
        """Structures whose failure has been read back, shape (B,) (a copy)."""
        return self._known.copy()

    # -- internals ---------------------------------------------------------------

    def _all_within_limits(
        self, batch: Batch, fields: tuple[str, ...] = _CHECKED_FIELDS
    ) -> bool:
        """Whole-batch test that nothing is off (host branch; CPU only).

        A cheap sufficient test first (:meth:`_clearly_within_limits`, over
        ``fields``, the others known to be within limits); only when it
        fails does the exact whole-batch test decide, so the answer is always
        the exact test's.
        """
        return self._clearly_within_limits(batch, fields) or self._within_limits(batch)

    def _clearly_within_limits(
        self, batch: Batch, fields: tuple[str, ...] = _CHECKED_FIELDS
    ) -> bool:
        """One reduction per field and one read back; True implies the exact test's.

        A sum is finite only if every element is (an overflow only sends the
        batch to the exact test), so is a step from the snapshot only if the
        positions are, and the largest force and step component bound the
        norms: ``|v| <= sqrt(3) max|v_i|``. Only ``fields`` are read (the
        others unchanged since they passed).
        """
        previous = None  # a moved cell moves the step measured (see _carried)
        if ("positions" in fields or "cell" in fields) and self._has_snapshot:
            previous = self._snapshot.get("positions")
            if previous is not None and not previous.numel():
                previous = None
        summed: list[str] = [
            key for key in ("velocities", "cell", "energy") if key in fields
        ]
        if previous is None and "positions" in fields:
            summed.append("positions")
        values: list[torch.Tensor] = []
        ranges: list[tuple[float, float]] = []  # closed; NaN is in none
        for key in summed:
            value = batch_field(batch, key)
            if value is not None:
                values.append(value.sum())
                ranges.append(_FINITE)
        forces = batch_field(batch, "forces") if "forces" in fields else None
        if forces is not None and forces.numel():
            bound = _finite_bound(self.limits.max_force)
            values += torch.aminmax(forces)
            ranges += [(-bound, bound)] * 2
        if previous is not None:
            bound = _finite_bound(self.limits.max_displacement)
            values += torch.aminmax(batch.positions - self._carried(batch, previous))
            ranges += [(-bound, bound)] * 2
        if self.variable_cell and "cell" in fields:
            ratio = _volumes(batch) / self._volume0
            factor = self.limits.max_volume_factor
            values += torch.aminmax(ratio)
            ranges += [(1.0 / factor, factor)] * 2
        if not values:
            return True
        read = torch.stack(values).tolist()  # dtypes promote exactly
        return all(
            lower <= value <= upper
            for value, (lower, upper) in zip(read, ranges, strict=True)
        )

    def _within_limits(self, batch: Batch) -> bool:
        """Test the whole batch exactly: a structure may be off only if this fails."""
        for key in ("positions", "velocities", "forces", "cell", "energy"):
            value = batch_field(batch, key)
            if value is not None and not bool(torch.isfinite(value).all()):
                return False
        forces = batch_field(batch, "forces")
        if forces is not None and forces.numel():
            largest = float((forces * forces).sum(dim=1).max())
            if largest > self.limits.max_force**2:
                return False
        previous = self._snapshot.get("positions") if self._has_snapshot else None
        if previous is not None and previous.numel():
            delta = batch.positions - self._carried(batch, previous)
            largest = float((delta * delta).sum(dim=1).max())
            if largest > self.limits.max_displacement**2:
                return False  # or a periodic wrap: the full check tells
        if self.variable_cell:
            ratio = _volumes(batch) / self._volume0
            factor = self.limits.max_volume_factor
            if bool(((ratio > factor) | (ratio < 1.0 / factor)).any()):
                return False
        return True

    def _carried(self, batch: Batch, previous: torch.Tensor) -> torch.Tensor:
        """``previous`` positions [V, 3] carried along by the step's cell change.

        With a moving cell the displacement checked is the atoms' own, past
        the homogeneous strain: a cell filter's step strains a large cell's
        far atoms by many Å (ASE's ``StrainFilter`` moves nothing else), which
        the volume limit bounds; ``x_old L_old⁻¹ L_new`` is where the strain
        alone takes an atom.
        """
        old_cell = self._snapshot.get("cell") if self.variable_cell else None
        if old_cell is None or old_cell.shape != batch.cell.shape:
            return previous
        index = batch.batch_idx.long()
        old = old_cell.reshape(-1, 3, 3)
        new = batch.cell.detach().reshape(-1, 3, 3)
        solved = torch.linalg.solve_ex(old, new)  # L_old⁻¹ L_new, [B, 3, 3]
        # an unchanged, singular (molecule) or non-finite cell: no strain
        keep = (old == new).all(dim=(1, 2)) | (solved.info != 0)
        keep |= ~torch.isfinite(solved.result).all(dim=(1, 2))
        identity = torch.eye(3, dtype=old.dtype, device=old.device)
        strain = torch.where(keep[:, None, None], identity, solved.result)
        return torch.einsum("vj,vjk->vk", previous, strain[index])

    def _reason_codes(self, batch: Batch) -> torch.Tensor:
        """Per-structure reason code [B] (0: fine), highest-priority reason first."""
        index = batch.batch_idx.long()
        count = batch.num_graphs
        checks: list[tuple[int, torch.Tensor]] = []
        for code, key in ((1, "positions"), (2, "velocities"), (5, "forces")):
            value = batch_field(batch, key)
            if value is not None:
                bad_atom = ~torch.isfinite(value.detach()).all(dim=1)
                checks.append((code, _any_per_graph(bad_atom, index, count)))
        for code, key in ((3, "cell"), (4, "energy")):
            value = batch_field(batch, key)
            if value is not None:
                flat = value.detach().reshape(count, -1)
                checks.append((code, ~torch.isfinite(flat).all(dim=1)))
        forces = batch_field(batch, "forces")
        if forces is not None:
            norms = torch.nan_to_num(forces.detach().norm(dim=1), nan=0.0)
            checks.append(
                (6, _max_per_graph(norms, index, count) > self.limits.max_force)
            )
        previous = self._snapshot.get("positions") if self._has_snapshot else None
        if previous is not None and previous.shape == batch.positions.shape:
            step = _displacements(batch, self._carried(batch, previous))
            checks.append(
                (7, _max_per_graph(step, index, count) > self.limits.max_displacement)
            )
        if self.variable_cell:
            ratio = _volumes(batch) / self._volume0
            factor = self.limits.max_volume_factor
            checks.append((8, (ratio > factor) | (ratio < 1.0 / factor)))
        codes = torch.zeros(count, dtype=torch.long, device=batch.device)
        for reason, bad in reversed(checks):
            codes = torch.where(bad, reason, codes)
        return codes

    def _record(self, code: torch.Tensor) -> None:
        newly = (code > 0) & ~self.failed
        self.step = torch.where(newly, self._ase_step(), self.step)
        self.code = torch.where(newly, code, self.code)
        self.failed |= newly
        if self._has_snapshot:  # _restore puts them back
            self.restored |= newly
        if self._host_branching:
            self._any_failed = bool(self.failed.any())

    def _restore(self, batch: Batch) -> None:
        if not self._has_snapshot:
            return
        per_atom = self.failed[batch.batch_idx.long()]
        for key, saved in self._snapshot.items():
            target = batch_field(batch, key)
            if target is None or target.shape != saved.shape:
                continue
            mask = per_atom if key in _ATOM_FIELDS else self.failed
            mask = mask.view(-1, *([1] * (target.dim() - 1)))
            target.copy_(torch.where(mask, saved, target))


class RoutedHook:
    """A user's nvalchemi hook routed into the per-structure failure handling.

    nvalchemi's own safety hooks (``NaNDetectorHook``, and any hook that
    honours ``ctx.active_graph_mask``) stop the whole batch when they see a
    non-finite value. Attached to a dynamics object of this package
    (``dyn.attach(NaNDetectorHook())``), a hook is wrapped in this class: it
    is called with a context whose ``active_graph_mask`` leaves out the
    structures the :class:`FailureGuard` has flagged (once the host knows of
    one; until then the context is nvalchemi's own), so a structure that
    failed (even in the evaluation that primes a run, where there is no
    earlier state to put back) is reported in ``dyn.failures`` and frozen
    while the others go on. If the hook raises all the same (it ignores the
    mask), the guard checks the batch at once; when that flags a structure
    not flagged before, the hook is called again without it, and only an
    error that remains is raised.

    Parameters
    ----------
    hook : nvalchemi Hook
        The user's hook (``stage``, ``frequency``, ``__call__(ctx, stage)``).
    guard : FailureGuard
        The dynamics object's guard.

    Attributes
    ----------
    hook : nvalchemi Hook
        The wrapped hook; other attributes are read from it.
    """

    def __init__(self, hook: Any, guard: FailureGuard) -> None:
        self.hook = hook
        self.guard = guard
        self.stage = hook.stage
        self.frequency = hook.frequency

    def __getattr__(self, name: str) -> Any:
        if name == "hook":  # not yet set (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self.hook, name)

    def __call__(self, ctx: Any, stage: Any) -> Any:
        """Call the hook on the structures that have not failed."""
        hidden = self.guard.failed.clone() if self.guard.failures_on_host else None
        try:
            return self.hook(_without(ctx, hidden), stage)
        except RuntimeError:
            batch = getattr(ctx, "batch", None)
            if batch is None:
                raise
            failed = self.guard.check_now(batch)
            grew = failed if hidden is None else failed & ~hidden
            if not bool(grew.any()):  # nothing new to hide: a real error
                raise
        return self.hook(_without(ctx, self.guard.failed), stage)


def _without(ctx: Any, failed: torch.Tensor | None) -> Any:
    """``ctx`` with the ``failed`` structures out of its ``active_graph_mask``."""
    import dataclasses

    batch = getattr(ctx, "batch", None)
    if failed is None or batch is None or failed.shape[0] != batch.num_graphs:
        return ctx  # as nvalchemi gives it (some hooks refuse any mask)
    active = getattr(ctx, "active_graph_mask", None)
    live = ~failed if active is None else active & ~failed
    return dataclasses.replace(ctx, active_graph_mask=live)


def _finite_bound(limit: float) -> float:
    """Largest component the quick test lets pass for a norm ``limit``.

    Finite even for a limit of ``math.inf`` (the optimizers' ``max_force``):
    ±inf is rejected in every case, as the exact test rejects it.
    """
    return min(limit * _COMPONENT_BOUND, sys.float_info.max)


def _anything_may_change() -> None:
    """Default of :attr:`FailureGuard.changes_after_compute`: the full check."""
    return None


def _any_per_graph(
    flags: torch.Tensor, index: torch.Tensor, count: int
) -> torch.Tensor:
    total = torch.zeros(count, dtype=torch.long, device=flags.device)
    total.index_add_(0, index, flags.long())
    return total > 0


def _max_per_graph(
    values: torch.Tensor, index: torch.Tensor, count: int
) -> torch.Tensor:
    largest = torch.zeros(count, dtype=values.dtype, device=values.device)
    largest.scatter_reduce_(0, index, values, reduce="amax")
    return largest


def _displacements(batch: Batch, previous: torch.Tensor) -> torch.Tensor:
    """Distance each atom moved since ``previous`` [V], minimum image (Å).

    Periodic wrapping (e.g. nvalchemi's ``WrapPeriodicHook``) moves an atom by a
    lattice vector, which is no displacement; NaN counts as 0 (reported as
    non-finite positions instead).
    """
    index = batch.batch_idx.long()
    delta = batch.positions.detach() - previous
    cell = batch.cell.detach().reshape(-1, 3, 3)
    pbc = getattr(batch, "pbc", None)
    if torch.is_tensor(pbc):
        periodic = pbc.reshape(-1, 3).to(delta.dtype)[index]
        inverse = torch.linalg.inv_ex(cell).inverse[index]
        fractional = torch.einsum("vj,vjk->vk", delta, inverse)
        fractional = fractional - torch.round(fractional) * periodic
        delta = torch.einsum("vk,vkj->vj", fractional, cell[index])
    return torch.nan_to_num(delta.norm(dim=1), nan=0.0)


def _volumes(batch: Batch) -> torch.Tensor:
    """Cell volumes [B], Å³: |a · (b × c)| (LAPACK's det cost ~10× more here)."""
    cell = batch.cell.detach().reshape(-1, 3, 3).to(torch.float64)
    normal = torch.linalg.cross(cell[:, 0], cell[:, 1], dim=-1)
    return (normal * cell[:, 2]).sum(dim=-1).abs()


def _reason_text(code: int, limits: FailureLimits) -> str:
    text = FAILURE_REASONS.get(code, f"unknown failure (code {code})")
    if code == 6:
        return f"{text} ({limits.max_force:g} eV/Å)"
    if code == 7:
        return f"{text} ({limits.max_displacement:g} Å)"
    if code == 8:
        return f"{text} ({limits.max_volume_factor:g})"
    return text


def warn_failures(failures: list[StructureFailure], owner: str) -> None:
    """Warn once per newly failed structure."""
    for failure in failures:
        warnings.warn(
            f"{owner}: {failure}; the other structures go on (dyn.failures lists "
            "every failure)",
            StructureFailedWarning,
            stacklevel=4,
        )
