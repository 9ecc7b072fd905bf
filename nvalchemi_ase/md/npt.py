"""Constant-pressure MD on nvalchemi's MTK engines.

``IsotropicMTKNPT``, ``MTKNPT`` and ``NPH``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from nvalchemi_ase._quiet import import_quietly
from nvalchemi_ase.md.md import BatchedMolecularDynamics
from nvalchemi_ase.units import ase_time_to_fs

__all__ = ["MTKNPT", "NPH", "IsotropicMTKNPT"]


class _VariableCellMD(BatchedMolecularDynamics):
    """Checks and defaults shared by the constant-pressure integrators."""

    _pressure_coupling: ClassVar[str] = "isotropic"

    def _check_inputs(self) -> None:
        if "stress" not in self.model.model_config.outputs:
            raise ValueError(
                f"{type(self).__name__} needs stress, but {type(self.model).__name__} "
                "does not output it"
            )
        for index, atoms in enumerate(self.images):
            if not atoms.pbc.all() or atoms.cell.rank < 3:
                raise ValueError(
                    f"images[{index}] is not periodic in all three directions "
                    f"(pbc = {atoms.pbc.tolist()}); constant-pressure MD needs bulk "
                    "structures"
                )

    def default_skin(self) -> float:
        """Verlet skin of the neighbour list when none is given, Å."""
        # The engine rescales the cell every step; the skin test only watches
        # atom displacements, so the list is rebuilt every step.
        return 0.0

    def _pressure(self, pressure_au: Any) -> Any:
        return self._per_structure("pressure_au", pressure_au, minimum=-np.inf)


class IsotropicMTKNPT(_VariableCellMD):
    """Isotropic MTK NPT (Nosé-Hoover chains on particles and volume), as ASE's.

    Parameters
    ----------
    images : ase.Atoms or sequence of ase.Atoms
        Bulk structures (periodic in x, y, z) with their momenta.
    timestep : float
        Time step, ASE time units.
    temperature_K : float or array_like, shape (B,)
        Target temperature(s), K.
    pressure_au : float or array_like, shape (B,)
        Target pressure(s), eV/Å³ (``1 * ase.units.GPa`` = 1 GPa).
    tdamp, pdamp : float
        Thermostat and barostat time constants, ASE time units (ASE suggests
        100 and 1000 time steps).
    tchain, pchain : int
        Chain lengths; nvalchemi uses one length for both, so they must match.
    tloop, ploop : int
        Must be 1 (no sub-loops in nvalchemi's engine).
    **kwargs
        ``trajectory``, ``logfile``, ``loginterval`` and the options of
        :class:`~nvalchemi_ase.dynamics.base.BatchedDynamics`.
    """

    _pressure_coupling: ClassVar[str] = "isotropic"

    def __init__(
        self,
        images: Any,
        timestep: float,
        temperature_K: float | Sequence[float],
        pressure_au: float | Sequence[float],
        tdamp: float,
        pdamp: float,
        tchain: int = 3,
        pchain: int = 3,
        tloop: int = 1,
        ploop: int = 1,
        **kwargs: Any,
    ) -> None:
        if tchain != pchain:
            raise ValueError(
                f"tchain={tchain} and pchain={pchain} differ; nvalchemi's NPT uses one "
                "chain length for thermostat and barostat"
            )
        if (tloop, ploop) != (1, 1):
            raise ValueError(
                "tloop and ploop must be 1 (nvalchemi's NPT has no sub-loops)"
            )
        self.temperature_K = temperature_K
        self.pressure_au = pressure_au
        self.tdamp = tdamp
        self.pdamp = pdamp
        self.tchain = int(tchain)
        super().__init__(images, timestep, **kwargs)

    def todict(self) -> dict[str, Any]:
        """ASE's description plus the ensemble parameters."""
        return super().todict() | {
            "temperature_K": np.asarray(self.temperature_K).tolist(),
            "pressure_au": np.asarray(self.pressure_au).tolist(),
            "tdamp": self.tdamp,
            "pdamp": self.pdamp,
            "tchain": self.tchain,
        }

    def build_engine(self, hooks: list[Any]) -> Any:
        """Build the nvalchemi engine (engine protocol, see ``BatchedDynamics``)."""
        dynamics = import_quietly("nvalchemi.dynamics")
        return dynamics.NPT(
            self.model,
            dt=ase_time_to_fs(self.dt),
            temperature=self._engine_temperature(),
            pressure=self._pressure(self.pressure_au),
            barostat_time=ase_time_to_fs(float(self.pdamp)),
            thermostat_time=ase_time_to_fs(float(self.tdamp)),
            pressure_coupling=self._pressure_coupling,
            chain_length=self.tchain,
            hooks=hooks,
        )


class MTKNPT(IsotropicMTKNPT):
    """MTK NPT with full (9 degree-of-freedom) cell fluctuations, as ASE's ``MTKNPT``.

    Same parameters as :class:`IsotropicMTKNPT`; runs nvalchemi's ``NPT`` with
    ``pressure_coupling="triclinic"``.
    """

    _pressure_coupling: ClassVar[str] = "triclinic"


class NPH(_VariableCellMD):
    """Constant enthalpy (MTK barostat, no thermostat) on nvalchemi's ``NPH``.

    ASE has no NPH class; the arguments follow ``IsotropicMTKNPT``'s.

    Parameters
    ----------
    images : ase.Atoms or sequence of ase.Atoms
        Bulk structures with their momenta.
    timestep : float
        Time step, ASE time units.
    pressure_au : float or array_like, shape (B,)
        Target pressure(s), eV/Å³.
    pdamp : float
        Barostat time constant, ASE time units.
    pressure_coupling : {"isotropic", "anisotropic", "triclinic"}
        Which cell degrees of freedom move.
    **kwargs
        ``trajectory``, ``logfile``, ``loginterval`` and the options of
        :class:`~nvalchemi_ase.dynamics.base.BatchedDynamics`.
    """

    def __init__(
        self,
        images: Any,
        timestep: float,
        pressure_au: float | Sequence[float],
        pdamp: float,
        pressure_coupling: str = "isotropic",
        **kwargs: Any,
    ) -> None:
        if pressure_coupling not in ("isotropic", "anisotropic", "triclinic"):
            raise ValueError(
                f"pressure_coupling={pressure_coupling!r}; use 'isotropic', "
                "'anisotropic' or 'triclinic'"
            )
        self.pressure_au = pressure_au
        self.pdamp = pdamp
        self.pressure_coupling = pressure_coupling
        super().__init__(images, timestep, **kwargs)

    def todict(self) -> dict[str, Any]:
        """ASE-style description plus the barostat parameters."""
        return super().todict() | {
            "pressure_au": np.asarray(self.pressure_au).tolist(),
            "pdamp": self.pdamp,
            "pressure_coupling": self.pressure_coupling,
        }

    def build_engine(self, hooks: list[Any]) -> Any:
        """Build the nvalchemi engine (engine protocol, see ``BatchedDynamics``)."""
        dynamics = import_quietly("nvalchemi.dynamics")
        return dynamics.NPH(
            self.model,
            dt=ase_time_to_fs(self.dt),
            pressure=self._pressure(self.pressure_au),
            barostat_time=ase_time_to_fs(float(self.pdamp)),
            pressure_coupling=self.pressure_coupling,
            hooks=hooks,
        )
