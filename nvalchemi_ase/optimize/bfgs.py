"""``BFGS`` with ASE's arguments, on the batched engine ``engines.ASEBFGS``."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from nvalchemi_ase._quiet import import_quietly
from nvalchemi_ase.convert import FROZEN_CATEGORY
from nvalchemi_ase.dynamics.images import real_argument
from nvalchemi_ase.optimize.optimize import BatchedOptimizer
from nvalchemi_ase.optimize.replay import frame_arrays, replay_frames
from nvalchemi_ase.typing import ImagesLike, LogfileLike, TrajectoryLike

__all__ = ["BFGS"]


#: ASE's defaults: largest atomic step (Å) and initial Hessian (eV/Å²).
DEFAULT_MAXSTEP = 0.2
DEFAULT_ALPHA = 70.0


class BFGS(BatchedOptimizer):
    """BFGS for many structures at once, as ``ase.optimize.BFGS``.

    Every structure keeps its own dense Hessian and follows exactly the path
    ASE's ``BFGS`` would give it alone (same steps, same step count); the
    structures are advanced together and stop one by one as they converge.

    Parameters
    ----------
    images : ase.Atoms, FrechetCellFilter, UnitCellFilter, or a sequence
        Structures to relax (``FixAtoms`` honoured; under a filter, as ASE, a
        fixed atom moves with the cell, and other constraints are refused). Under a
        cell filter each structure follows ASE's BFGS on ASE's filter: the
        Hessian is over the filter's 3(N + 3) generalized coordinates and
        ``maxstep`` caps their rows, every filter option included.
    restart, logfile, trajectory, append_trajectory
        See :class:`~nvalchemi_ase.optimize.optimize.BatchedOptimizer`.
    maxstep : float, optional
        Largest displacement of an atom per step, Å (default 0.2). Steps are
        scaled down as a whole, keeping their direction.
    alpha : float, optional
        Initial Hessian guess, eV/Å² times identity (default 70).
    **kwargs
        ``loginterval``, ``model``, ``device``, ``dtype``, ``neighbor_skin``.

    Notes
    -----
    Memory is one (3N)² Hessian per structure (3(N + 3) under a cell
    filter), padded to the largest
    structure of the batch, and each step diagonalises them all: like ASE's
    BFGS this is meant for structures up to a few hundred atoms (use
    ``LBFGS`` beyond).
    """

    filter_in_engine = True

    def __init__(
        self,
        images: ImagesLike,
        restart: str | None = None,
        logfile: LogfileLike = "-",
        trajectory: TrajectoryLike = None,
        append_trajectory: bool = False,
        maxstep: float | None = None,
        alpha: float | None = None,
        **kwargs: Any,
    ) -> None:
        self.maxstep = DEFAULT_MAXSTEP
        if maxstep is not None:
            self.maxstep = real_argument("maxstep", maxstep, "Å")
        self.alpha = (
            DEFAULT_ALPHA if alpha is None else real_argument("alpha", alpha, "eV/Å²")
        )
        self._replay: list[list[Any]] | None = None
        super().__init__(
            images,
            restart,
            logfile,
            trajectory,
            append_trajectory=append_trajectory,
            **kwargs,
        )

    def _check_inputs(self) -> None:
        super()._check_inputs()
        for name in ("maxstep", "alpha"):
            value = getattr(self, name)
            if not value > 0 or value == float("inf"):
                raise ValueError(f"{name} must be positive and finite, got {value}")
        if self.maxstep > 1.0:
            warnings.warn(
                f"You are using a *very* large value for the maximum step size: "
                f"{self.maxstep:.1f} Å",
                UserWarning,
                stacklevel=5,
            )

    def replay_trajectory(self, traj: Any) -> None:
        """Rebuild every structure's Hessian from its earlier trajectory (ASE's).

        Each structure's frames (positions and forces) update its Hessian as
        ASE's ``BFGS.replay_trajectory`` does, so a relaxation continued from
        the last frames starts where the earlier one stopped. Applied before
        the next step (at once if the optimizer has already run).

        Parameters
        ----------
        traj : str, path, Trajectory, list of Atoms, or a sequence of them
            One trajectory per structure: a ``{i}`` template (as written with
            ``trajectory="relax_{i}.traj"``) or a list; one structure may give
            one.
        """
        if self.cell_filter is not None:
            raise ValueError(
                "BFGS.replay_trajectory is not supported with a cell filter (its "
                "frames hold no filter coordinates); use restart= to continue"
            )
        self._replay = replay_frames(traj, self.images)
        if self._primed:
            self._after_priming()

    def _after_priming(self) -> None:
        frames = getattr(self, "_replay", None)
        if not frames:
            return
        self._replay = None
        engines = import_quietly("nvalchemi_ase.engines.bfgs")
        engine, batch = self.engine, self.batch
        layout = engines.PaddedLayout(batch, engine._state_width())
        free = (batch.atom_categories != FROZEN_CATEGORY).unsqueeze(-1)
        for number in range(max(len(trajectory) for trajectory in frames)):
            take = [number < len(trajectory) for trajectory in frames]
            positions, forces = (
                torch.as_tensor(array, dtype=batch.positions.dtype, device=batch.device)
                for array in frame_arrays(frames, number, self.images)
            )
            engine.replay_frame(
                layout.pad(positions),
                layout.pad(torch.where(free, -forces, 0.0)),
                torch.as_tensor(take, device=batch.device),
            )

    def build_engine(self, hooks: list[Any]) -> Any:
        """Build the nvalchemi engine (engine protocol, see ``BatchedDynamics``)."""
        engines = import_quietly("nvalchemi_ase.engines.bfgs")
        return engines.ASEBFGS(
            self.model,
            maxstep=self.maxstep,
            alpha=self.alpha,
            cell_filter=self._cell_coordinates,
            hooks=hooks,
        )
