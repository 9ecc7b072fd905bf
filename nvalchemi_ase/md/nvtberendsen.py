"""``NVTBerendsen``: weak-coupling NVT on ``engines.NVTBerendsen``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from nvalchemi_ase._quiet import import_quietly
from nvalchemi_ase.md.md import BatchedMolecularDynamics, checked_numbers
from nvalchemi_ase.typing import ImagesLike
from nvalchemi_ase.units import ase_time_to_fs

__all__ = ["NVTBerendsen"]


class NVTBerendsen(BatchedMolecularDynamics):
    """Berendsen NVT for many structures, as ``ase.md.nvtberendsen.NVTBerendsen``.

    The same algorithm as ASE's, step for step: each structure's velocities
    are scaled by sqrt(1 + (T0/T − 1) dt/taut), clipped to [0.9, 1.1], with T
    over ASE's degrees of freedom (3 per atom not fixed by ``FixAtoms``), then
    a velocity Verlet step follows. The ensemble is not canonical: the
    kinetic energy fluctuates much less than in NVT.

    Parameters
    ----------
    images : ase.Atoms or sequence of ase.Atoms
        Structures with their momenta.
    timestep : float
        Time step, ASE time units.
    temperature_K : float, array_like (B,) or schedule
        Target temperature(s), K, or a schedule: a callable ``f(step)`` or
        ``(step, K)`` pairs (:mod:`nvalchemi_ase.md.schedules`).
    taut : float or array_like, shape (B,)
        Coupling time(s), ASE time units (``100 * ase.units.fs``).
    fixcm : bool
        As ASE (default True): after the first half kick each structure's
        mean momentum per atom is subtracted from every atom, so the total
        momentum stays zero. Refused for structures with ``FixAtoms``, where
        ASE's result depends on the forces on the fixed atoms; use
        ``fixcm=False`` for them.
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
        fixcm: bool = True,
        **kwargs: Any,
    ) -> None:
        self.temperature_K = checked_numbers("temperature_K", temperature_K)
        self.taut = checked_numbers("taut", taut)
        self.fix_com = bool(fixcm)
        super().__init__(images, timestep, **kwargs)

    def todict(self) -> dict[str, Any]:
        """ASE's description plus the thermostat parameters."""
        return super().todict() | {
            "temperature_K": self._described("temperature_K"),
            "taut": np.asarray(self.taut).tolist(),
            "fixcm": self.fix_com,
        }

    def _check_inputs(self) -> None:
        self._per_structure("temperature_K", self.temperature_K)
        self._per_structure("taut", self.taut, strict=True)
        self._check_admitted(self.images)

    def _check_admitted(self, images: list[Any]) -> None:
        if not self.fix_com:
            return
        for index, atoms in enumerate(images):
            if atoms.get_number_of_degrees_of_freedom() < 3 * len(atoms):
                raise ValueError(
                    f"images[{index}] has FixAtoms and fixcm=True: ASE's NVTBerendsen "
                    "then mixes half a kick of the fixed atoms' (unapplied) forces "
                    "into the momentum it removes, which this class does not "
                    "reproduce. Pass fixcm=False (fixed atoms anchor the structure)"
                )

    def build_engine(self, hooks: list[Any]) -> Any:
        """Build the nvalchemi engine (engine protocol, see ``BatchedDynamics``)."""
        engines = import_quietly("nvalchemi_ase.engines.berendsen")
        taut = self._per_structure("taut", self.taut, strict=True)
        return engines.NVTBerendsen(
            self.model,
            dt=ase_time_to_fs(self.dt),
            temperature=self._engine_temperature(),
            taut=ase_time_to_fs(taut),
            fix_com=self.fix_com,
            hooks=hooks,
        )
