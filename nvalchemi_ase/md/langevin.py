"""``Langevin``: NVT with nvalchemi's BAOAB Langevin engine (``NVTLangevin``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt
from ase import units

from nvalchemi_ase._quiet import import_quietly
from nvalchemi_ase.md.md import (
    BatchedMolecularDynamics,
    checked_numbers,
    resolve_seed,
)
from nvalchemi_ase.md.parameters import (
    as_given,
    positive_timestep,
    update_engine_state,
)
from nvalchemi_ase.md.schedules import Schedule, as_schedule
from nvalchemi_ase.typing import ImagesLike, RNGLike
from nvalchemi_ase.units import (
    FS_PER_ASE_TIME,
    ase_rate_to_per_fs,
    ase_time_to_fs,
    thermal_energy_nvalchemi,
)

__all__ = ["Langevin", "resolve_seed"]  # resolve_seed: kept importable here


class Langevin(BatchedMolecularDynamics):
    """Langevin NVT for many structures at once, with ASE's arguments.

    The engine is nvalchemi's BAOAB Langevin integrator; ASE's ``Langevin`` uses
    a different splitting, so trajectories differ while the ensemble (canonical
    at ``temperature_K``) is the same.

    Parameters
    ----------
    images : ase.Atoms or sequence of ase.Atoms
        Structures with their momenta.
    timestep : float
        Time step, ASE time units.
    temperature_K : float, array_like (B,) or schedule
        Target temperature(s), K; one per structure allowed; or a schedule:
        a callable ``f(step)`` or ``(step, K)`` pairs, interpolated linearly
        (:mod:`nvalchemi_ase.md.schedules`).
    friction : float or array_like, shape (B,)
        Friction, 1/ASE-time (``0.01 / ase.units.fs`` is 0.01 fs⁻¹); 0 gives
        velocity Verlet, as in ASE.
    fixcm : bool
        Must be False: nvalchemi's engine does not hold the centre of mass
        (ASE deprecated ``fixcm=True`` in 3.28; use ``fixcm=False``).
    rng : numpy.random.Generator, optional
        Source of the engine's seed (ASE's argument).
    seed : int, optional
        Engine seed; the same seed reproduces the same trajectory.
    **kwargs
        ``trajectory``, ``logfile``, ``loginterval`` and the options of
        :class:`~nvalchemi_ase.dynamics.base.BatchedDynamics`.
    """

    #: Per-structure arguments and thermostat state follow ``resize`` (the
    #: admitted structures' state as each would start alone).
    resizes_in_place = True
    structure_parameters: ClassVar[tuple[str, ...]] = ("temperature_K", "friction")

    _scheduled_fields: ClassVar[dict[str, str]] = {"temperature_K": "temperature"}

    def __init__(
        self,
        images: ImagesLike,
        timestep: float,
        temperature_K: float | Sequence[float] | Schedule,
        friction: float | Sequence[float],
        fixcm: bool = False,
        *,
        rng: RNGLike = None,
        seed: int | None = None,
        **kwargs: Any,
    ) -> None:
        if fixcm:
            raise ValueError(
                "fixcm=True is not supported: nvalchemi's Langevin engine does not "
                "hold the centre of mass fixed (and ASE deprecated fixcm); pass "
                "fixcm=False"
            )
        self.temperature_K = checked_numbers("temperature_K", temperature_K)
        self.friction = checked_numbers("friction", friction)
        self.fix_com = fixcm
        self.seed = resolve_seed(seed, rng)
        super().__init__(images, timestep, **kwargs)

    # -- ASE's attributes and setters ---------------------------------------------

    @property
    def temp(self) -> float | npt.NDArray[np.float64]:
        """k_B T of the bath, eV (ASE's attribute; one per structure for many)."""
        kelvin = np.broadcast_to(
            np.asarray(self.temperature_K, dtype=np.float64), (len(self.images),)
        )
        return as_given(self, units.kB * kelvin)

    @property
    def fr(self) -> float | npt.NDArray[np.float64]:
        """Friction, 1/ASE time unit (ASE's attribute)."""
        friction = np.asarray(self.friction, dtype=np.float64)
        return as_given(self, np.broadcast_to(friction, (len(self.images),)).copy())

    def set_temperature(
        self, temperature: Any = None, temperature_K: Any = None
    ) -> None:
        """Change the bath temperature from the next step on (ASE's method).

        Parameters
        ----------
        temperature : float or array_like, optional
            k_B T, eV (ASE's deprecated form).
        temperature_K : float, array_like (B,) or schedule, optional
            Temperature(s), K, or a schedule (a callable of the step count,
            ``(step, K)`` pairs; :mod:`nvalchemi_ase.md.schedules`).
        """
        if (temperature is None) == (temperature_K is None):
            raise TypeError("give exactly one of temperature (eV) and temperature_K")
        if temperature is not None:
            temperature_K = np.asarray(temperature, dtype=np.float64) / units.kB
        if as_schedule(temperature_K) is not None:  # followed from the next step
            self.temperature_K = checked_numbers("temperature_K", temperature_K)
            return
        self._per_structure("temperature_K", temperature_K)  # checked first
        self.temperature_K = temperature_K
        update_engine_state(
            self, "temperature", thermal_energy_nvalchemi(self._engine_temperature())
        )

    def set_friction(self, friction: Any) -> None:
        """Change the friction, 1/ASE time unit, from the next step on (ASE's).

        Parameters
        ----------
        friction : float or array_like, shape (B,)
            New friction(s), >= 0.
        """
        checked = self._per_structure("friction", friction)  # before any change
        self.friction = friction
        # the constructor's path: 1/ASE time -> 1/fs -> nvalchemi's internal rate
        per_fs = ase_rate_to_per_fs(checked)
        update_engine_state(self, "friction", per_fs * FS_PER_ASE_TIME)

    def set_timestep(self, timestep: float) -> None:
        """Change the time step, ASE time units, from the next step on (ASE's).

        Parameters
        ----------
        timestep : float
            New time step.
        """
        self.dt = positive_timestep(timestep)
        dt = self._per_structure("timestep", np.full(len(self.images), self.dt))
        update_engine_state(self, "dt", ase_time_to_fs(dt) / FS_PER_ASE_TIME)

    def todict(self) -> dict[str, Any]:
        """ASE's description plus the thermostat parameters."""
        return super().todict() | {
            "temperature_K": self._described("temperature_K"),
            "friction": np.asarray(self.friction).tolist(),
            "fixcm": self.fix_com,
            "seed": self.seed,
        }

    def build_engine(self, hooks: list[Any]) -> Any:
        """Build the nvalchemi engine (engine protocol, see ``BatchedDynamics``)."""
        dynamics = import_quietly("nvalchemi.dynamics")
        friction = self._per_structure("friction", self.friction)
        return dynamics.NVTLangevin(
            self.model,
            dt=ase_time_to_fs(self.dt),
            temperature=self._engine_temperature(),
            friction=ase_rate_to_per_fs(friction),
            random_seed=self.seed,
            hooks=hooks,
        )
