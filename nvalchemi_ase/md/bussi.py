"""``Bussi``: stochastic velocity rescaling NVT on ``engines.NVTBussi``."""

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
from nvalchemi_ase.md.parameters import as_given
from nvalchemi_ase.typing import ImagesLike, RNGLike
from nvalchemi_ase.units import ase_time_to_fs

__all__ = ["Bussi"]


class Bussi(BatchedMolecularDynamics):
    """Bussi–Donadio–Parrinello NVT for many structures, as ``ase.md.bussi.Bussi``.

    Velocity Verlet preceded, every step, by a stochastic rescaling of each
    structure's velocities (Bussi et al., J. Chem. Phys. 126, 014101 (2007)).
    The kinetic energy samples the canonical distribution of N_f = 3 × (atoms
    not fixed by ``FixAtoms``) degrees of freedom, ASE's count. The random
    numbers come from a seeded ``torch.Generator``, not from ``rng`` directly,
    so trajectories differ from ASE's while the ensemble is the same.

    Parameters
    ----------
    images : ase.Atoms or sequence of ase.Atoms
        Structures with their momenta (each must have kinetic energy, as in
        ASE).
    timestep : float
        Time step, ASE time units.
    temperature_K : float, array_like (B,) or schedule
        Target temperature(s), K, or a schedule: a callable ``f(step)`` or
        ``(step, K)`` pairs (:mod:`nvalchemi_ase.md.schedules`).
    taut : float or array_like, shape (B,)
        Thermostat time constant(s), ASE time units (``100 * ase.units.fs``).
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
    structure_parameters: ClassVar[tuple[str, ...]] = ("temperature_K", "taut")

    _scheduled_fields: ClassVar[dict[str, str]] = {"temperature_K": "kT"}

    def __init__(
        self,
        images: ImagesLike,
        timestep: float,
        temperature_K: float | Sequence[float],
        taut: float | Sequence[float],
        rng: RNGLike = None,
        *,
        seed: int | None = None,
        **kwargs: Any,
    ) -> None:
        self.temperature_K = checked_numbers("temperature_K", temperature_K)
        self.taut = checked_numbers("taut", taut)
        self.seed = resolve_seed(seed, rng)
        super().__init__(images, timestep, **kwargs)

    @property
    def temp(self) -> float | npt.NDArray[np.float64]:
        """k_B T of the bath, eV (ASE's attribute; one per structure for many)."""
        kelvin = np.asarray(self.temperature_K, dtype=np.float64)
        return as_given(self, units.kB * np.broadcast_to(kelvin, (len(self.images),)))

    @property
    def ndof(self) -> float | npt.NDArray[np.float64]:
        """Degrees of freedom the thermostat uses: ASE's count (3 per free atom)."""
        counts = [atoms.get_number_of_degrees_of_freedom() for atoms in self.images]
        return as_given(self, np.asarray(counts, dtype=np.float64))

    @property
    def target_kinetic_energy(self) -> float | npt.NDArray[np.float64]:
        """½ N_f k_B T, eV: the mean kinetic energy the thermostat aims at."""
        return as_given(self, 0.5 * np.asarray(self.temp) * np.asarray(self.ndof))

    @property
    def transferred_energy(self) -> float | npt.NDArray[np.float64]:
        """Energy the thermostat has added to each structure, eV, shape (B,).

        ``Etot - transferred_energy`` is conserved up to the integration error
        (ASE's attribute of the same name; a float for one ``Atoms``, as ASE).
        """
        energy = self.engine.transferred_energy
        if energy is None:
            return as_given(self, np.zeros(len(self.images)))
        return as_given(self, energy.detach().cpu().numpy().astype(np.float64))

    def todict(self) -> dict[str, Any]:
        """ASE's description plus the thermostat parameters."""
        return super().todict() | {
            "temperature_K": self._described("temperature_K"),
            "taut": np.asarray(self.taut).tolist(),
            "seed": self.seed,
        }

    def _check_inputs(self) -> None:
        self._per_structure("temperature_K", self.temperature_K)
        self._per_structure("taut", self.taut, strict=True)
        self._check_admitted(self.images)

    def _check_admitted(self, images: list[Any]) -> None:
        for index, atoms in enumerate(images):
            if np.isclose(atoms.get_kinetic_energy(), 0.0, rtol=0.0, atol=1e-12):
                raise ValueError(
                    f"images[{index}] has zero kinetic energy; Bussi rescales "
                    "velocities and cannot heat a structure at rest. Set initial "
                    "velocities first (e.g. MaxwellBoltzmannDistribution)"
                )

    def build_engine(self, hooks: list[Any]) -> Any:
        """Build the nvalchemi engine (engine protocol, see ``BatchedDynamics``)."""
        engines = import_quietly("nvalchemi_ase.engines.bussi")
        taut = self._per_structure("taut", self.taut, strict=True)
        return engines.NVTBussi(
            self.model,
            dt=ase_time_to_fs(self.dt),
            temperature=self._engine_temperature(),
            taut=ase_time_to_fs(taut),
            random_seed=self.seed,
            hooks=hooks,
        )
