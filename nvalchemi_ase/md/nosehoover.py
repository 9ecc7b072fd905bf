"""``NoseHooverChainNVT``: NVT on nvalchemi's ``NVTNoseHoover`` engine."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from nvalchemi_ase._quiet import import_quietly
from nvalchemi_ase.dynamics.images import integer_argument
from nvalchemi_ase.md.md import BatchedMolecularDynamics, checked_numbers
from nvalchemi_ase.typing import ImagesLike
from nvalchemi_ase.units import ase_time_to_fs

__all__ = ["NoseHooverChainNVT"]


class NoseHooverChainNVT(BatchedMolecularDynamics):
    """Nosé-Hoover-chain NVT for many structures at once (ASE's arguments).

    Parameters
    ----------
    images : ase.Atoms or sequence of ase.Atoms
        Structures with their momenta.
    timestep : float
        Time step, ASE time units.
    temperature_K : float or array_like, shape (B,)
        Target temperature(s), K.
    tdamp : float or array_like, shape (B,)
        Thermostat time constant, ASE time units (ASE suggests ``100 * timestep``).
    tchain : int
        Chain length.
    tloop : int
        Must be 1 (nvalchemi's engine integrates the chain with a Yoshida
        scheme instead of ASE's sub-loops).
    **kwargs
        ``trajectory``, ``logfile``, ``loginterval`` and the options of
        :class:`~nvalchemi_ase.dynamics.base.BatchedDynamics`.
    """

    def __init__(
        self,
        images: ImagesLike,
        timestep: float,
        temperature_K: float | Sequence[float],
        tdamp: float | Sequence[float],
        tchain: int = 3,
        tloop: int = 1,
        **kwargs: Any,
    ) -> None:
        if integer_argument("tloop", tloop, "sub-loops per step") != 1:
            raise ValueError(
                f"tloop={tloop} is not supported; nvalchemi's NVTNoseHoover has no "
                "sub-loops (use tloop=1)"
            )
        if integer_argument("tchain", tchain, "thermostats in the chain") < 1:
            raise ValueError(f"tchain must be >= 1, got {tchain}")
        self.temperature_K = checked_numbers("temperature_K", temperature_K)
        self.tdamp = checked_numbers("tdamp", tdamp)
        self.tchain = int(tchain)
        self.tloop = tloop
        super().__init__(images, timestep, **kwargs)

    def todict(self) -> dict[str, Any]:
        """ASE's description plus the thermostat parameters."""
        return super().todict() | {
            "temperature_K": np.asarray(self.temperature_K).tolist(),
            "tdamp": np.asarray(self.tdamp).tolist(),
            "tchain": self.tchain,
        }

    def build_engine(self, hooks: list[Any]) -> Any:
        """Build the nvalchemi engine (engine protocol, see ``BatchedDynamics``)."""
        dynamics = import_quietly("nvalchemi.dynamics")
        tdamp = self._per_structure("tdamp", self.tdamp, strict=True)
        return dynamics.NVTNoseHoover(
            self.model,
            dt=ase_time_to_fs(self.dt),
            temperature=self._engine_temperature(),
            thermostat_time=ase_time_to_fs(tdamp),
            chain_length=self.tchain,
            hooks=hooks,
        )
