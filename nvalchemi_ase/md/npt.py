"""Constant-pressure MD on nvalchemi's MTK engines.

``IsotropicMTKNPT``, ``MTKNPT`` and ``NPH``.

The engines are nvalchemi 0.3's ``NPT`` and ``NPH``, subclassed here for two
things only (:func:`_engine_classes`):

* **Chains of length 1.** nvalchemiops 0.5's NHC kernel
  (``_npt_thermostat_chain_update_kernel``) reads ``eta_dot[s, 1]`` whatever
  the chain length. With ``chain_length=1`` that is one element past the end of
  structure s's row of the ``[B, 1]`` chain velocities: the next structure's
  chain velocity, or, for the last structure, the heap just past the end of
  the tensor. When those happen to hold 0 the step is what nvalchemi means; when
  they hold anything else the first step can already be NaN (most fresh
  processes on the CPU), and in a batch the structures' thermostats are
  coupled. The chain velocities of both chains (particles and cell) are
  therefore given a zero column the kernel can read and never writes: the
  engine's ``[B, 1]`` tensor becomes a view of a ``[B, 2]`` zero buffer. Runs
  that were finite before are unchanged bit for bit.
* **Deprecation warnings.** nvalchemi 0.3 passes ``cells_inv`` and ``volumes``
  to nvalchemiops 0.5 kernels that deprecated them, one ``DeprecationWarning``
  per kernel call; the integrator's half steps run with those two warnings
  ignored, under :func:`warnings.catch_warnings` (the process's filters are
  left as they were).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from nvalchemi_ase._quiet import import_quietly
from nvalchemi_ase.dynamics.images import integer_argument
from nvalchemi_ase.md.md import VariableCellMolecularDynamics
from nvalchemi_ase.typing import ImagesLike
from nvalchemi_ase.units import ase_time_to_fs

if TYPE_CHECKING:
    from nvalchemi.data import Batch

__all__ = ["MTKNPT", "NPH", "IsotropicMTKNPT"]

#: Messages of the nvalchemiops deprecations nvalchemi 0.3's NPT/NPH trigger.
_DEPRECATED_ARGUMENTS = ("'cells_inv' is deprecated", "'volumes' is deprecated")

#: The engine's NHC chain-velocity tensors, ``[B, chain_length]``.
_CHAIN_VELOCITIES = ("nhc_eta_dot", "nhc_b_eta_dot")


@contextlib.contextmanager
def _deprecated_arguments_ignored() -> Iterator[None]:
    """Ignore nvalchemiops' ``cells_inv``/``volumes`` deprecations in the block."""
    with warnings.catch_warnings():
        for message in _DEPRECATED_ARGUMENTS:
            warnings.filterwarnings(
                "ignore",
                message=message,
                category=DeprecationWarning,
                module=r"nvalchemiops\.",
            )
        yield


def _pad_chain_velocities(state: Batch, chain_length: int) -> None:
    """Give length-1 NHC chain velocities the zero column the kernel reads.

    nvalchemiops' ``_npt_thermostat_chain_update_kernel`` scales the first link
    by ``exp(-dt/4 * eta_dot[s, 1])`` for every chain length; with one link that
    index is out of bounds. Each ``[B, 1]`` chain-velocity tensor of ``state``
    is replaced by the first column of a ``[B, 2]`` buffer whose second column
    is zero (Warp indexes the view through its strides, so ``eta_dot[s, 1]``
    reads that zero; no kernel writes it). Idempotent; a no-op for longer
    chains, which the kernel indexes correctly.

    Parameters
    ----------
    state : nvalchemi.data.Batch
        The engine's per-structure state (``NPT._state``), modified in place.
    chain_length : int
        The engine's chain length.
    """
    if chain_length != 1:
        return
    for key in _CHAIN_VELOCITIES:
        velocities = getattr(state, key)
        if velocities.stride() == (2, 1):
            continue  # already a view of a padded buffer
        padded = velocities.new_zeros(velocities.shape[0], 2)
        padded[:, :1].copy_(velocities)
        state[key] = padded[:, :1]


@functools.cache
def _engine_classes() -> tuple[type, type]:
    """Return nvalchemi's ``NPT`` and ``NPH`` with the fixes of the module docstring."""
    dynamics = import_quietly("nvalchemi.dynamics")

    class NPT(dynamics.NPT):  # type: ignore[misc,name-defined]
        """The ``NPT`` engine, safe with ``chain_length=1``, without its warnings."""

        def pre_update(self, batch: Batch) -> None:
            # State may have been rebuilt (refill, reordering) since last step.
            _pad_chain_velocities(self._state, self.chain_length)
            with _deprecated_arguments_ignored():
                super().pre_update(batch)

        def post_update(self, batch: Batch) -> None:
            _pad_chain_velocities(self._state, self.chain_length)
            with _deprecated_arguments_ignored():
                super().post_update(batch)

    class NPH(dynamics.NPH):  # type: ignore[misc,name-defined]
        """The ``NPH`` engine without its kernels' deprecation warnings."""

        def pre_update(self, batch: Batch) -> None:
            with _deprecated_arguments_ignored():
                super().pre_update(batch)

        def post_update(self, batch: Batch) -> None:
            with _deprecated_arguments_ignored():
                super().post_update(batch)

    return NPT, NPH


class IsotropicMTKNPT(VariableCellMolecularDynamics):
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
        npt_engine, _ = _engine_classes()
        return npt_engine(
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


class NPH(VariableCellMolecularDynamics):
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
            "pressure_au": np.asarray(self.pressure_au).tolist(),
            "pdamp": self.pdamp,
            "pressure_coupling": self.pressure_coupling,
        }

    def build_engine(self, hooks: list[Any]) -> Any:
        """Build the nvalchemi engine (engine protocol, see ``BatchedDynamics``)."""
        _, nph_engine = _engine_classes()
        return nph_engine(
            self.model,
            dt=ase_time_to_fs(self.dt),
            pressure=self._pressure(self.pressure_au),
            barostat_time=ase_time_to_fs(float(self.pdamp)),
            pressure_coupling=self.pressure_coupling,
            hooks=hooks,
        )
