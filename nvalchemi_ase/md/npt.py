"""Constant-pressure MD on MTK engines.

``IsotropicMTKNPT``, ``MTKNPT`` and ``NPH``.

``IsotropicMTKNPT``/``MTKNPT`` run :class:`nvalchemi_ase.engines.mtk.ChainNPT`:
nvalchemi 0.3's ``NPT`` with its own length for each Nosé-Hoover chain
(ASE's ``tchain`` for the particles, ``pchain`` for the barostat; nvalchemi's
engine takes one), with nvalchemi's kernels and splitting, safe with chains
of length 1 and without the nvalchemiops deprecation warnings (see that
module). ``NPH`` runs nvalchemi's ``NPH``, subclassed here
(:func:`_nph_engine_class`) only to ignore those warnings, under
:func:`warnings.catch_warnings` (the process's filters are left as they were).

Units: ASE's at this interface (time steps and ``tdamp``/``pdamp`` in ASE time
units, temperatures in K, pressures in eV/Å³), nvalchemi's in the engines (fs,
K with nvalchemi's ``KB_EV``, eV/Å³), converted with :mod:`nvalchemi_ase.units`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import numpy.typing as npt
import torch
from ase import Atoms

from nvalchemi_ase._compat import engine_state
from nvalchemi_ase._quiet import import_quietly
from nvalchemi_ase.dynamics.images import integer_argument
from nvalchemi_ase.md.md import VariableCellMolecularDynamics
from nvalchemi_ase.typing import ImagesLike
from nvalchemi_ase.units import ase_time_to_fs

if TYPE_CHECKING:
    from nvalchemi.data import Batch

__all__ = ["MTKNPT", "NPH", "IsotropicMTKNPT"]

#: Degrees of freedom nvalchemi 0.3's ``NPT`` thermostats with the barostat
#: chain: ``3 * (cell_dofs // 3)`` (``NPT.pre_update``), i.e. 3 for
#: ``"isotropic"`` (where ASE's ``IsotropicMTKBarostat`` counts 1) and 9 for
#: ``"triclinic"`` (as ASE's ``MTKBarostat``).
_BAROSTAT_CHAIN_DOF = {"isotropic": 3, "anisotropic": 3, "triclinic": 9}


def _chain_energy(
    eta: torch.Tensor,
    eta_dot: torch.Tensor,
    masses: torch.Tensor,
    dof: torch.Tensor,
    kT: torch.Tensor,
) -> torch.Tensor:
    """``Σ_j ½ Q_j η̇_j² + N_f kT η_1 + kT Σ_{j≥2} η_j`` per structure, eV, [B]."""
    kinetic = (0.5 * masses * eta_dot**2).sum(dim=1)
    return kinetic + dof * kT * eta[:, 0] + kT * eta[:, 1:].sum(dim=1)


@functools.cache
def _nph_engine_class() -> type:
    """Return nvalchemi's ``NPH`` without its kernels' deprecation warnings."""
    dynamics = import_quietly("nvalchemi.dynamics")
    mtk = import_quietly("nvalchemi_ase.engines.mtk")

    class NPH(dynamics.NPH):  # type: ignore[misc,name-defined]
        """The ``NPH`` engine without its kernels' deprecation warnings."""

        def pre_update(self, batch: Batch) -> None:
            with mtk.deprecated_arguments_ignored():
                super().pre_update(batch)

        def post_update(self, batch: Batch) -> None:
            with mtk.deprecated_arguments_ignored():
                super().post_update(batch)

    return NPH


class IsotropicMTKNPT(VariableCellMolecularDynamics):
    """Isotropic MTK NPT (Nosé-Hoover chains on particles and volume), as ASE's.

    Parameters
    ----------
    images : ase.Atoms or sequence of ase.Atoms
        Bulk structures (periodic in x, y, z) with their momenta.
    timestep : float
        Time step, ASE time units.
    temperature_K : float, array_like (B,) or schedule
        Target temperature(s), K, or a schedule: a callable ``f(step)`` or
        ``(step, K)`` pairs (:mod:`nvalchemi_ase.md.schedules`).
    pressure_au : float, array_like (B,) or schedule
        Target pressure(s), eV/Å³ (``1 * ase.units.GPa`` = 1 GPa), or a
        schedule of them.
    tdamp, pdamp : float
        Thermostat and barostat time constants, ASE time units (ASE suggests
        100 and 1000 time steps).
    tchain, pchain : int
        Lengths (>= 1) of the particle and barostat Nosé-Hoover chains; they
        may differ (nvalchemi's engine sizes both with one ``chain_length``;
        :class:`~nvalchemi_ase.engines.mtk.ChainNPT` gives each its own).
    tloop, ploop : int
        Must be 1 (no sub-loops in nvalchemi's engine).
    **kwargs
        ``trajectory``, ``logfile``, ``loginterval`` and the options of
        :class:`~nvalchemi_ase.dynamics.base.BatchedDynamics`.
    """

    _pressure_coupling: ClassVar[str] = "isotropic"
    _scheduled_fields: ClassVar[dict[str, str]] = {
        "temperature_K": "temperature",
        "pressure_au": "pressure",
    }

    def __init__(
        self,
        images: ImagesLike,
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
        for name, links in (("tchain", tchain), ("pchain", pchain)):
            # nvalchemiops' chain kernel has no guard: 0 links crash the process
            if integer_argument(name, links, "thermostats in the chain") < 1:
                raise ValueError(f"{name} must be >= 1, got {links}")
        if (tloop, ploop) != (1, 1):
            raise ValueError(
                "tloop and ploop must be 1 (nvalchemi's NPT has no sub-loops)"
            )
        self.temperature_K = temperature_K
        self.pressure_au = pressure_au
        self.tdamp = tdamp
        self.pdamp = pdamp
        self.tchain = int(tchain)
        self.pchain = int(pchain)
        super().__init__(images, timestep, **kwargs)

    def todict(self) -> dict[str, Any]:
        """ASE's description plus the ensemble parameters."""
        return super().todict() | {
            "temperature_K": self._described("temperature_K"),
            "pressure_au": self._described("pressure_au"),
            "tdamp": self.tdamp,
            "pdamp": self.pdamp,
            "tchain": self.tchain,
            "pchain": self.pchain,
        }

    def get_conserved_energy(self) -> float | npt.NDArray[np.float64]:
        """Return the MTK extended energy of each structure, eV (ASE's quantity).

        ``E_pot + E_kin + P_ext V + K_cell`` plus the energies of the particle
        chain (``Σ ½ Q_j η̇_j² + 3N kT η_1 + kT Σ_{j≥2} η_j``) and of the
        barostat chain (``Σ ½ Q'_j ξ̇_j² + n kT ξ_1 + kT Σ_{j≥2} ξ_j``), read
        from nvalchemi's engine state. ``K_cell = ½ W Σ ε̇²`` over the moving
        components of the strain rate ``ε̇`` (the engine's ``cell_velocity``):
        nvalchemi's ``W`` is ``(N+1) kT τ_P²`` per component, so for the
        isotropic cell (three equal diagonal entries) ``K_cell`` is ASE's
        ``p_ε²/2W`` with ASE's ``W = 3(N+1) kT τ_P²``; for the full cell it is
        ASE's ``Σ p_g²/2W``. The particle chain's masses, positions and
        velocities are ASE's (``Q_1 = 3N kT τ_T²``, ``η̇ = p_η/Q``; no factor 2
        here, unlike nvalchemi's ``NVTNoseHoover``). The barostat chain is
        nvalchemi's: ``n = 9`` and ``Q'_1 = 9 kT τ_P²`` for ``MTKNPT``, as
        ASE; for ``IsotropicMTKNPT`` nvalchemi thermostats the volume's
        momentum as 3 degrees of freedom (``n = 3``, ``Q'_1 = 3 kT τ_P²``)
        where ASE's ``IsotropicMTKBarostat`` counts 1 (``n = 1``,
        ``Q'_1 = 9 kT τ_P²``), so the quantity is the one nvalchemi's
        equations conserve; it equals ASE's while the barostat chain is at
        rest (at step 0, measured ``|Δ| < 1e-12`` eV).

        nvalchemi 0.3's ``NPT`` is not an MTK-consistent (time-reversible,
        second-order) integrator of these equations: the quantity drifts
        linearly in ``dt`` where ASE's drifts as ``dt²``. Measured on 32
        argon atoms (smooth LJ, 50 K, ``tdamp = 100 fs``, ``pdamp = 1000 fs``),
        drift over 1 ps: ours 2.8e-3 eV at 2 fs and 1.39e-3 eV at 1 fs
        (ratio 2.0, first order; both classes alike), ASE's 1.3e-5 and
        3.3e-6 eV (``IsotropicMTKNPT``), 1.5e-5 and 3.9e-6 eV (``MTKNPT``;
        ratio 4.0, second order). The drift comes from the
        particle thermostat: with ``pdamp = 1e7 fs`` (cell at rest) it stays
        (2e-3 eV/ps), with ``tdamp = 1e7 fs`` it falls to ASE's level
        (2e-5 eV/ps). nvalchemiops' ``_npt_thermostat_chain_update_kernel``
        computes both quarter kicks of ``η̇_1`` from the kinetic energy before
        the velocity scaling ``exp(-η̇_1 dt/2)``, which the engine applies
        after the chain update in both half steps (ASE scales between the
        kicks and mirrors the sequence), so the splitting is first order.
        Moving the scaling between the kicks (two kernel calls over
        ``dt/4`` around it) is not enough (measured, ``IsotropicMTKNPT``,
        1 ps: 9.5e-4 eV at 2 fs, 4.7e-4 at 1 fs, ratio 2.0): the kernel's
        link update ``η̇_k ← η̇_k exp(-η̇_{k+1} dt/4) + G_k dt/4`` is not
        self-adjoint (ASE's is ``exp(-η̇_{k+1} dt/8)``, kick,
        ``exp(-η̇_{k+1} dt/8)``). With that update as well (a torch copy of
        the kernel, an experiment only) it falls to 4.4e-5 and 1.7e-5 eV
        (ratio 2.6), so a second-order NPT needs its own chain update, not
        an orchestration of nvalchemiops' kernel.
        Different lengths (``tchain = 3, pchain = 2``; ``2, 4``) drift as
        equal ones (0.5 ps at 2 fs: 2.5e-3 eV for 3/2 as for 3/3, 1.4e-3 eV
        for 2/4). A one-link chain (``tchain`` or ``pchain`` = 1) runs with
        a frozen second link (:mod:`nvalchemi_ase.engines.mtk`) and drifts as
        much (3.1e-3 eV for ``tchain = 1``, 2.5e-3 eV for ``pchain = 1``);
        nvalchemiops' kernel on its own applies its "last link" update to a
        single link too, reading link -1 outside the structure's row (-0.1 eV
        in the first 150 steps at 2 fs, before this package's fix).

        Returns
        -------
        float or numpy.ndarray, shape (B,)
            A float when the dynamics was given one ``Atoms`` (as ASE), else
            one value per structure.
        """
        self._prime()  # ASE's call evaluates the current structure too
        thermo = self.per_structure_thermo()
        energy = thermo["epot"] + thermo["ekin"] + self._extended_energy()
        if isinstance(self.atoms, Atoms):
            return float(energy[0])
        return energy

    def _extended_energy(self) -> npt.NDArray[np.float64]:
        """``P_ext V + K_cell`` + both chains' energies per structure, eV, (B,)."""
        state = engine_state(self.engine)
        cell = self.batch.cell.detach().double()
        count = cell.shape[0]
        volume = torch.linalg.det(cell).abs()
        if state is None:  # before the engine's state: chains and cell at rest
            pressure = torch.as_tensor(
                self._pressure(self.pressure_au), dtype=torch.float64
            ).to(volume.device)
            return (pressure.reshape(count, -1)[:, 0] * volume).cpu().numpy()
        pressure = state.pressure.detach().double().reshape(count, -1)
        if pressure.shape[1] == 9:  # a [B, 3, 3] target: its mean normal part
            pressure = pressure[:, [0, 4, 8]]
        external = pressure.mean(dim=1) * volume
        kT = state.temperature.detach().double().reshape(-1)
        rate = state.cell_velocity.detach().double()
        if self._pressure_coupling == "triclinic":
            moving = rate.reshape(count, -1)
        else:
            moving = torch.diagonal(rate, dim1=-2, dim2=-1)
        cell_kinetic = 0.5 * state.W.detach().double() * (moving**2).sum(dim=1)
        atoms = state.num_atoms_per_system.detach().double().reshape(-1)
        particles = _chain_energy(
            state.nhc_eta.detach().double(),
            state.nhc_eta_dot.detach().double(),
            state.nhc_Q.detach().double(),
            3.0 * atoms,
            kT,
        )
        barostat = _chain_energy(
            state.nhc_b_eta.detach().double(),
            state.nhc_b_eta_dot.detach().double(),
            state.nhc_b_Q.detach().double(),
            torch.full_like(kT, float(_BAROSTAT_CHAIN_DOF[self._pressure_coupling])),
            kT,
        )
        return (external + cell_kinetic + particles + barostat).cpu().numpy()

    def build_engine(self, hooks: list[Any]) -> Any:
        """Build the nvalchemi engine (engine protocol, see ``BatchedDynamics``)."""
        engines = import_quietly("nvalchemi_ase.engines.mtk")
        return engines.ChainNPT(
            self.model,
            dt=ase_time_to_fs(self.dt),
            temperature=self._engine_temperature(),
            pressure=self._pressure(self.pressure_au),
            barostat_time=ase_time_to_fs(float(self.pdamp)),
            thermostat_time=ase_time_to_fs(float(self.tdamp)),
            pressure_coupling=self._pressure_coupling,
            chain_length=self.tchain,
            barostat_chain_length=self.pchain,
            hooks=hooks,
        )


class MTKNPT(IsotropicMTKNPT):
    """MTK NPT with full (9 degree-of-freedom) cell fluctuations, as ASE's ``MTKNPT``.

    Same parameters as :class:`IsotropicMTKNPT`; runs nvalchemi's ``NPT`` with
    ``pressure_coupling="triclinic"``.
    """

    _pressure_coupling: ClassVar[str] = "triclinic"


class NPH(VariableCellMolecularDynamics):
    """Constant enthalpy (MTK barostat, no thermostat) on nvalchemi's ``NPH``.

    ASE has no NPH class; the arguments follow ``IsotropicMTKNPT``'s.

    Parameters
    ----------
    images : ase.Atoms or sequence of ase.Atoms
        Bulk structures with their momenta.
    timestep : float
        Time step, ASE time units.
    pressure_au : float, array_like (B,) or schedule
        Target pressure(s), eV/Å³, or a schedule: a callable ``f(step)`` or
        ``(step, eV/Å³)`` pairs (:mod:`nvalchemi_ase.md.schedules`).
    pdamp : float
        Barostat time constant, ASE time units.
    pressure_coupling : {"isotropic", "anisotropic", "triclinic"}
        Which cell degrees of freedom move.
    **kwargs
        ``trajectory``, ``logfile``, ``loginterval`` and the options of
        :class:`~nvalchemi_ase.dynamics.base.BatchedDynamics`.
    """

    _scheduled_fields: ClassVar[dict[str, str]] = {"pressure_au": "pressure"}

    def __init__(
        self,
        images: ImagesLike,
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
            "pressure_au": self._described("pressure_au"),
            "pdamp": self.pdamp,
            "pressure_coupling": self.pressure_coupling,
        }

    def build_engine(self, hooks: list[Any]) -> Any:
        """Build the nvalchemi engine (engine protocol, see ``BatchedDynamics``)."""
        return _nph_engine_class()(
            self.model,
            dt=ase_time_to_fs(self.dt),
            pressure=self._pressure(self.pressure_au),
            barostat_time=ase_time_to_fs(float(self.pdamp)),
            pressure_coupling=self.pressure_coupling,
            hooks=hooks,
        )
