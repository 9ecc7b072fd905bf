"""``LBFGS`` with ASE's arguments, on nvalchemi's L-BFGS engines."""

from __future__ import annotations

from typing import Any

from nvalchemi_ase._quiet import import_quietly
from nvalchemi_ase.dynamics.images import integer_argument, real_argument
from nvalchemi_ase.optimize.optimize import BatchedOptimizer
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
        super().__init__(images, restart, logfile, trajectory, **kwargs)

    def _check_inputs(self) -> None:
        super()._check_inputs()
        if not self.maxstep > 0:
            raise ValueError(f"maxstep must be positive, got {self.maxstep}")
        if self.memory < 1:
            raise ValueError(f"memory must be >= 1, got {self.memory}")

    def default_skin(self) -> float:
        """Verlet skin of the neighbour list when none is given, Å."""
        return 0.0 if self.cell_filter is not None else super().default_skin()

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
