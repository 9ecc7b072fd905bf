"""``LangevinBAOAB``: ASE 3.29's BAOAB Langevin (NVT, NPT, NPH) for many structures.

ASE's ``ase.md.langevinbaoab.LangevinBAOAB`` with its arguments, defaults and
warnings, on the batched engine
:class:`nvalchemi_ase.engines.langevin_hoover.LangevinHooverBAOAB`: BAOAB
Langevin for the atoms and, with ``externalstress``, the Langevin–Hoover
barostat for the cell (hydrostatic or fully variable). Without a temperature
and a stress it is velocity Verlet; without a temperature but with a stress,
NPH, deterministic and equal to ASE's class step for step (to rounding).
"""

from __future__ import annotations

import warnings
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt
from ase import units
from ase.stress import voigt_6_to_full_3x3_stress

from nvalchemi_ase._compat import engine_state
from nvalchemi_ase._quiet import import_quietly
from nvalchemi_ase.dynamics.base import DEFAULT_SKIN
from nvalchemi_ase.md.md import VariableCellMolecularDynamics, resolve_seed
from nvalchemi_ase.md.schedules import ScheduledParameter, as_schedule
from nvalchemi_ase.typing import ImagesLike
from nvalchemi_ase.units import FS_PER_ASE_TIME, ase_time_to_fs

__all__ = ["LangevinBAOAB"]

#: ASE's constant of the barostat-mass heuristic, ASE time units.
_MASS_HEURISTIC_TIME = 1.66 * units.fs


class LangevinBAOAB(VariableCellMolecularDynamics):
    """BAOAB Langevin dynamics for many structures, as ASE's ``LangevinBAOAB``.

    Parameters
    ----------
    images : ase.Atoms or sequence of ase.Atoms
        Structures with their momenta (bulk, periodic in 3-D, with
        ``externalstress``).
    timestep : float
        Time step, ASE time units.
    temperature_K : float, array_like (B,) or schedule, optional
        Temperature(s), K; None for NVE or NPH; or a schedule: a callable
        ``f(step)`` or ``(step, K)`` pairs (:mod:`nvalchemi_ase.md.schedules`).
    externalstress : float or array_like, optional
        Stress the barostat holds, eV/Å³ (ASE units; *negative* compresses:
        ``-1 * ase.units.GPa`` is a pressure of 1 GPa): a scalar, a 3-vector
        (diagonal), a Voigt 6-vector or a 3×3 matrix, the same for every
        structure; only a scalar with ``hydrostatic=True``. None: fixed cell.
        Or a schedule of scalars (a callable ``f(step)`` or ``(step, value)``
        pairs; one value or one per structure), held as ``value * 1``.
        The mean stress held includes the kinetic (ideal-gas) part.
    hydrostatic : bool
        Keep each cell's shape; only its volume changes.
    T_tau : float, optional
        Langevin time of the atoms, ASE time units; default ``50 * timestep``
        (with a warning, as ASE).
    P_tau : float, optional
        Time of the cell fluctuations (and the cell's Langevin time),
        ASE time units; default ``20 * T_tau``, or ``1000 * timestep``
        without a temperature (with a warning).
    P_mass : float, optional
        Barostat mass, eV (ASE time)²; default ASE's heuristic
        ``((P_tau / 4) / (1.66 fs) * N^(1/6))² * P_mass_factor`` for each
        structure of N atoms (with a warning).
    P_mass_factor : float
        Factor on the heuristic mass.
    disable_cell_langevin : bool
        No Langevin thermostat on the cell even with a temperature.
    rng : numpy.random.Generator or int, optional
        Source of the engine's seed (ASE's argument; an int seeds a new
        generator). The random numbers themselves come from a seeded
        ``torch.Generator``, so stochastic trajectories differ from ASE's while
        the ensemble is the same.
    seed : int, optional
        Engine seed; the same seed and batch reproduce the same trajectories.
    **kwargs
        ``trajectory``, ``logfile``, ``loginterval`` and the options of
        :class:`~nvalchemi_ase.dynamics.base.BatchedDynamics`.

    Attributes
    ----------
    T_tau, P_tau : float or None
        The time constants used, ASE time units.
    barostat_mass : float, numpy.ndarray of shape (B,), or None
        The barostat mass, eV (ASE time)²: a float for one structure (ASE),
        one per structure for several.
    externalstress : float, numpy.ndarray (3, 3), or None
        As ASE stores it (a scalar when hydrostatic).
    """

    externalstress = ScheduledParameter()
    _scheduled_fields: ClassVar[dict[str, str]] = {
        "temperature_K": "kT",
        "externalstress": "external_stress",
    }

    def __init__(
        self,
        images: ImagesLike,
        timestep: float,
        *,
        temperature_K: Any = None,
        externalstress: Any = None,
        hydrostatic: bool = False,
        T_tau: float | None = None,  # noqa: N803 - ASE's name
        P_tau: float | None = None,  # noqa: N803 - ASE's name
        P_mass: float | None = None,  # noqa: N803 - ASE's name
        P_mass_factor: float = 1.0,  # noqa: N803 - ASE's name
        disable_cell_langevin: bool = False,
        rng: Any = None,
        seed: int | None = None,
        **kwargs: Any,
    ) -> None:
        self.hydrostatic = bool(hydrostatic)
        self.externalstress = (
            externalstress
            if as_schedule(externalstress) is not None
            else _external_stress(externalstress, self.hydrostatic)
        )
        self.temperature_K = temperature_K
        self.disable_cell_langevin = bool(disable_cell_langevin)
        if isinstance(rng, int | np.integer):
            rng = np.random.default_rng(int(rng))
        self.seed = resolve_seed(seed, rng)
        self._seed_drawn = rng is None and seed is None
        self._T_tau_given, self._P_tau_given = T_tau, P_tau
        self._P_mass_given, self.P_mass_factor = P_mass, float(P_mass_factor)
        self._p_eps_live: npt.NDArray[np.float64] | None = None
        super().__init__(images, timestep, **kwargs)

    # -- ASE's defaults -----------------------------------------------------------

    @property
    def T_tau(self) -> float | None:  # noqa: N802 - ASE's attribute name
        """Langevin time of the atoms, ASE time units (None without temperature)."""
        if self._T_tau_given is not None or self.temperature_K is None:
            return self._T_tau_given
        return 50.0 * self.dt

    @property
    def P_tau(self) -> float | None:  # noqa: N802 - ASE's attribute name
        """Time of the cell fluctuations, ASE time units (None without a barostat)."""
        if self._P_tau_given is not None or self.externalstress is None:
            return self._P_tau_given
        T_tau = self.T_tau  # noqa: N806
        return 20.0 * T_tau if T_tau is not None else 1000.0 * self.dt

    @property
    def barostat_mass(self) -> Any:
        """Barostat mass, eV (ASE time)² (None without a barostat).

        One structure: a float, as ASE; several: shape (B,), one per structure.
        """
        masses = self._barostat_masses()
        if masses is None or len(masses) != 1:
            return masses
        return float(masses[0])

    def _barostat_masses(self) -> npt.NDArray[np.float64] | None:
        """Barostat mass of each structure, eV (ASE time)², shape (B,)."""
        if self.externalstress is None:
            return None
        count = len(self.images)
        if self._P_mass_given is not None:
            return np.full(count, float(self._P_mass_given))
        P_tau = self.P_tau  # noqa: N806
        assert P_tau is not None  # noqa: S101 - set with a barostat
        sizes = np.array([len(atoms) for atoms in self.images], dtype=np.float64)
        heuristic = ((P_tau / 4.0) / _MASS_HEURISTIC_TIME * sizes ** (1.0 / 6.0)) ** 2
        return heuristic * self.P_mass_factor

    @property
    def p_eps(self) -> Any:
        """The barostat momentum, eV · ASE time (ASE's attribute; None without one).

        One structure: a float (``hydrostatic``) or a (3, 3) array, as ASE;
        several: shape (B,) or (B, 3, 3). 0.0 before the first step, as ASE.
        As ASE's, the array is one object updated in place at every step
        (ASE's ``p_eps += ...``): a reference kept, e.g. in ``atoms.info``,
        follows the run, and a trajectory frame written before an observer
        that stores it holds the value of its own step.
        """
        if self.externalstress is None:
            return None
        value = self._current_p_eps()
        if isinstance(value, np.ndarray):
            if self._p_eps_live is None or self._p_eps_live.shape != value.shape:
                self._p_eps_live = value
            else:
                self._p_eps_live[...] = value
            return self._p_eps_live
        return value

    def _current_p_eps(self) -> Any:
        """Return a fresh copy of the barostat momentum (see :attr:`p_eps`)."""
        state = engine_state(self.engine)
        count = len(self.images)
        if state is None or self.nsteps == 0:
            return (
                0.0
                if count == 1
                else np.zeros(count if self.hydrostatic else (count, 3, 3))
            )
        momentum = state.p_eps.detach().cpu().numpy().astype(np.float64)
        value: Any = momentum[:, 0, 0] if self.hydrostatic else momentum
        if count == 1:
            return float(value[0]) if self.hydrostatic else value[0]
        return value

    def step(self) -> None:
        """One step (ASE's ``step``); a :attr:`p_eps` array handed out follows it."""
        super().step()
        if not self._run_is_stepping:
            self._refresh_properties()

    def _refresh_properties(self) -> None:
        """Bring a :attr:`p_eps` array already handed out to this step (ASE's)."""
        super()._refresh_properties()
        if self._p_eps_live is not None and self.externalstress is not None:
            value = self._current_p_eps()
            if isinstance(value, np.ndarray) and value.shape == self._p_eps_live.shape:
                self._p_eps_live[...] = value

    def todict(self) -> dict[str, Any]:
        """ASE's description plus the thermostat and barostat parameters."""
        return super().todict() | {
            "temperature_K": self._described("temperature_K"),
            "externalstress": self._described("externalstress"),
            "hydrostatic": self.hydrostatic,
            "T_tau": self.T_tau,
            "P_tau": self.P_tau,
            "seed": self.seed,
        }

    # -- engine protocol ----------------------------------------------------------

    def _check_inputs(self) -> None:
        if self.temperature_K is not None:
            self._per_structure("temperature_K", self.temperature_K)
        given = {"T_tau": self._T_tau_given, "P_tau": self._P_tau_given}
        for name, value in given.items():
            if value is not None and not (np.isfinite(value) and value > 0):
                raise ValueError(
                    f"{name} must be positive (ASE time units), got {value}"
                )
        if self._P_mass_given is not None and not self._P_mass_given > 0:
            raise ValueError(f"P_mass must be positive, got {self._P_mass_given}")
        self._warn_defaults()
        if self.externalstress is not None:
            super()._check_inputs()  # stress output, periodic in 3-D

    def _warn_defaults(self) -> None:
        """ASE's warnings for defaulted time constants and the heuristic mass."""
        if self.temperature_K is not None and self._seed_drawn:
            warnings.warn(  # ASE's warning; the drawn seed reproduces the run
                f"No rng provided, generated one with seed={self.seed} (pass "
                "seed= or rng= for a reproducible run)",
                UserWarning,
                stacklevel=4,
            )
        if self.temperature_K is not None and self._T_tau_given is None:
            warnings.warn(
                "Got `temperature_K` but missing `T_tau`, defaulting to 50 * "
                f"`timstep` = {self.T_tau}",
                UserWarning,
                stacklevel=4,
            )
        if self.externalstress is None:
            return
        if self._P_tau_given is None:
            source = (
                ", got `T_tau`, defaulting to 20 * `T_tau`"
                if self.T_tau is not None
                else " and `T_tau`, defaulting to 1000 * `timestep`"
            )
            warnings.warn(
                f"Got `externalstress` but missing `P_tau`{source} = {self.P_tau}",
                UserWarning,
                stacklevel=4,
            )
        if self._P_mass_given is None:
            warnings.warn(
                f"Using heuristic P_mass {self.barostat_mass} from P_tau {self.P_tau}",
                UserWarning,
                stacklevel=4,
            )

    def default_skin(self) -> float:
        """Verlet skin of the neighbour list when none is given, Å."""
        if self.externalstress is None:
            return DEFAULT_SKIN
        return super().default_skin()

    def build_engine(self, hooks: list[Any]) -> Any:
        """Build the nvalchemi engine (engine protocol, see ``BatchedDynamics``)."""
        engines = import_quietly("nvalchemi_ase.engines.langevin_hoover")
        thermostat: dict[str, Any] = {}
        if self.temperature_K is not None:
            thermostat = {
                "temperature": self._engine_temperature(),
                "t_tau": ase_time_to_fs(float(self.T_tau or 0.0)),
            }
        barostat: dict[str, Any] = {}
        if self.externalstress is not None:
            stress = np.asarray(self.externalstress, dtype=np.float64)
            if stress.ndim == 1:  # a schedule's value per structure: [B, 3, 3]
                stress = stress[:, None, None] * np.eye(3)
            cell_langevin = self.temperature_K is not None and not (
                self.disable_cell_langevin
            )
            mass = self._barostat_masses()
            assert mass is not None  # noqa: S101 - with a barostat
            barostat = {
                "external_stress": stress * np.eye(3) if stress.ndim == 0 else stress,
                "barostat_mass": mass * FS_PER_ASE_TIME**2,
                "p_tau": ase_time_to_fs(float(self.P_tau or 0.0))
                if cell_langevin
                else None,
                "hydrostatic": self.hydrostatic,
            }
        return engines.LangevinHooverBAOAB(
            self.model,
            dt=ase_time_to_fs(self.dt),
            random_seed=self.seed,
            hooks=hooks,
            **thermostat,
            **barostat,
        )


def _external_stress(value: Any, hydrostatic: bool) -> Any:
    """ASE's ``externalstress`` as ASE stores it: a scalar (hydrostatic) or 3×3."""
    if value is None:
        return None
    if isinstance(value, str | bool):
        raise TypeError(
            f"externalstress must be a number or an array (eV/Å³), got {value!r}"
        )
    array = np.asarray(value, dtype=np.float64).reshape(-1)
    if not np.isfinite(array).all():
        raise ValueError(f"externalstress must be finite, got {array.tolist()}")
    if hydrostatic:
        if array.shape != (1,):
            raise ValueError(
                "externalstress must be scalar when hydrostatic, got shape "
                f"{np.shape(value)}"
            )
        return float(array[0])
    if array.shape == (1,):
        return array[0] * np.identity(3)
    if array.shape == (3,):
        return np.diag(array)
    if array.shape == (6,):
        return voigt_6_to_full_3x3_stress(array)
    if array.shape == (9,):
        return array.reshape(3, 3)
    raise ValueError(
        "externalstress must be scalar, 3-vector (diagonal), 6-vector (Voigt), or "
        f"3x3 matrix, got shape {np.shape(value)}"
    )
