"""Velocity Verlet with thermostat hooks: the base of the NVT engines here.

One step, split around the force evaluation as nvalchemi's integrators are::

    pre_update:   thermostat (before kick) → v += ½ dt F/m → thermostat (before
                  drift) → x += dt v → barostat (after drift: positions, cell)
    [model evaluates F(x(t + dt))]
    post_update:  v += ½ dt F/m → thermostat (after kick)

A new integrator overrides only the stages it acts at (``before_first_kick``,
``before_drift``, ``after_drift``, ``after_second_kick``) and declares its
per-structure parameters in ``state_parameters`` (see
:class:`CoupledThermostatVerlet`).

Frozen atoms (``atom_categories == -1``) get no kick, no drift and zero
velocity here, whether or not ``FreezeAtomsHook`` also runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from nvalchemi.data import Batch

from nvalchemi_ase._compat import engine_seed, set_engine_seed
from nvalchemi_ase.engines._common import (
    ParameterValue,
    PerGraphEngine,
    check_parameter,
    finite_positive,
    free_atoms,
    make_state,
    mixed_seed,
    per_graph_sum,
    to_per_system,
)
from nvalchemi_ase.units import fs_to_ase_time, thermal_energy_nvalchemi

if TYPE_CHECKING:
    from nvalchemi.models.base import BaseModelMixin

__all__ = ["CoupledThermostatVerlet", "StateParameter", "ThermostattedVerlet"]


@dataclass(frozen=True)
class StateParameter:
    """A per-structure engine parameter, declared on the engine class.

    Attributes
    ----------
    name : str
        Constructor argument (a scalar or one value per structure).
    unit : str
        Its unit as the engine takes it (``"K"``, ``"fs"``, ...), for messages.
    field : str
        Name of the per-structure field in ``self._state``.
    to_state : callable
        Converts the [B] tensor of values into the state field.
    minimum : float
        Smallest allowed value.
    strict : bool
        Whether ``minimum`` itself is excluded.
    """

    name: str
    unit: str
    field: str
    to_state: Callable[[torch.Tensor], torch.Tensor]
    minimum: float = 0.0
    strict: bool = False


class ThermostattedVerlet(PerGraphEngine):
    """Velocity Verlet whose subclasses act on velocities around the kicks.

    Parameters
    ----------
    model : BaseModelMixin
        The potential.
    dt : float
        Time step, fs (nvalchemi's integrator convention).
    random_seed : int, optional
        Seed of the engine's ``torch.Generator`` (stochastic subclasses). Each
        step reseeds it from ``random_seed`` and ``step_count``, so
        ``state_dict``/``load_state_dict`` and ``seed_offset`` reproduce and
        shift the noise exactly as they do for ``NVTLangevin``.
    **kwargs
        ``n_steps``, ``hooks``, ``convergence_hook``, ...: see
        :class:`~nvalchemi_ase.engines._common.PerGraphEngine`.
    """

    __needs_keys__: set[str] = {"forces"}  # noqa: RUF012 - BaseDynamics types it set[str]
    __provides_keys__: set[str] = {"positions", "velocities"}  # noqa: RUF012

    def __init__(
        self,
        model: BaseModelMixin,
        dt: float,
        *,
        random_seed: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(model, **kwargs)
        self.dt = finite_positive("dt (fs)", dt)
        self._dt_internal = fs_to_ase_time(self.dt)
        if random_seed is not None:
            set_engine_seed(self, random_seed)
        self._generator: torch.Generator | None = None

    def set_dt(self, dt: float) -> None:
        """Change the time step, fs, from the next step on.

        Parameters
        ----------
        dt : float
            New time step, fs (> 0).
        """
        self.dt = finite_positive("dt (fs)", dt)
        self._dt_internal = fs_to_ase_time(self.dt)

    # -- randomness -------------------------------------------------------------

    @property
    def random_seed(self) -> int | None:
        """Base seed of the noise (None for deterministic engines)."""
        return engine_seed(self)

    @random_seed.setter
    def random_seed(self, value: int) -> None:
        set_engine_seed(self, value)

    def _step_generator(self, device: torch.device) -> torch.Generator:
        """Return the generator, seeded for the current ``step_count``."""
        seed = self.random_seed
        if seed is None:
            raise RuntimeError(f"{type(self).__name__} was built without random_seed")
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device)
        self._generator.manual_seed(mixed_seed(seed, self.step_count))
        return self._generator

    # -- the step ---------------------------------------------------------------

    def pre_update(self, batch: Batch) -> None:
        """Thermostat, half kick, thermostat, drift; positions and velocities.

        Parameters
        ----------
        batch : Batch
            Updated in place: ``velocities`` [V, 3] Å/ASE-time and
            ``positions`` [V, 3] Å.
        """
        self._check_batch(batch)
        with torch.no_grad():
            free = free_atoms(batch).unsqueeze(-1)
            self.before_first_kick(batch, free)
            self._half_kick(batch, free)
            self.before_drift(batch, free)
            velocities = batch.velocities
            velocities.copy_(torch.where(free, velocities, 0.0))
            batch.positions.add_(self._dt_internal * velocities)
            self.after_drift(batch, free)

    def post_update(self, batch: Batch) -> None:
        """Second half kick with the new forces, then the thermostat.

        Parameters
        ----------
        batch : Batch
            ``velocities`` [V, 3] updated in place.
        """
        with torch.no_grad():
            free = free_atoms(batch).unsqueeze(-1)
            self._half_kick(batch, free)
            self.after_second_kick(batch, free)

    def _half_kick(self, batch: Batch, free: torch.Tensor) -> None:
        acceleration = batch.forces.detach() / batch.atomic_masses.unsqueeze(-1)
        kick = torch.where(free, 0.5 * self._dt_internal * acceleration, 0.0)
        batch.velocities.add_(kick)

    def _check_batch(self, batch: Batch) -> None:
        state = getattr(self, "_state", None)
        if state is not None and state.num_graphs != batch.num_graphs:
            raise RuntimeError(
                f"{type(self).__name__} holds state for {state.num_graphs} graphs but "
                f"the batch has {batch.num_graphs}; build one engine per batch "
                "composition"
            )

    # -- subclass interface -----------------------------------------------------

    def before_first_kick(self, batch: Batch, free: torch.Tensor) -> None:
        """Act on velocities at the start of the step (default: nothing).

        Parameters
        ----------
        batch : Batch
            The batch; ``velocities`` may be changed in place.
        free : torch.Tensor, shape [V, 1] bool
            Atoms that are not frozen.
        """

    def before_drift(self, batch: Batch, free: torch.Tensor) -> None:
        """Act on velocities between the first kick and the drift (default: nothing).

        Parameters
        ----------
        batch : Batch
            The batch; ``velocities`` may be changed in place.
        free : torch.Tensor, shape [V, 1] bool
            Atoms that are not frozen.
        """

    def after_drift(self, batch: Batch, free: torch.Tensor) -> None:
        """Act on positions and the cell after the drift (default: nothing).

        The place for a barostat: positions and ``cell`` [B, 3, 3] may be
        scaled in place here, before the model evaluates the new forces (and
        stress). An engine that changes the cell adds ``"cell"`` to
        ``__provides_keys__`` and ``"stress"`` to ``__needs_keys__``, which
        also tells the ASE layer that cells move.

        Parameters
        ----------
        batch : Batch
            The batch; ``positions`` and ``cell`` may be changed in place.
        free : torch.Tensor, shape [V, 1] bool
            Atoms that are not frozen.
        """

    def after_second_kick(self, batch: Batch, free: torch.Tensor) -> None:
        """Act on velocities at the end of the step (default: nothing).

        Parameters
        ----------
        batch : Batch
            The batch; ``velocities`` may be changed in place.
        free : torch.Tensor, shape [V, 1] bool
            Atoms that are not frozen.
        """


def kinetic_energy(batch: Batch) -> torch.Tensor:
    """Kinetic energy of each structure, eV, shape [B].

    Parameters
    ----------
    batch : Batch
        ``velocities`` [V, 3] Å/ASE-time and ``atomic_masses`` [V] amu (in
        these units ½ m v² is in eV).

    Returns
    -------
    torch.Tensor, shape [B]
    """
    velocities = batch.velocities
    per_atom = 0.5 * batch.atomic_masses * (velocities * velocities).sum(dim=-1)
    return per_graph_sum(per_atom, batch)


def degrees_of_freedom(batch: Batch, free: torch.Tensor) -> torch.Tensor:
    """Degrees of freedom as ASE counts them: 3 per atom not frozen, shape [B].

    Parameters
    ----------
    batch : Batch
        The batch.
    free : torch.Tensor, shape [V, 1] or [V] bool
        Atoms that are not frozen.

    Returns
    -------
    torch.Tensor, shape [B], dtype of the positions
    """
    count = per_graph_sum(free.reshape(-1).to(batch.positions.dtype), batch)
    return 3.0 * count


def remove_com_velocity(batch: Batch, free: torch.Tensor) -> None:
    """Subtract each structure's centre-of-mass velocity from its free atoms.

    Parameters
    ----------
    batch : Batch
        ``velocities`` [V, 3] updated in place.
    free : torch.Tensor, shape [V, 1] bool
        Atoms that are not frozen; the centre of mass is theirs.
    """
    masses = torch.where(free, batch.atomic_masses.unsqueeze(-1), 0.0)
    momentum = per_graph_sum(masses * batch.velocities, batch)
    mass = per_graph_sum(masses, batch).clamp_min(torch.finfo(masses.dtype).tiny)
    com_velocity = (momentum / mass)[batch.batch_idx.long()]
    batch.velocities.sub_(torch.where(free, com_velocity, 0.0))


class CoupledThermostatVerlet(ThermostattedVerlet):
    """A :class:`ThermostattedVerlet` coupled to a bath through a time constant τ.

    Holds what Berendsen and Bussi share: a target temperature and a coupling
    time, each a scalar or one per structure, kept per structure in
    ``self._state`` as ``kT`` [B] eV and ``taut`` [B] ASE time units. Both are
    declared in :attr:`state_parameters`; a subclass with further
    per-structure parameters extends that tuple and takes them as keyword
    arguments.

    Parameters
    ----------
    model : BaseModelMixin
        The potential.
    dt : float
        Time step, fs.
    temperature : float or torch.Tensor, shape [B]
        Target temperature, K (nvalchemi's ``KB_EV`` convention).
    taut : float or torch.Tensor, shape [B]
        Coupling time τ, fs (> 0).
    **kwargs
        Passed to :class:`ThermostattedVerlet`.
    """

    #: Per-structure parameters: constructor argument → state field.
    state_parameters: ClassVar[tuple[StateParameter, ...]] = (
        StateParameter("temperature", "K", "kT", thermal_energy_nvalchemi),
        StateParameter("taut", "fs", "taut", fs_to_ase_time, strict=True),
    )

    def __init__(
        self,
        model: BaseModelMixin,
        dt: float,
        temperature: ParameterValue,
        taut: ParameterValue,
        **kwargs: Any,
    ) -> None:
        given = {"temperature": temperature, "taut": taut}
        for parameter in self.state_parameters:
            if parameter.name not in given and parameter.name in kwargs:
                given[parameter.name] = kwargs.pop(parameter.name)
        super().__init__(model, dt, **kwargs)
        self._parameters: dict[str, ParameterValue] = {}
        for parameter in self.state_parameters:
            if parameter.name not in given:
                raise TypeError(
                    f"{type(self).__name__} needs {parameter.name} ({parameter.unit})"
                )
            self._parameters[parameter.name] = check_parameter(
                parameter.name,
                given[parameter.name],
                minimum=parameter.minimum,
                strict=parameter.strict,
            )

    def _init_state(self, batch: Batch) -> None:
        self._state = self._new_state(batch.num_graphs, batch)

    def _make_new_state(self, n: int, template_batch: Batch) -> Batch:
        return self._new_state(n, template_batch)

    def _new_state(self, count: int, template: Batch) -> Batch:
        device, dtype = template.device, template.positions.dtype
        fields = {
            parameter.field: parameter.to_state(
                to_per_system(
                    parameter.name,
                    self._parameters[parameter.name],
                    count,
                    device,
                    dtype,
                )
            )
            for parameter in self.state_parameters
        }
        fields.update(self._extra_state(count, device, dtype))
        return make_state(fields, device)

    def _extra_state(
        self, count: int, device: torch.device, dtype: torch.dtype
    ) -> dict[str, torch.Tensor]:
        """Further per-structure state fields of a subclass (default: none)."""
        return {}
