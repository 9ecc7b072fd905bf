"""``LBFGS`` with ASE's arguments, on nvalchemi's L-BFGS engines."""

from __future__ import annotations

from typing import Any

import torch

from nvalchemi_ase._compat import masked_pre_update
from nvalchemi_ase._quiet import import_quietly
from nvalchemi_ase.dynamics.images import integer_argument, real_argument
from nvalchemi_ase.optimize.optimize import BatchedOptimizer
from nvalchemi_ase.optimize.replay import frame_arrays, replay_frames
from nvalchemi_ase.typing import ImagesLike, LogfileLike, TrajectoryLike

__all__ = ["LBFGS"]


class LBFGS(BatchedOptimizer):
    """Limited-memory BFGS for many structures at once, with ASE's arguments.

    Parameters
    ----------
    images : ase.Atoms, FrechetCellFilter, UnitCellFilter, or a sequence
        Structures to relax; cell filters select ``LBFGSVariableCell``.
    restart, logfile, trajectory, append_trajectory
        See :class:`~nvalchemi_ase.optimize.optimize.BatchedOptimizer`.
    maxstep : float, optional
        Largest displacement of an atom per step, Å (default 0.2).
    memory : int
        Number of stored steps (nvalchemi's ``history_size``).
    damping, alpha : float
        Must keep ASE's defaults (1.0 and 70.0): nvalchemi's L-BFGS scales its
        initial Hessian from the curvature history instead.
    **kwargs
        ``loginterval``, ``model``, ``device``, ``dtype``, ``neighbor_skin``.
    """

    def __init__(
        self,
        images: ImagesLike,
        restart: str | None = None,
        logfile: LogfileLike = "-",
        trajectory: TrajectoryLike = None,
        maxstep: float | None = None,
        memory: int = 100,
        damping: float = 1.0,
        alpha: float = 70.0,
        **kwargs: Any,
    ) -> None:
        damping = real_argument("damping", damping, "a dimensionless factor")
        alpha = real_argument("alpha", alpha, "eV/Å²")
        if (damping, alpha) != (1.0, 70.0):
            raise ValueError(
                f"damping={damping}, alpha={alpha}: nvalchemi's L-BFGS has no initial "
                "Hessian guess or damping; keep ASE's defaults (1.0, 70.0)"
            )
        self.maxstep = 0.2
        if maxstep is not None:
            self.maxstep = real_argument("maxstep", maxstep, "Å")
        self.memory = integer_argument("memory", memory, "stored steps")
        self.damping, self.alpha = damping, alpha
        self._replay: list[list[Any]] | None = None
        super().__init__(images, restart, logfile, trajectory, **kwargs)

    def _check_inputs(self) -> None:
        super()._check_inputs()
        if not self.maxstep > 0:
            raise ValueError(f"maxstep must be positive, got {self.maxstep}")
        if self.memory < 1:
            raise ValueError(f"memory must be >= 1, got {self.memory}")

    def replay_trajectory(self, traj: Any) -> None:
        """Rebuild every structure's history from its earlier trajectory (ASE's).

        As in ASE, every frame but the last is taken in (the last comes with
        the first step of the continued run): each is handed to the engine's
        own L-BFGS update, so frames written by this class with
        ``loginterval=1`` give back exactly the state the earlier run had
        (and the same next steps); frames from another optimizer give the
        curvature pairs of its steps. Applied before the next step (at once if
        the optimizer has already run). Fixed cell only.

        Parameters
        ----------
        traj : str, path, Trajectory, list of Atoms, or a sequence of them
            One trajectory per structure: a ``{i}`` template (as written with
            ``trajectory="relax_{i}.traj"``) or a list; one structure may give
            one.
        """
        if self.cell_filter is not None:
            raise ValueError(
                "LBFGS.replay_trajectory is not supported with a cell filter (the "
                "engine's history mixes cell and atom coordinates); use restart="
            )
        self._replay = replay_frames(traj, self.images)
        if self._primed:
            self._after_priming()

    def _after_priming(self) -> None:
        frames, self._replay = self._replay, None
        if not frames:
            return
        batch = self.batch
        kept = {key: batch[key].detach().clone() for key in ("positions", "forces")}
        with torch.no_grad():
            for number in range(max(len(trajectory) for trajectory in frames) - 1):
                take = [number < len(trajectory) - 1 for trajectory in frames]
                positions, forces = (
                    torch.as_tensor(
                        array, dtype=batch.positions.dtype, device=batch.device
                    )
                    for array in frame_arrays(frames, number, self.images)
                )
                batch.positions.copy_(positions)
                batch.forces.copy_(forces)
                masked_pre_update(
                    self.engine, batch, torch.as_tensor(take, device=batch.device)
                )
            for key, value in kept.items():
                batch[key].copy_(value)

    def build_engine(self, hooks: list[Any]) -> Any:
        """Build the nvalchemi engine (engine protocol, see ``BatchedDynamics``)."""
        dynamics = import_quietly("nvalchemi.dynamics")
        if self.cell_filter is None:
            return dynamics.LBFGS(
                self.model, history_size=self.memory, maxstep=self.maxstep, hooks=hooks
            )
        return dynamics.LBFGSVariableCell(
            self.model, history_size=self.memory, maxstep=self.maxstep, hooks=hooks
        )
