"""The molecular-dynamics half of the ASE contract (``ase.md.md.MolecularDynamics``)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import numpy.typing as npt
import torch
from ase.md.logger import MDLogger
from ase.parallel import world

from nvalchemi_ase.dynamics.base import BatchedDynamics
from nvalchemi_ase.dynamics.images import (
    integer_argument,
    real_argument,
    real_arguments,
)
from nvalchemi_ase.dynamics.logs import (
    internal,
    is_template,
    open_log,
    per_structure_targets,
)
from nvalchemi_ase.md.schedules import (
    Schedule,
    ScheduledParameter,
    ScheduleHook,
    as_schedule,
)
from nvalchemi_ase.typing import ImagesLike, LogfileLike, TrajectoryLike
from nvalchemi_ase.units import (
    ase_time_to_ps,
    temperature_K_to_nvalchemi,
    thermal_energy_nvalchemi,
)

if TYPE_CHECKING:
    from nvalchemi_ase.convert import CheckedImages

__all__ = [
    "BatchedMolecularDynamics",
    "VariableCellMolecularDynamics",
    "checked_numbers",
    "resolve_seed",
]


def resolve_seed(seed: int | None, rng: Any) -> int:
    """Return the integer seed nvalchemi's stochastic engines take.

    Parameters
    ----------
    seed : int or None
        Explicit seed (reproducible runs).
    rng : numpy.random.Generator or RandomState or None
        ASE-style random generator; a seed is drawn from it.

    Returns
    -------
    int
        ``seed``, a draw from ``rng``, or a fresh random seed.
    """
    if seed is not None and rng is not None:
        raise ValueError("give either seed or rng, not both")
    if seed is not None:
        return int(seed)
    source = rng if rng is not None else np.random.default_rng()
    draw = getattr(source, "integers", None) or getattr(source, "randint")  # noqa: B009
    return int(draw(0, 2**31 - 1))


class BatchedMolecularDynamics(BatchedDynamics):
    """ASE ``MolecularDynamics`` semantics over a batched nvalchemi integrator.

    Parameters
    ----------
    images : ase.Atoms or sequence of ase.Atoms
        The structures; missing momenta count as zero (ASE sets them to zero).
    timestep : float
        Time step in ASE time units (``2 * ase.units.fs`` is 2 fs).
    trajectory, logfile, loginterval, append_trajectory, model, device, dtype,
    neighbor_skin, restart, restart_interval
        See :class:`~nvalchemi_ase.dynamics.base.BatchedDynamics` (ASE's MD has
        no ``restart``; here it continues a run exactly).

    Targets (``temperature_K``, ``pressure_au``, ``externalstress``) may be
    schedules: a callable of the step count or ``(step, value)`` pairs,
    see :mod:`nvalchemi_ase.md.schedules`.
    """

    #: Targets that may follow a schedule (see :mod:`~nvalchemi_ase.md.schedules`).
    temperature_K = ScheduledParameter()
    pressure_au = ScheduledParameter()
    #: Engine-state field each schedulable target of this class writes (in
    #: subclasses, e.g. ``{"temperature_K": "kT"}``); empty: no schedules.
    _scheduled_fields: ClassVar[dict[str, str]] = {}
    #: The part it plays in ``optimizer + md`` / ``optimizer | md``.
    composition_role: ClassVar[str] = "md"
    #: Arguments (attribute names) given as one value or one per structure,
    #: which :meth:`resize` carries for the kept structures and takes for the
    #: admitted ones (``parameters=``).
    structure_parameters: ClassVar[tuple[str, ...]] = ()
    #: While :meth:`resize` builds the resized batch's engine: its size.
    _sizing: int | None = None

    def __init__(
        self,
        images: ImagesLike,
        timestep: float,
        trajectory: TrajectoryLike = None,
        logfile: LogfileLike = None,
        loginterval: int = 1,
        **kwargs: Any,
    ) -> None:
        self.dt = _positive("timestep", timestep)
        super().__init__(
            images,
            logfile=logfile,
            trajectory=trajectory,
            loginterval=loginterval,
            **kwargs,
        )
        self._check_schedules()
        if self._scheduled_fields:  # applies schedules given now or set later
            self.engine.register_hook(ScheduleHook(self))

    # -- ASE API ---------------------------------------------------------------

    def todict(self) -> dict[str, Any]:
        """Describe the run as ASE's ``MolecularDynamics.todict`` does."""
        return {
            "type": "molecular-dynamics",
            "md-type": type(self).__name__,
            "timestep": self.dt,
        }

    def get_time(self) -> float:
        """Elapsed simulated time, ASE time units (``nsteps * timestep``)."""
        return self.nsteps * self.dt

    def converged(self, gradient: Any = None) -> bool:
        """MD is 'converged' when the requested number of steps is done (ASE)."""
        return self.nsteps >= self.max_steps

    def irun(self, steps: int = 50, *, sync_atoms: bool = True) -> Iterator[bool]:
        """Run as a generator, yielding like ASE's ``MolecularDynamics.irun``.

        Parameters
        ----------
        steps : int
            Number of steps.
        sync_atoms : bool
            True (ASE's behaviour): the structures hold the current state at
            every yield. False: they are written only when an observer needs
            them and when the run ends (the runners' loop).

        Yields
        ------
        bool
            Whether the requested number of steps is done.
        """
        return self._irun(steps, sync_every_step=sync_atoms)

    def run(self, steps: int = 50) -> bool:
        """Run ``steps`` steps for every structure at once.

        Parameters
        ----------
        steps : int
            Number of steps.

        Returns
        -------
        bool
            True when the steps are done (ASE's return value).
        """
        converged = steps == 0
        for converged in self._irun(steps, sync_every_step=False):  # noqa: B007
            pass
        return converged

    def _irun(self, steps: int, sync_every_step: bool) -> Iterator[bool]:
        steps = integer_argument("steps", steps)
        if steps < 0:
            raise ValueError(f"steps must be >= 0, got {steps}")
        self.max_steps = self.nsteps + steps
        with self._running():
            self._prime()
            if self._fresh_start():  # ASE: _refresh_properties, log, call_observers
                self._refresh_properties()
                self.log()
                self._sync_if(sync_every_step or self._observers_due(0))
                self.call_observers()
            else:
                self._sync_if(sync_every_step)
            yield self.nsteps == self.max_steps
            while self.nsteps < self.max_steps:
                self._advance()  # step(), then nsteps += 1
                self._refresh_properties()
                self.log()
                self._sync_if(sync_every_step or self._observers_due(self.nsteps))
                self.call_observers()
                yield self.nsteps == self.max_steps

    def _refresh_properties(self) -> None:
        """ASE's hook before ``log`` and the observers (here: nothing to do).

        ASE's version calls ``atoms.get_forces()`` so that loggers and observers
        read cached results; here every step evaluates the model on the device
        and the ``Atoms`` receive the results when an observer is due. Kept so
        that subclasses overriding it are called where ASE calls it.
        """

    def log(self) -> None:
        """ASE's per-step logging hook (a no-op; logfiles are observers, as in ASE).

        Called after every step, before the observers, as ASE's ``irun`` does;
        subclasses may override it.
        """

    # -- resizing in place ------------------------------------------------------

    def resizable(self) -> bool:
        """Whether :meth:`resize` can change this object's structures in place.

        As :meth:`BatchedDynamics.resizable
        <nvalchemi_ase.dynamics.base.BatchedDynamics.resizable>`, and no
        target follows a schedule (a schedule is a function of this object's
        step count, which an admitted structure did not start at).
        """
        return super().resizable() and not self.schedules

    def parameter_table(self) -> dict[str, npt.NDArray[np.float64]]:
        """Return the per-structure arguments, one value per structure each.

        Returns
        -------
        dict of str to numpy.ndarray, shape (B,)
            For each name of :attr:`structure_parameters`, its value for each
            structure in :attr:`images` order (in the argument's own ASE unit;
            a scalar argument broadcast).
        """
        count = len(self.images)
        return {
            name: np.broadcast_to(
                np.asarray(getattr(self, name), dtype=np.float64), (count,)
            ).copy()
            for name in self.structure_parameters
        }

    def resize(
        self,
        keep: npt.ArrayLike,
        images: list[Any],
        *,
        trajectories: list[Any] | None = None,
        checked: bool | CheckedImages = False,
        parameters: dict[str, Any] | None = None,
    ) -> None:
        """Keep the structures ``keep`` and append ``images``, in place.

        As :meth:`BatchedDynamics.resize
        <nvalchemi_ase.dynamics.base.BatchedDynamics.resize>`; here the
        per-structure arguments (:attr:`structure_parameters`, e.g.
        ``temperature_K`` and ``friction``) follow too: the kept structures
        keep theirs, and the thermostat state (chain positions and momenta,
        transferred energy, ...) they carry; the admitted ones take
        ``parameters`` (or the common value, for an argument given as one)
        and start with the engine state each would have alone. The random
        streams of the stochastic thermostats are the engine's (its seed and
        step count, over the batch as it is), so they are reproducible for
        the same seed and the same sequence of resizes, not equal to each
        structure's run alone.

        Parameters
        ----------
        keep : array of int
            Indices into :attr:`images` of the structures that stay.
        images : list of ase.Atoms
            The structures to admit.
        trajectories : list of path or Trajectory, optional
            One per admitted structure; required when this object writes
            trajectories.
        checked : bool or CheckedImages
            The caller has already checked ``images`` (as the base class).
        parameters : dict, optional
            Per-structure arguments of the admitted structures, by name (one
            value, or one per admitted structure, in the argument's unit);
            required for an argument that was given one value per structure.

        Raises
        ------
        ValueError
            If this object is not :meth:`resizable`, a parameter is missing,
            unknown or out of range, or an admitted structure cannot be run
            (named by its position in ``images``); nothing is changed then.
        """
        if not self.resizable():
            super().resize(keep, images, trajectories=trajectories)  # raises
        kept = np.asarray(keep, dtype=np.intp).reshape(-1)
        values = self._resized_parameters(kept, len(images), parameters or {})
        previous = {name: getattr(self, name) for name in values}
        self._sizing = len(kept) + len(images)
        try:
            for name, value in values.items():
                setattr(self, name, value)
            self._check_admitted(images)
            self._fresh_engine = self.build_engine([]) if values else None
            super().resize(kept, images, trajectories=trajectories, checked=checked)
        except Exception:
            for name, value in previous.items():
                setattr(self, name, value)
            raise
        finally:
            self._sizing = None
            self._fresh_engine = None

    def _engine_for_resize(self) -> Any:
        return getattr(self, "_fresh_engine", None)

    def _check_admitted(self, images: list[Any]) -> None:
        """Check structures about to be admitted, as the constructor does."""

    def _resized_parameters(
        self, kept: npt.NDArray[np.intp], count: int, given: dict[str, Any]
    ) -> dict[str, Any]:
        """Return each per-structure argument for the kept, then admitted, ones."""
        unknown = sorted(set(given) - set(self.structure_parameters))
        if unknown:
            raise ValueError(
                f"{type(self).__name__}.resize: parameters {unknown} are not "
                f"per-structure arguments of this class {self.structure_parameters}"
            )
        values: dict[str, Any] = {}
        for name in self.structure_parameters:
            current = getattr(self, name)
            now = np.asarray(current, dtype=np.float64)
            if name in given:
                admitted = _one_per_structure(
                    name,
                    given[name],
                    count,
                    f"parameters[{name!r}]",
                    f"admitted structure ({count})",
                )
            elif now.ndim == 0:
                values[name] = current  # the admitted structures share it
                continue
            elif count:
                raise ValueError(
                    f"{name} was given one value per structure: give "
                    f"parameters={{{name!r}: ...}} for the {count} admitted structures"
                )
            else:
                admitted = np.zeros(0)
            before = np.broadcast_to(now, (len(self.images),))[kept]
            values[name] = np.concatenate([before, admitted])
        return values

    # -- logging ----------------------------------------------------------------

    def _setup_logging(self, logfile: Any) -> None:
        if not logfile:
            return
        if len(self.images) == 1 and not is_template(logfile):
            self.attach(
                self.closelater(
                    MDLogger(
                        dyn=self,
                        atoms=self.images[0],
                        logfile=logfile,
                        header=not self._continued,
                        comm=world,
                    )
                ),
                self.loginterval,
            )
            return
        if is_template(logfile):
            for atoms, path in zip(
                self.images,
                per_structure_targets(logfile, len(self.images)),
                strict=True,
            ):
                self.attach(
                    self.closelater(
                        MDLogger(
                            dyn=self,
                            atoms=atoms,
                            logfile=path,
                            header=not self._continued,
                            comm=world,
                        )
                    ),
                    self.loginterval,
                )
            return
        log = open_log(logfile)
        if self._continued:  # a continued run: the header is there
            self.attach(internal(self._write_batch_log), self.loginterval, log)
            return
        log.write(
            "%-9s %12s %12s %12s  %8s %8s %8s\n"
            % (
                "Time[ps]",
                "Etot/N[eV]",
                "Epot/N[eV]",
                "Ekin/N[eV]",
                "T[K]",
                "Tmin[K]",
                "Tmax[K]",
            )
        )
        self.attach(internal(self._write_batch_log), self.loginterval, log)

    def _write_batch_log(self, log: Any) -> None:
        thermo = self.per_structure_thermo()
        natoms = thermo["natoms"]
        epot = np.mean(thermo["epot"] / natoms)
        ekin = np.mean(thermo["ekin"] / natoms)
        temperature = thermo["temperature"]
        log.write(
            "%-10.4f %12.6f %12.6f %12.6f  %8.1f %8.1f %8.1f\n"
            % (
                ase_time_to_ps(self.get_time()),
                epot + ekin,
                epot,
                ekin,
                temperature.mean(),
                temperature.min(),
                temperature.max(),
            )
        )

    # -- schedules ------------------------------------------------------------------

    @property
    def schedules(self) -> dict[str, Schedule]:
        """Targets that follow a schedule, by argument name (empty: none)."""
        return dict(self.__dict__.get("_schedules", {}))

    def _check_schedules(self) -> None:
        """Refuse a schedule for a target this class cannot change per step."""
        for name in self.__dict__.get("_schedules", {}):
            if name not in self._scheduled_fields:
                raise ValueError(
                    f"{type(self).__name__} cannot follow a schedule for {name}; "
                    "give a number or one per structure"
                )

    def _described(self, name: str) -> Any:
        """Describe a target for ``todict()``: its schedule, or its values."""
        schedule = self.__dict__.get("_schedules", {}).get(name)
        if schedule is not None:
            return schedule.describe()
        value = getattr(self, name)
        return None if value is None else np.asarray(value).tolist()

    def _scheduled_block(
        self, name: str, steps: npt.NDArray[np.int64], values: npt.NDArray[np.float64]
    ) -> torch.Tensor:
        """Check a block of scheduled values and convert them for the engine.

        Parameters
        ----------
        name : str
            The target (``temperature_K``: K; ``pressure_au`` and
            ``externalstress``: eV/Å³).
        steps : numpy.ndarray, shape (L,)
            The steps the values are for.
        values : numpy.ndarray, shape (L,) or (L, B)
            The schedule's values at ``steps``.

        Returns
        -------
        torch.Tensor, shape [L, B]
            Values in the engine's units (temperatures as kT, eV), on the device.
        """
        count = len(self.images)
        if values.ndim == 1:
            values = np.repeat(values[:, None], count, axis=1)
        if values.shape[1:] != (count,):
            raise ValueError(
                f"the {name} schedule gives {values.shape[1]} values at step "
                f"{int(steps[0])}; give one value or one per structure ({count})"
            )
        minimum = 0.0 if name == "temperature_K" else -np.inf
        bad = ~np.isfinite(values) | (values < minimum)
        if bad.any():
            row, index = (int(i[0]) for i in np.nonzero(bad))
            raise ValueError(
                f"the {name} schedule gives {values[row, index]} for images[{index}] "
                f"at step {int(steps[row])}; it must be finite"
                + (" and >= 0 K" if name == "temperature_K" else "")
            )
        block = torch.as_tensor(values, dtype=self.setup.dtype).to(self.setup.device)
        if name == "temperature_K":
            return thermal_energy_nvalchemi(temperature_K_to_nvalchemi(block))
        return block

    # -- shared parameter handling ---------------------------------------------

    def _engine_temperature(self) -> torch.Tensor:
        """``self.temperature_K`` per structure [B], rescaled to nvalchemi's kB."""
        return temperature_K_to_nvalchemi(
            self._per_structure("temperature_K", self.temperature_K)
        )

    def _per_structure(
        self,
        name: str,
        value: float | Sequence[float] | npt.NDArray[Any],
        *,
        minimum: float = 0.0,
        strict: bool = False,
    ) -> torch.Tensor:
        """Return a scalar or one value per structure as a [B] tensor on the device.

        Strings, booleans and other non-numbers are a ``TypeError`` naming the
        argument and its unit (``np.asarray("300", dtype=float)`` would accept
        the string).
        """
        count = len(self.images) if self._sizing is None else self._sizing
        array = _one_per_structure(
            name, value, count, name, f"structure ({count} values)"
        )
        bad = ~np.isfinite(array) | (array <= minimum if strict else array < minimum)
        if bad.any():
            index = int(np.flatnonzero(bad)[0])
            relation = ">" if strict else ">="
            raise ValueError(
                f"{name} for images[{index}] is {array[index]}; it must be finite and "
                f"{relation} {minimum}"
            )
        return torch.as_tensor(array, dtype=self.setup.dtype, device=self.setup.device)


class VariableCellMolecularDynamics(BatchedMolecularDynamics):
    """Base of the constant-pressure integrators: the cell moves with the atoms.

    A subclass of :class:`BatchedMolecularDynamics` for engines that change the
    cell every step (``IsotropicMTKNPT``, ``MTKNPT``, ``NPH``; a new barostat
    starts here). It adds what every such engine needs:

    * a check, before any step, that the model outputs stress and that every
      structure is periodic in three directions (a clear ``ValueError``
      naming the structure otherwise);
    * a neighbour-list skin of 0 Å by default (the skin test watches atom
      displacements, not the cell, so the list is rebuilt every step);
    * :meth:`_pressure`, the per-structure external pressure [B] in eV/Å³ on
      the device (negative values allowed: tension).

    The class attribute ``_pressure_coupling`` (``"isotropic"`` or
    ``"triclinic"``) names the cell degrees of freedom the engine moves.
    Arguments as :class:`BatchedMolecularDynamics`.
    """

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


#: Units of the per-structure MD arguments, for error messages.
_UNITS = {
    "timestep": "ASE time units, e.g. 2 * ase.units.fs",
    "temperature_K": "K",
    "friction": "1/ASE time unit, e.g. 0.01 / ase.units.fs",
    "taut": "ASE time units, e.g. 100 * ase.units.fs",
    "tdamp": "ASE time units, e.g. 100 * timestep",
    "andersen_prob": "a probability per step, dimensionless",
    "pressure_au": "eV/Å³, e.g. 1.0 * ase.units.bar",
}


#: Arguments that may be schedules (:mod:`nvalchemi_ase.md.schedules`).
_SCHEDULABLE = frozenset({"temperature_K", "pressure_au", "externalstress"})


def checked_numbers(name: str, value: Any) -> Any:
    """Type-check a scalar-or-per-structure argument at construction.

    Its shape (one value or one per structure) and range are checked once the
    structures are known (:meth:`BatchedMolecularDynamics._per_structure`).

    Parameters
    ----------
    name : str
        The argument's name (its unit is looked up for the message).
    value : float or array_like
        The value as given.

    Returns
    -------
    Any
        ``value`` itself, or a :class:`~nvalchemi_ase.md.schedules.Schedule`
        for a callable or ``(step, value)`` pairs.

    Raises
    ------
    TypeError
        For strings, booleans and other non-numbers, naming the argument and
        its unit.
    """
    schedule = as_schedule(value) if name in _SCHEDULABLE else None
    if schedule is not None:
        return schedule
    real_arguments(name, value, _UNITS.get(name, "see the docstring"))
    return value


def _positive(name: str, value: float) -> float:
    """Return a positive finite scalar argument (``timestep``) as a float.

    Raises
    ------
    TypeError
        For a string, a boolean or another non-number (its unit is named).
    ValueError
        For zero, a negative or a non-finite value.
    """
    unit = _UNITS.get(name, "ASE time units")
    value = real_argument(name, value, unit)
    if not np.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be positive and finite ({unit}), got {value}")
    return value


def _one_per_structure(
    name: str, value: Any, count: int, label: str, each: str
) -> npt.NDArray[np.float64]:
    """``value`` (one number, or ``count`` numbers) as ``count`` floats.

    Raises ``TypeError`` for non-numbers (naming ``name`` and its unit) and
    ``ValueError`` naming ``label`` for another length ("give one value or one
    per ``each``").
    """
    array = real_arguments(name, value, _UNITS.get(name, "see the docstring"))
    if array.ndim == 0:
        array = np.full(count, float(array))
    if array.shape != (count,):
        raise ValueError(
            f"{label} has shape {array.shape}; give one value or one per {each}"
        )
    return array
