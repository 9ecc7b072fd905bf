"""``FIRE`` (ASE's algorithm, batched here) and ``FIRE2`` (nvalchemi's engines)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from nvalchemi_ase._quiet import import_quietly
from nvalchemi_ase.dynamics.images import integer_argument, real_argument
from nvalchemi_ase.optimize.optimize import BatchedOptimizer
from nvalchemi_ase.typing import ImagesLike, LogfileLike, TrajectoryLike

__all__ = ["FIRE", "FIRE2"]

_TIME = "ASE time units"
_FACTOR = "a dimensionless factor"


class FIRE(BatchedOptimizer):
    """FIRE for many structures at once: ``ase.optimize.FIRE``, step for step.

    Runs :class:`nvalchemi_ase.engines.fire.FIRE`, ASE's algorithm with every
    sum taken per structure, so each structure's path is the one ASE's FIRE
    takes on it alone (to rounding): unit masses, the step of a structure
    capped at ``maxstep`` as a whole, ASE's restarts. Times (``dt``,
    ``dtmax``) are in ASE's units, as in ASE.

    Parameters
    ----------
    images : ase.Atoms, FrechetCellFilter, UnitCellFilter, or a sequence
        Structures to relax. Under a cell filter each structure follows ASE's
        FIRE on ASE's filter (N + 3 generalized rows; ``maxstep`` and ``dt``
        act on them, ``downhill_check`` compares the filter's ``E + p V``),
        every filter option included; ``FixAtoms`` is honoured (under a
        filter, as ASE, a fixed atom moves with the cell; other constraints
        are refused there).
    restart, logfile, trajectory, append_trajectory
        See :class:`~nvalchemi_ase.optimize.optimize.BatchedOptimizer`.
    dt : float
        Initial time step.
    maxstep : float, optional
        Largest step of a structure (norm over its atoms), Å (default 0.2).
    dtmax : float
        Largest time step.
    Nmin : int
        Steps of downhill motion before the time step grows.
    finc, fdec : float
        Time-step growth and shrink factors.
    astart, fa : float
        Mixing parameter after a restart, and its decay factor.
    a : float
        Mixing parameter of the first steps.
    downhill_check : bool
        Go back to the previous positions when a structure's energy rose.
        Its previous positions live on the engine: a runner's refill or a
        restart continues without them (the next uphill step is not undone).
    position_reset_callback : callable, optional
        ``callback(atoms, r_last, e, e_last)`` for every structure sent back
        (ASE's ``(optimizable, r, e, e_last)``; here the structure's ``Atoms``,
        its previous positions (N, 3) Å (Cartesian, also under a cell filter)
        and the energies, eV). Costs a host read per step.
    **kwargs
        ``loginterval``, ``model``, ``device``, ``dtype``, ``neighbor_skin``.
    """

    filter_in_engine = True

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
        position_reset_callback: Callable[..., Any] | None = None,
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
        self.downhill_check = bool(downhill_check)
        if position_reset_callback is not None and not callable(
            position_reset_callback
        ):
            raise TypeError(
                "position_reset_callback must be callable as "
                "callback(atoms, r_last, e, e_last)"
            )
        self.position_reset_callback = position_reset_callback
        super().__init__(images, restart, logfile, trajectory, **kwargs)

    def _check_inputs(self) -> None:
        super()._check_inputs()
        for name in ("dt", "maxstep", "dtmax"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    def build_engine(self, hooks: list[Any]) -> Any:
        """Build the engine (engine protocol, see ``BatchedDynamics``)."""
        engines = import_quietly("nvalchemi_ase.engines.fire")
        engine = engines.ASEFIRE(
            self.model,
            dt=self.dt,
            maxstep=self.maxstep,
            dtmax=self.dtmax,
            n_min=self.Nmin,
            finc=self.finc,
            fdec=self.fdec,
            astart=self.astart,
            fa=self.fa,
            a=self.a,
            downhill_check=self.downhill_check,
            cell_filter=self._cell_coordinates,
            hooks=hooks,
        )
        if self.position_reset_callback is not None:
            engine.reset_callback = self._call_position_reset_callback
        return engine

    def _checkpoint_extras(self) -> dict[str, npt.NDArray[Any]]:
        """Add, with ``downhill_check``, the positions and cells it goes back to."""
        extras = super()._checkpoint_extras()
        engine = self.engine
        for name in ("previous_positions", "previous_cell"):
            value = getattr(engine, name, None)
            if self.downhill_check and value is not None:
                extras[f"fire_{name}"] = value.detach().cpu().numpy().copy()
        return extras

    def _restore_checkpoint_extras(self, extras: dict[str, npt.NDArray[Any]]) -> None:
        import torch

        super()._restore_checkpoint_extras(extras)
        device, dtype = self.batch.device, self.batch.positions.dtype
        for name in ("previous_positions", "previous_cell"):
            saved = extras.get(f"fire_{name}")
            if self.downhill_check and saved is not None:
                value = torch.as_tensor(saved, device=device).to(dtype)
                setattr(self.engine, name, value)

    def _call_position_reset_callback(
        self, uphill: Any, previous: Any, energy: Any, last_energy: Any
    ) -> None:
        """Call the user's callback once per structure sent back (host side)."""
        callback = self.position_reset_callback
        assert callback is not None  # noqa: S101 - set only with a callback
        flags = uphill.cpu().numpy()
        positions = previous.detach().cpu().numpy()
        energies = energy.detach().cpu().numpy()
        last = last_energy.detach().cpu().numpy()
        counts = [len(atoms) for atoms in self.images]
        starts = np.concatenate([[0], np.cumsum(counts)])
        for index in np.flatnonzero(flags):
            rows = slice(starts[index], starts[index + 1])
            callback(
                self.images[index],
                positions[rows].copy(),
                float(energies[index]),
                float(last[index]),
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
    position_reset_callback : callable, optional
        Kept as ASE keeps it (ASE 3.29's FIRE2 never calls it).
    use_abc : bool
        ABC-FIRE (bias-corrected mixing, each velocity component capped at
        ``maxstep / dt``): runs :class:`nvalchemi_ase.engines.fire2.ABCFIRE2`,
        ASE's step with every sum per structure, on ASE's filter coordinates
        under a cell filter (``StrainFilter`` included). False (default):
        nvalchemi's ``FIRE2`` / ``FIRE2VariableCell``.
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
        position_reset_callback: Callable[..., Any] | None = None,
        use_abc: bool | None = False,
        **kwargs: Any,
    ) -> None:
        self.use_abc = bool(use_abc)
        self.position_reset_callback = position_reset_callback
        # ABC-FIRE is written here, on ASE's filter coordinates: the base's
        # per-class switch is decided per instance (use_abc) for FIRE2
        vars(self)["filter_in_engine"] = self.use_abc
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

    def build_engine(self, hooks: list[Any]) -> Any:
        """Build the nvalchemi engine (engine protocol, see ``BatchedDynamics``)."""
        if self.use_abc:
            return import_quietly("nvalchemi_ase.engines.fire2").ABCFIRE2(
                self.model,
                dt=self.dt,
                maxstep=self.maxstep,
                dtmax=self.dtmax,
                dtmin=self.dtmin,
                n_min=self.Nmin,
                finc=self.finc,
                fdec=self.fdec,
                astart=self.astart,
                fa=self.fa,
                cell_filter=self._cell_coordinates,
                hooks=hooks,
            )
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
