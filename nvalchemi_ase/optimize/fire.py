"""``FIRE`` and ``FIRE2`` with ASE's arguments, on nvalchemi's FIRE engines."""

from __future__ import annotations

import warnings
from typing import Any

from nvalchemi_ase._quiet import import_quietly
from nvalchemi_ase.dynamics.images import integer_argument, real_argument
from nvalchemi_ase.optimize.optimize import BatchedOptimizer
from nvalchemi_ase.typing import ImagesLike, LogfileLike, TrajectoryLike

__all__ = ["FIRE", "FIRE2"]

_TIME = "ASE time units"
_FACTOR = "a dimensionless factor"


class FIRE(BatchedOptimizer):
    """FIRE for many structures at once, with ``ase.optimize.FIRE``'s arguments.

    Runs nvalchemi's ``FIRE`` engine, which integrates with the atomic masses
    (ASE's FIRE uses unit masses), so paths differ from ASE's while minima are
    the same. Times (``dt``, ``dtmax``) are in ASE time units, as in ASE.

    Parameters
    ----------
    images : ase.Atoms or sequence of ase.Atoms
        Structures to relax (fixed cell; nvalchemi 0.3's variable-cell FIRE does
        not move the cell, so cell filters are refused: use FIRE2 or LBFGS).
    restart, logfile, trajectory, append_trajectory
        See :class:`~nvalchemi_ase.optimize.optimize.BatchedOptimizer`.
    dt : float
        Initial time step, ASE time units.
    maxstep : float, optional
        Largest displacement of an atom per step, Å (default 0.2).
    dtmax : float
        Largest time step, ASE time units.
    Nmin : int
        Steps of downhill motion before the time step grows.
    finc, fdec : float
        Time-step growth and shrink factors.
    astart, fa : float
        Initial mixing parameter and its decay factor.
    a : float
        Must equal ``astart`` (nvalchemi starts from ``astart``).
    downhill_check : bool
        Reset when the energy goes up (nvalchemi's ``uphill`` detection).
    **kwargs
        ``loginterval``, ``model``, ``device``, ``dtype``, ``neighbor_skin``.
    """

    def __init__(
        self,
        images: ImagesLike,
        restart: str | None = None,
        logfile: LogfileLike = "-",
        trajectory: TrajectoryLike = None,
        dt: float = 0.1,
        maxstep: float | None = None,
        dtmax: float = 1.0,
        Nmin: int = 5,  # noqa: N803 - ASE's name
        finc: float = 1.1,
        fdec: float = 0.5,
        astart: float = 0.1,
        fa: float = 0.99,
        a: float = 0.1,
        downhill_check: bool = False,
        **kwargs: Any,
    ) -> None:
        self.dt = real_argument("dt", dt, _TIME)
        self.maxstep = 0.2
        if maxstep is not None:
            self.maxstep = real_argument("maxstep", maxstep, "Å")
        self.dtmax = real_argument("dtmax", dtmax, _TIME)
        self.Nmin = integer_argument("Nmin", Nmin, "steps")
        self.finc = real_argument("finc", finc, _FACTOR)
        self.fdec = real_argument("fdec", fdec, _FACTOR)
        self.astart = real_argument("astart", astart, _FACTOR)
        self.fa = real_argument("fa", fa, _FACTOR)
        self.a = real_argument("a", a, _FACTOR)
        if self.a != self.astart:
            raise ValueError(
                f"a={a} differs from astart={astart}; nvalchemi's FIRE starts its "
                "mixing parameter at astart"
            )
        self.downhill_check = bool(downhill_check)
        super().__init__(images, restart, logfile, trajectory, **kwargs)

    def _check_inputs(self) -> None:
        super()._check_inputs()
        if self.cell_filter is not None:
            raise ValueError(
                "FIRE with a cell filter is not supported: nvalchemi 0.3's "
                "FIREVariableCell never moves the cell. Use FIRE2 or LBFGS with "
                "FrechetCellFilter"
            )
        for name in ("dt", "maxstep", "dtmax"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    def build_engine(self, hooks: list[Any]) -> Any:
        """Build the nvalchemi engine (engine protocol, see ``BatchedDynamics``)."""
        dynamics = import_quietly("nvalchemi.dynamics")
        with warnings.catch_warnings():
            # nvalchemi 0.3 marks FIRE deprecated in favour of FIRE2; ASE users
            # asked for FIRE, and it is the engine that implements it.
            warnings.simplefilter("ignore", DeprecationWarning)
            return dynamics.FIRE(
                self.model,
                dt=self.dt,
                dt_max=self.dtmax,
                maxstep=self.maxstep,
                n_min=self.Nmin,
                f_dec=self.fdec,
                f_inc=self.finc,
                alpha_start=self.astart,
                f_alpha=self.fa,
                uphill=self.downhill_check,
                hooks=hooks,
            )


class FIRE2(BatchedOptimizer):
    """FIRE 2.0 for many structures at once, with ``ase.optimize.FIRE2``'s arguments.

    Parameters
    ----------
    images : ase.Atoms, FrechetCellFilter, UnitCellFilter, or a sequence
        Structures to relax; cell filters select ``FIRE2VariableCell``.
    restart, logfile, trajectory, append_trajectory
        See :class:`~nvalchemi_ase.optimize.optimize.BatchedOptimizer`.
    dt, dtmax, dtmin : float
        Initial, largest and smallest time step, ASE time units.
    maxstep : float
        Largest displacement of an atom per step, Å.
    Nmin : int
        Steps before the time step may grow (nvalchemi's ``delaystep``).
    finc, fdec : float
        Time-step growth and shrink factors.
    astart, fa : float
        Initial mixing parameter and its decay factor.
    use_abc : bool
        Must be False (nvalchemi's FIRE2 has no bias correction).
    **kwargs
        ``loginterval``, ``model``, ``device``, ``dtype``, ``neighbor_skin``.
    """

    def __init__(
        self,
        images: ImagesLike,
        restart: str | None = None,
        logfile: LogfileLike = "-",
        trajectory: TrajectoryLike = None,
        dt: float = 0.1,
        maxstep: float = 0.2,
        dtmax: float = 1.0,
        dtmin: float = 2e-3,
        Nmin: int = 20,  # noqa: N803 - ASE's name
        finc: float = 1.1,
        fdec: float = 0.5,
        astart: float = 0.25,
        fa: float = 0.99,
        use_abc: bool = False,
        **kwargs: Any,
    ) -> None:
        if use_abc:
            raise ValueError("use_abc=True is not supported by nvalchemi's FIRE2")
        self.dt = real_argument("dt", dt, _TIME)
        self.maxstep = real_argument("maxstep", maxstep, "Å")
        self.dtmax = real_argument("dtmax", dtmax, _TIME)
        self.dtmin = real_argument("dtmin", dtmin, _TIME)
        self.Nmin = integer_argument("Nmin", Nmin, "steps")
        self.finc = real_argument("finc", finc, _FACTOR)
        self.fdec = real_argument("fdec", fdec, _FACTOR)
        self.astart = real_argument("astart", astart, _FACTOR)
        self.fa = real_argument("fa", fa, _FACTOR)
        super().__init__(images, restart, logfile, trajectory, **kwargs)

    def _check_inputs(self) -> None:
        super()._check_inputs()
        for name in ("dt", "maxstep", "dtmax", "dtmin"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    def default_skin(self) -> float:
        """Verlet skin of the neighbour list when none is given, Å."""
        return 0.0 if self.cell_filter is not None else super().default_skin()

    def build_engine(self, hooks: list[Any]) -> Any:
        """Build the nvalchemi engine (engine protocol, see ``BatchedDynamics``)."""
        dynamics = import_quietly("nvalchemi.dynamics")
        engine = (
            dynamics.FIRE2VariableCell
            if self.cell_filter is not None
            else dynamics.FIRE2
        )
        return engine(
            self.model,
            dt=self.dt,
            delaystep=self.Nmin,
            dtgrow=self.finc,
            dtshrink=self.fdec,
            alphashrink=self.fa,
            alpha0=self.astart,
            tmax=self.dtmax,
            tmin=self.dtmin,
            maxstep=self.maxstep,
            hooks=hooks,
        )
