"""What a batched NEB run reports, per path: failures, convergence steps.

:class:`PathMonitor` is a set of nvalchemi hooks registered on the NEB engine
(:func:`nvalchemi_ase.mep.engine.run_neb`):

* ``BEFORE_STEP``, ``AFTER_COMPUTE``, ``AFTER_STEP``:
  :class:`~nvalchemi_ase.dynamics.failures.FailureGuard` flags images whose
  state becomes non-finite or explodes and puts them back to their last good
  state; then every image of a path with a flagged image leaves the run (it
  gets the engine's exit status, zero forces and velocities), so a failed path
  costs that path only;
* ``ON_GRADUATE``: the step at which each path converged.

Tensor operations only: nothing synchronises with the host during a run on an
accelerator; :meth:`PathMonitor.outcome` reads everything back once at the end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import torch

from nvalchemi_ase._quiet import import_quietly
from nvalchemi_ase.dynamics.failures import FailureGuard, FailureLimits

if TYPE_CHECKING:
    from nvalchemi.data import Batch

__all__ = ["EngineOutcome", "PathFailure", "PathMonitor", "split_positions"]


@dataclass(frozen=True)
class PathFailure:
    """A path stopped because one of its images failed.

    Attributes
    ----------
    path : int
        Index of the path in the input list.
    image : int
        Index of the first failed image within the path.
    step : int
        Engine step whose result was rejected (0: the initial evaluation).
    reason : str
        What was wrong with that image.
    """

    path: int
    image: int
    step: int
    reason: str

    def __str__(self) -> str:
        return (
            f"image {self.image} failed at step {self.step}: {self.reason}; the "
            "path stopped there"
        )


@dataclass(frozen=True)
class EngineOutcome:
    """What a batched NEB run left, on the host.

    Attributes
    ----------
    positions : list of numpy.ndarray
        Final positions of every image, in input order, each (N_i, 3), Å.
    converged : numpy.ndarray
        Per path, shape (P,): NEB forces reached ``fmax``.
    steps : numpy.ndarray
        Per path, shape (P,): engine steps until it converged or stopped
        (the total when it did neither).
    fmax : numpy.ndarray
        Per path, shape (P,): largest NEB force norm at the end, eV/Å.
    failures : dict of int to PathFailure
        Failed paths by index.
    results : list of dict
        The model's ASE results (energy, forces) at the final positions of every
        image, in input order (those of failed paths are not to be used).
    """

    positions: list[npt.NDArray[np.float64]]
    converged: npt.NDArray[np.bool_]
    steps: npt.NDArray[np.int64]
    fmax: npt.NDArray[np.float64]
    failures: dict[int, PathFailure]
    results: list[dict[str, Any]]


class _StageHook:
    """An nvalchemi hook calling ``action(ctx)`` at one stage."""

    frequency = 1

    def __init__(self, stage: Any, action: Any) -> None:
        self.stage = stage
        self._action = action

    def __call__(self, ctx: Any, stage: Any) -> None:
        self._action(ctx)


class PathMonitor:
    """Failure isolation per path and convergence steps, as engine hooks.

    Parameters
    ----------
    batch : nvalchemi.data.Batch
        The grouped batch of the run.
    limits : FailureLimits
        When an image counts as exploded.
    """

    def __init__(self, batch: Batch, limits: FailureLimits) -> None:
        layout = batch.group_layout
        self.path_of_image = layout.group_idx.long()  # [B]
        self.first_image = layout.group_ptr[:-1].long()  # [P]
        self.num_paths = int(layout.num_groups)
        self._step = 0
        self.guard = FailureGuard(
            batch, limits, ase_step=lambda: self._step, variable_cell=False
        )
        device = batch.device
        self.path_failed = torch.zeros(self.num_paths, dtype=torch.bool, device=device)
        self.graduated_at = torch.full(
            (self.num_paths,), -1, dtype=torch.long, device=device
        )
        self.exit_status = 1

    def bind(self, engine: Any) -> None:
        """Take the engine's exit status, once the engine exists.

        Parameters
        ----------
        engine : nvalchemi.dynamics.FusedStage
            The NEB engine these hooks are registered on.
        """
        self.exit_status = int(engine.exit_status)

    def hooks(self) -> list[Any]:
        """Return the hooks to register on the engine, in this order.

        Returns
        -------
        list
            Step counter, the failure guard's three hooks, the path stop (after
            each check) and the graduation recorder.
        """
        stages = import_quietly("nvalchemi.dynamics.base").DynamicsStage
        return [
            _StageHook(stages.BEFORE_STEP, self._before_step),
            *self.guard.hooks(stages),
            _StageHook(stages.AFTER_COMPUTE, self._stop_failed_paths),
            _StageHook(stages.AFTER_STEP, self._stop_failed_paths),
            _StageHook(stages.ON_GRADUATE, self._record_graduation),
        ]

    def _before_step(self, ctx: Any) -> None:
        self._step = int(ctx.step_count) + 1

    def _stop_failed_paths(self, ctx: Any) -> None:
        """Every image of a path with a failed image leaves the run, forces zeroed.

        Nothing to do while the guard knows on the host that nothing failed (a
        CPU run; on an accelerator this runs in full, without a sync).
        """
        if self.guard.none_failed:
            return
        batch = ctx.batch
        with torch.no_grad():
            count = torch.zeros(self.num_paths, dtype=torch.long, device=batch.device)
            count.index_add_(0, self.path_of_image, self.guard.failed.long())
            self.path_failed |= count > 0
            image_failed = self.path_failed[self.path_of_image]
            if "status" in batch:
                status = batch.status.view(-1)
                status.copy_(torch.where(image_failed, self.exit_status, status))
            atom_failed = image_failed[batch.batch_idx.long()].unsqueeze(-1)
            for key in ("forces", "velocities"):
                value = getattr(batch, key, None)
                if isinstance(value, torch.Tensor):
                    value.masked_fill_(atom_failed, 0.0)

    def _record_graduation(self, ctx: Any) -> None:
        graduated = ctx.graduated_mask
        if graduated is None:
            return
        with torch.no_grad():
            first = graduated[self.first_image] & (self.graduated_at < 0)
            self.graduated_at.copy_(
                torch.where(first & ~self.path_failed, self._step, self.graduated_at)
            )

    def outcome(
        self, batch: Batch, total_steps: int, results: list[dict[str, Any]]
    ) -> EngineOutcome:
        """Read the run's results back to the host, once.

        Parameters
        ----------
        batch : nvalchemi.data.Batch
            The batch after the run.
        total_steps : int
            Steps the engine ran (for paths that neither converged nor failed).
        results : list of dict
            The model's results at the final positions, one per image.

        Returns
        -------
        EngineOutcome
            Positions, per-path convergence, steps, fmax and failures.
        """
        status = batch.status.view(-1)[self.first_image]
        converged = ((status >= self.exit_status) & ~self.path_failed).cpu().numpy()
        steps = self.graduated_at.cpu().numpy().copy()
        steps[steps < 0] = total_steps
        fmax = _path_fmax(batch, self.path_of_image, self.num_paths)
        failures = self._failures()
        for path, failure in failures.items():
            steps[path], fmax[path] = failure.step, np.nan
        return EngineOutcome(
            positions=split_positions(batch),
            converged=converged,
            steps=steps,
            fmax=fmax,
            failures=failures,
            results=results,
        )

    def _failures(self) -> dict[int, PathFailure]:
        first_image = self.first_image.cpu().numpy()
        path_of_image = self.path_of_image.cpu().numpy()
        failures: dict[int, PathFailure] = {}
        for failure in self.guard.new_failures():
            path = int(path_of_image[failure.index])
            if path not in failures:
                failures[path] = PathFailure(
                    path=path,
                    image=failure.index - int(first_image[path]),
                    step=failure.step,
                    reason=failure.reason,
                )
        return failures


def _path_fmax(
    batch: Batch, path_of_image: torch.Tensor, num_paths: int
) -> npt.NDArray[np.float64]:
    """Largest NEB force norm per path, shape (P,), eV/Å."""
    with torch.no_grad():
        norms = torch.nan_to_num(batch.forces.detach().norm(dim=1), nan=np.inf)
        per_atom_path = path_of_image[batch.batch_idx.long()]
        largest = torch.zeros(num_paths, dtype=norms.dtype, device=norms.device)
        largest.scatter_reduce_(0, per_atom_path, norms, reduce="amax")
        return largest.to(torch.float64).cpu().numpy()


def split_positions(batch: Batch) -> list[npt.NDArray[np.float64]]:
    """Positions of every graph, as float64 arrays (N_i, 3), Å."""
    positions = batch.positions.detach().to(torch.float64).cpu().numpy()
    ptr = batch.batch_ptr.cpu().numpy()
    return [positions[ptr[g] : ptr[g + 1]].copy() for g in range(len(ptr) - 1)]
