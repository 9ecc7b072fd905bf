"""``MDMin`` with ASE's arguments, on the batched engine ``engines.ASEMDMin``."""

from __future__ import annotations

from typing import Any

from nvalchemi_ase._quiet import import_quietly
from nvalchemi_ase.dynamics.images import real_argument
from nvalchemi_ase.optimize.optimize import BatchedOptimizer
from nvalchemi_ase.typing import ImagesLike, LogfileLike, TrajectoryLike

__all__ = ["MDMin"]

#: ASE's defaults: time step (ASE time units, unit masses) and largest step (Å).
DEFAULT_DT = 0.2
DEFAULT_MAXSTEP = 0.2


class MDMin(BatchedOptimizer):
    """MDMin for many structures at once, as ``ase.optimize.MDMin``.

    Each structure follows the path ASE's ``MDMin`` would give it alone: its
    velocity is projected on its own forces (dot products per structure).

    Parameters
    ----------
    images : ase.Atoms, FrechetCellFilter, UnitCellFilter, or a sequence
        Structures to relax (``FixAtoms`` honoured; under a filter, as ASE, a
        fixed atom moves with the cell, and other constraints are refused). Under a
        cell filter each structure follows ASE's MDMin on ASE's filter (N + 3
        generalized rows, ``maxstep`` capping each), every option included.
    restart, logfile, trajectory
        See :class:`~nvalchemi_ase.optimize.optimize.BatchedOptimizer`.
    dt : float, optional
        Time step of the damped motion, ASE time units with unit masses
        (default 0.2, as ASE).
    maxstep : float, optional
        Largest displacement of an atom per step, Å (default 0.2).
    **kwargs
        ``append_trajectory``, ``loginterval``, ``model``, ``device``,
        ``dtype``, ``neighbor_skin``.
    """

    filter_in_engine = True

    def __init__(
        self,
        images: ImagesLike,
        restart: str | None = None,
        logfile: LogfileLike = "-",
        trajectory: TrajectoryLike = None,
        dt: float | None = None,
        maxstep: float | None = None,
        **kwargs: Any,
    ) -> None:
        # ASE treats 0 / None as "use the default" (``dt or default``).
        dt = None if dt is None else real_argument("dt", dt, "ASE time units")
        maxstep = None if maxstep is None else real_argument("maxstep", maxstep, "Å")
        self.dt = dt or DEFAULT_DT
        self.maxstep = maxstep or DEFAULT_MAXSTEP
        super().__init__(images, restart, logfile, trajectory, **kwargs)

    def _check_inputs(self) -> None:
        super()._check_inputs()
        for name in ("dt", "maxstep"):
            value = getattr(self, name)
            if not value > 0 or value == float("inf"):
                raise ValueError(f"{name} must be positive and finite, got {value}")

    def todict(self) -> dict[str, Any]:
        """ASE's description plus the time step."""
        return super().todict() | {"dt": self.dt}

    def build_engine(self, hooks: list[Any]) -> Any:
        """Build the nvalchemi engine (engine protocol, see ``BatchedDynamics``)."""
        engines = import_quietly("nvalchemi_ase.engines.mdmin")
        return engines.ASEMDMin(
            self.model,
            dt=self.dt,
            maxstep=self.maxstep,
            cell_filter=self._cell_coordinates,
            hooks=hooks,
        )
