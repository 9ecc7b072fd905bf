"""``Andersen``: stochastic-collision NVT on ``engines.NVTAndersen``."""

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
from nvalchemi_ase.md.schedules import as_schedule
from nvalchemi_ase.typing import ImagesLike, RNGLike
from nvalchemi_ase.units import ase_time_to_fs, thermal_energy_nvalchemi

__all__ = ["Andersen"]


class Andersen(BatchedMolecularDynamics):
    """Andersen NVT for many structures at once, as ``ase.md.andersen.Andersen``.

    Velocity Verlet in which, every step after the first half kick, each
    velocity component of each free atom is replaced with probability
    ``andersen_prob`` by a Maxwell–Boltzmann draw at ``temperature_K``
    (Andersen, J. Chem. Phys. 72, 2384 (1980)). The random numbers come from
    a seeded ``torch.Generator``, so trajectories differ from ASE's while the
    ensemble is the same.

    Parameters
    ----------
    images : ase.Atoms or sequence of ase.Atoms
        Structures with their momenta.
    timestep : float
        Time step, ASE time units.
    temperature_K : float, array_like (B,) or schedule
        Bath temperature(s), K, or a schedule: a callable ``f(step)`` or
        ``(step, K)`` pairs (:mod:`nvalchemi_ase.md.schedules`).
    andersen_prob : float or array_like, shape (B,)
        Collision probability per step and velocity component, in [0, 1].
    fixcm : bool
        Keep each structure's centre of mass at rest (default True, as ASE):
        its centre-of-mass velocity, over the atoms not fixed by
        ``FixAtoms``, is removed after the collisions and after the second
        half kick. The velocities then sample 3 × (free atoms) − 3 degrees of
        freedom instead of 3 × (free atoms).
    rng : numpy.random.Generator or RandomState, optional
        Source of the engine's seed (ASE's argument).
    seed : int, optional
        Engine seed; the same seed and batch reproduce the same trajectories.
    **kwargs
        ``trajectory``, ``logfile``, ``loginterval`` and the options of
        :class:`~nvalchemi_ase.dynamics.base.BatchedDynamics`.
    """

    #: Per-structure arguments and thermostat state follow ``resize`` (the
    #: admitted structures' state as each would start alone).
    resizes_in_place = True
    structure_parameters: ClassVar[tuple[str, ...]] = ("temperature_K", "andersen_prob")

    _scheduled_fields: ClassVar[dict[str, str]] = {"temperature_K": "kT"}

    def __init__(
        self,
        images: ImagesLike,
        timestep: float,
        temperature_K: float | Sequence[float],
        andersen_prob: float | Sequence[float],
        fixcm: bool = True,
        rng: RNGLike = None,
        *,
        seed: int | None = None,
        **kwargs: Any,
    ) -> None:
        self.temperature_K = checked_numbers("temperature_K", temperature_K)
        self.andersen_prob = checked_numbers("andersen_prob", andersen_prob)
        self.fix_com = bool(fixcm)
        self.seed = resolve_seed(seed, rng)
        super().__init__(images, timestep, **kwargs)

    # -- ASE's attributes and setters ---------------------------------------------

    @property
    def temp(self) -> float | npt.NDArray[np.float64]:
        """k_B T of the bath, eV (ASE's attribute; one per structure for many)."""
        kelvin = np.asarray(self.temperature_K, dtype=np.float64)
        return as_given(self, units.kB * np.broadcast_to(kelvin, (len(self.images),)))

    def set_temperature(self, temperature_K: Any) -> None:
        """Change the bath temperature, K, from the next step on (ASE's method).

        Parameters
        ----------
        temperature_K : float, array_like (B,) or schedule
            New temperature(s), K, or a schedule followed from the next step.
        """
        if as_schedule(temperature_K) is not None:
            self.temperature_K = checked_numbers("temperature_K", temperature_K)
            return
        self._per_structure("temperature_K", temperature_K)  # checked first
        self.temperature_K = temperature_K
        update_engine_state(
            self, "kT", thermal_energy_nvalchemi(self._engine_temperature())
        )

    def set_andersen_prob(self, andersen_prob: Any) -> None:
        """Change the collision probability from the next step on (ASE's method).

        Parameters
        ----------
        andersen_prob : float or array_like, shape (B,)
            New probability (probabilities) per step and velocity component.
        """
        previous, self.andersen_prob = self.andersen_prob, andersen_prob
        try:
            probabilities = self._probabilities()  # checked before any change
        except (TypeError, ValueError):
            self.andersen_prob = previous
            raise
        update_engine_state(self, "collision_probability", probabilities)

    def set_timestep(self, timestep: float) -> None:
        """Change the time step, ASE time units, from the next step on (ASE's).

        Parameters
        ----------
        timestep : float
            New time step.
        """
        self.dt = positive_timestep(timestep)
        self.engine.set_dt(ase_time_to_fs(self.dt))

    def todict(self) -> dict[str, Any]:
        """ASE's description plus the thermostat parameters."""
        return super().todict() | {
            "temperature_K": self._described("temperature_K"),
            "andersen_prob": np.asarray(self.andersen_prob).tolist(),
            "fixcm": self.fix_com,
            "seed": self.seed,
        }

    def _check_inputs(self) -> None:
        self._per_structure("temperature_K", self.temperature_K)
        self._probabilities()

    def _probabilities(self) -> Any:
        probability = self._per_structure("andersen_prob", self.andersen_prob)
        above = np.flatnonzero(probability.cpu().numpy() > 1.0)
        if above.size:
            index = int(above[0])
            raise ValueError(
                f"andersen_prob for images[{index}] is "
                f"{float(probability[index])}; it must be in [0, 1]"
            )
        return probability

    def build_engine(self, hooks: list[Any]) -> Any:
        """Build the nvalchemi engine (engine protocol, see ``BatchedDynamics``)."""
        engines = import_quietly("nvalchemi_ase.engines.andersen")
        return engines.NVTAndersen(
            self.model,
            dt=ase_time_to_fs(self.dt),
            temperature=self._engine_temperature(),
            collision_probability=self._probabilities(),
            fix_com=self.fix_com,
            random_seed=self.seed,
            hooks=hooks,
        )
