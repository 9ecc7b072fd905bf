"""``NoseHooverChainNVT``: NVT on nvalchemi's ``NVTNoseHoover`` engine."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt
from ase import Atoms

from nvalchemi_ase._compat import engine_state
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
    temperature_K : float, array_like (B,) or schedule
        Target temperature(s), K, or a schedule: a callable ``f(step)`` or
        ``(step, K)`` pairs (:mod:`nvalchemi_ase.md.schedules`).
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

    #: Per-structure arguments and thermostat state follow ``resize`` (the
    #: admitted structures' state as each would start alone).
    resizes_in_place = True
    structure_parameters: ClassVar[tuple[str, ...]] = ("temperature_K", "tdamp")

    _scheduled_fields: ClassVar[dict[str, str]] = {"temperature_K": "temperature"}

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
            "temperature_K": self._described("temperature_K"),
            "tdamp": np.asarray(self.tdamp).tolist(),
            "tchain": self.tchain,
        }

    def get_conserved_energy(self) -> float | npt.NDArray[np.float64]:
        """Return the conserved energy-like quantity of each structure, eV.

        ASE's quantity: ``E_pot + E_kin`` plus the chain's energy
        ``Σ_j ½ Q_j η̇_j² + N_f kT η_1 + kT Σ_{j≥2} η_j``, which the exact
        dynamics conserves (the integrator to O(dt²)). nvalchemi 0.3's chain
        update advances the chain positions η by η̇ dt in each of its two half
        steps, so the engine's ``nhc_eta`` is twice the η of the equations of
        motion (it does not enter them); the half is used here.

        Returns
        -------
        float or numpy.ndarray, shape (B,)
            A float when the dynamics was given one ``Atoms`` (as ASE), else
            one value per structure.
        """
        self._prime()  # ASE's call evaluates the current structure too
        thermo = self.per_structure_thermo()
        energy = thermo["epot"] + thermo["ekin"] + self._chain_energy()
        if isinstance(self.atoms, Atoms):
            return float(energy[0])
        return energy

    def _chain_energy(self) -> npt.NDArray[np.float64]:
        """Σ ½ Q η̇² + N_f kT η_1 + kT Σ_{j≥2} η_j per structure, eV, (B,)."""
        state = engine_state(self.engine)
        if state is None:
            return np.zeros(len(self.images))
        eta = 0.5 * state.nhc_eta.detach().double()  # see get_conserved_energy
        eta_dot = state.nhc_eta_dot.detach().double()
        kT = state.temperature.detach().double().reshape(-1)
        dof = state.nhc_ndof.detach().double().reshape(-1)
        kinetic = (0.5 * state.nhc_Q.detach().double() * eta_dot**2).sum(dim=1)
        potential = dof * kT * eta[:, 0] + kT * eta[:, 1:].sum(dim=1)
        return (kinetic + potential).cpu().numpy()

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
