"""Expose any nvalchemi ``BaseDynamics`` subclass as an ASE-style dynamics class.

nvalchemi's own recipe for a new integrator (subclass ``BaseDynamics``, declare
``__needs_keys__``/``__provides_keys__``, implement ``pre_update``/``post_update``)
gives an engine that runs on a ``Batch``. :func:`md_class` and
:func:`optimizer_class` turn such a class into one with ASE's interface, running
many ``Atoms`` at once: ``attach``, ``run``, ``irun``, trajectories, logs, and
(optimizers) per-structure convergence — the same machinery as
:class:`nvalchemi_ase.md.VelocityVerlet` or :class:`nvalchemi_ase.optimize.FIRE`.

>>> from nvalchemi_ase.wrap import md_class
>>> ASEVerlet = md_class(VelocityVerlet, timestep_unit="ase")  # doctest: +SKIP
>>> ASEVerlet(images, 1 * units.fs, trajectory="md_{i}.traj").run(100)  # doctest: +SKIP
"""

from __future__ import annotations

import inspect
from typing import Any, Literal

from nvalchemi_ase.md.md import BatchedMolecularDynamics
from nvalchemi_ase.optimize.optimize import BatchedOptimizer
from nvalchemi_ase.typing import ImagesLike, LogfileLike, TrajectoryLike
from nvalchemi_ase.units import ase_time_to_fs

__all__ = ["md_class", "optimizer_class"]


def md_class(
    engine_class: type,
    *,
    timestep_unit: Literal["fs", "ase"],
    timestep_argument: str = "dt",
    name: str | None = None,
) -> type[BatchedMolecularDynamics]:
    """Wrap an nvalchemi integrator class as an ASE-style MD class.

    Parameters
    ----------
    engine_class : type
        A ``nvalchemi.dynamics.base.BaseDynamics`` subclass; it is constructed as
        ``engine_class(model, hooks=hooks, <timestep_argument>=..., **engine_options)``.
    timestep_unit : {"fs", "ase"}
        What the engine's time step means: ``"fs"`` for femtoseconds (nvalchemi's
        integrators), ``"ase"`` for the internal unit the kernels use directly
        (the ASE time unit, e.g. the Velocity Verlet example of nvalchemi's
        dynamics guide, which adds ``velocities * dt`` to positions).
    timestep_argument : str
        Name of the engine's time-step parameter.
    name : str, optional
        Name of the new class (default: the engine's).

    Returns
    -------
    type
        A :class:`~nvalchemi_ase.md.md.BatchedMolecularDynamics` subclass taking
        ``(images, timestep, trajectory=None, logfile=None, loginterval=1, *,
        engine_options=None, model=None, device=None, dtype=None, ...)`` with
        ``timestep`` in ASE time units; ``engine_options`` are passed to the
        engine's constructor.
    """
    if timestep_unit not in ("fs", "ase"):
        raise ValueError(f"timestep_unit must be 'fs' or 'ase', got {timestep_unit!r}")
    _check_engine_class(engine_class)

    class WrappedMD(BatchedMolecularDynamics):
        def __init__(
            self,
            images: ImagesLike,
            timestep: float,
            trajectory: TrajectoryLike = None,
            logfile: LogfileLike = None,
            loginterval: int = 1,
            *,
            engine_options: dict[str, Any] | None = None,
            **kwargs: Any,
        ) -> None:
            self.engine_options = dict(engine_options or {})
            super().__init__(
                images, timestep, trajectory, logfile, loginterval, **kwargs
            )

        def build_engine(self, hooks: list[Any]) -> Any:
            step = ase_time_to_fs(self.dt) if timestep_unit == "fs" else self.dt
            options = {timestep_argument: step, **_n_steps_default(engine_class)}
            return engine_class(
                self.model, hooks=hooks, **options, **self.engine_options
            )

        def todict(self) -> dict[str, Any]:
            return super().todict() | {"engine": engine_class.__name__}

    return _named(WrappedMD, engine_class, name)


def optimizer_class(
    engine_class: type, *, name: str | None = None
) -> type[BatchedOptimizer]:
    """Wrap an nvalchemi optimizer class as an ASE-style optimizer class.

    Parameters
    ----------
    engine_class : type
        A ``nvalchemi.dynamics.base.BaseDynamics`` subclass that moves atoms
        downhill; constructed as ``engine_class(model, hooks=hooks,
        **engine_options)``. Its time parameters, if any, are in the internal
        (ASE) time unit, as nvalchemi's optimizers take them.
    name : str, optional
        Name of the new class (default: the engine's).

    Returns
    -------
    type
        A :class:`~nvalchemi_ase.optimize.optimize.BatchedOptimizer` subclass
        taking ``(images, restart=None, logfile="-", trajectory=None, *,
        engine_options=None, model=None, ...)`` with ``run(fmax, steps)``.
    """
    _check_engine_class(engine_class)

    class WrappedOptimizer(BatchedOptimizer):
        def __init__(
            self,
            images: ImagesLike,
            restart: str | None = None,
            logfile: LogfileLike = "-",
            trajectory: TrajectoryLike = None,
            *,
            engine_options: dict[str, Any] | None = None,
            **kwargs: Any,
        ) -> None:
            self.engine_options = dict(engine_options or {})
            super().__init__(images, restart, logfile, trajectory, **kwargs)

        def build_engine(self, hooks: list[Any]) -> Any:
            options = _n_steps_default(engine_class)
            return engine_class(
                self.model, hooks=hooks, **options, **self.engine_options
            )

        def todict(self) -> dict[str, Any]:
            return super().todict() | {"engine": engine_class.__name__}

    return _named(WrappedOptimizer, engine_class, name)


def _named(cls: Any, engine_class: type, name: str | None) -> Any:
    cls.__name__ = cls.__qualname__ = name or engine_class.__name__
    cls.__doc__ = (
        f"ASE-style wrapper around the nvalchemi engine ``{engine_class.__name__}`` "
        f"(made by :mod:`nvalchemi_ase.wrap`).\n\n{cls.__mro__[1].__doc__ or ''}"
    )
    return cls


def _check_engine_class(engine_class: type) -> None:
    names = {cls.__name__ for cls in inspect.getmro(engine_class)}
    if "BaseDynamics" not in names or not hasattr(engine_class, "pre_update"):
        raise TypeError(
            f"{getattr(engine_class, '__name__', engine_class)!r} is not an nvalchemi "
            "BaseDynamics subclass"
        )


def _n_steps_default(engine_class: type) -> dict[str, Any]:
    """Pass ``n_steps=None`` to engines that require it (ASE's ``run`` counts)."""
    parameter = inspect.signature(engine_class).parameters.get("n_steps")
    if parameter is not None and parameter.default is inspect.Parameter.empty:
        return {"n_steps": None}
    return {}
