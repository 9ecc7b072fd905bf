"""``Langevin``: NVT with nvalchemi's BAOAB Langevin engine (``NVTLangevin``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from nvalchemi_ase._quiet import import_quietly
from nvalchemi_ase.md.md import (
    BatchedMolecularDynamics,
    checked_numbers,
    resolve_seed,
)
from nvalchemi_ase.typing import ImagesLike, RNGLike
from nvalchemi_ase.units import (
    ase_rate_to_per_fs,
    ase_time_to_fs,
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
    temperature_K : float or array_like, shape (B,)
        Target temperature(s), K; one per structure allowed.
    friction : float or array_like, shape (B,)
        Friction, 1/ASE-time (``0.01 / ase.units.fs`` is 0.01 fs⁻¹).
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

    def __init__(
        self,
        images: ImagesLike,
        timestep: float,
        temperature_K: float | Sequence[float],
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

    def todict(self) -> dict[str, Any]:
        """ASE's description plus the thermostat parameters."""
        return super().todict() | {
            "temperature_K": np.asarray(self.temperature_K).tolist(),
            "friction": np.asarray(self.friction).tolist(),
            "fixcm": self.fix_com,
            "seed": self.seed,
        }

    def build_engine(self, hooks: list[Any]) -> Any:
        """Build the nvalchemi engine (engine protocol, see ``BatchedDynamics``)."""
        dynamics = import_quietly("nvalchemi.dynamics")
        friction = self._per_structure("friction", self.friction, strict=True)
        return dynamics.NVTLangevin(
            self.model,
            dt=ase_time_to_fs(self.dt),
            temperature=self._engine_temperature(),
            friction=ase_rate_to_per_fs(friction),
            random_seed=self.seed,
            hooks=hooks,
        )
