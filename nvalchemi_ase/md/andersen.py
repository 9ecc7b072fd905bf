"""``Andersen``: stochastic-collision NVT on ``engines.NVTAndersen``."""

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
from nvalchemi_ase.units import ase_time_to_fs

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
    temperature_K : float or array_like, shape (B,)
        Bath temperature(s), K.
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

    def todict(self) -> dict[str, Any]:
        """ASE's description plus the thermostat parameters."""
        return super().todict() | {
            "temperature_K": np.asarray(self.temperature_K).tolist(),
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
