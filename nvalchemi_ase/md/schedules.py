"""Temperature and pressure schedules: a target that changes with the MD step.

Every thermostat and barostat class of :mod:`nvalchemi_ase.md` takes, where it
takes a target (``temperature_K``, ``pressure_au``, ``externalstress``), also

* a callable ``f(step) -> value``: ``step`` is ASE's step count ``nsteps``
  (an int >= 0), the value a float or one per structure (B,), in the
  argument's units (K, eV/Å³);
* a piecewise-linear table: a sequence of ``(step, value)`` pairs with
  increasing steps, ``value`` a float (shared) or one per structure, held
  constant before the first and after the last step, e.g.
  ``temperature_K=[(0, 300), (10_000, 2000), (20_000, 2000), (30_000, 300)]``
  (a melt-quench), or :func:`piecewise_linear` / :class:`Schedule`.

The step from ``nsteps = n`` to ``n + 1`` runs at the schedule's value at
``n``; the schedule is a function of the step count only, so a run continued
from a checkpoint (``restart=``) follows it exactly. The value is written into
the engine's per-structure target at the start of each step by one nvalchemi
hook (:class:`ScheduleHook`), without a model evaluation and without a host
synchronisation: values are computed on the host for a block of
:data:`BLOCK_STEPS` steps at once and copied to the device in one transfer.
Only the target changes (as ASE's ``set_temperature``): thermostat and barostat
masses keep the values they got from the initial targets, and velocities are
not rescaled (nvalchemi's ``apply_per_system_params`` rescales them, which is a
replica-exchange swap, not a change of a bath's target).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import torch

from nvalchemi_ase._compat import engine_state
from nvalchemi_ase._quiet import import_quietly

if TYPE_CHECKING:
    from nvalchemi_ase.md.md import BatchedMolecularDynamics

__all__ = [
    "BLOCK_STEPS",
    "Schedule",
    "ScheduleHook",
    "ScheduledParameter",
    "as_schedule",
    "piecewise_linear",
]

#: Steps whose scheduled values are computed and sent to the device at once.
BLOCK_STEPS = 256


class Schedule:
    """A target value per MD step, from a callable.

    Parameters
    ----------
    function : callable
        ``function(step) -> float or array_like (B,)``, ``step`` ASE's step
        count (int >= 0); the value in the scheduled argument's units.
    description : str, optional
        What ``todict()`` and checkpoints record (default: the callable's
        qualified name, stable between processes, so a restart with the same
        function matches its checkpoint).
    """

    def __init__(
        self, function: Callable[[int], Any], *, description: str | None = None
    ) -> None:
        if not callable(function):
            raise TypeError(f"a schedule needs a callable, got {function!r}")
        self._function = function
        self._description = description or _callable_name(function)

    def __call__(self, step: int) -> npt.NDArray[np.float64]:
        """Value(s) at ``step``, float64, shape () or (B,)."""
        return _as_values(self._function(int(step)), int(step))

    def values(self, steps: npt.NDArray[np.int64]) -> npt.NDArray[np.float64]:
        """Values at each of ``steps`` (L,), shape (L,) or (L, B)."""
        return np.stack([self(int(step)) for step in steps])

    def describe(self) -> Any:
        """Describe the schedule, JSON-able (``todict()``, checkpoints)."""
        return {"schedule": self._description}

    def __repr__(self) -> str:
        return f"Schedule({self._description})"


class PiecewiseLinear(Schedule):
    """Linear interpolation between ``(step, value)`` points; constant outside.

    Parameters
    ----------
    steps : array_like of int, shape (K,)
        Increasing step counts, >= 0.
    values : array_like, shape (K,) or (K, B)
        Value(s) at each step (shared, or one per structure).
    """

    def __init__(self, steps: npt.ArrayLike, values: npt.ArrayLike) -> None:
        knots = np.asarray(steps, dtype=np.float64)
        table = np.asarray(values, dtype=np.float64)
        if knots.ndim != 1 or knots.size == 0 or table.shape[:1] != knots.shape:
            raise ValueError(
                "a piecewise-linear schedule needs (step, value) pairs, e.g. "
                "[(0, 300), (1000, 1200)]"
            )
        if table.ndim > 2:
            raise ValueError(
                "each value of a schedule is a number or one per structure, got "
                f"shape {table.shape[1:]}"
            )
        if (knots < 0).any() or (knots != np.round(knots)).any():
            raise ValueError(f"schedule steps must be integers >= 0, got {knots}")
        if (np.diff(knots) <= 0).any():
            raise ValueError(f"schedule steps must increase, got {knots.tolist()}")
        if not np.isfinite(table).all():
            raise ValueError("schedule values must be finite")
        self.steps = knots
        self.table = table
        super().__init__(self._at, description="piecewise-linear")

    def _at(self, step: int) -> npt.NDArray[np.float64]:
        return self.values(np.array([step]))[0]

    def values(self, steps: npt.NDArray[np.int64]) -> npt.NDArray[np.float64]:
        """Values at each of ``steps`` (L,), shape (L,) or (L, B), vectorised."""
        at = np.asarray(steps, dtype=np.float64)
        if self.steps.size == 1:
            return np.repeat(self.table[:1], at.size, axis=0)
        left = np.clip(np.searchsorted(self.steps, at, side="right") - 1, 0, None)
        left = np.minimum(left, self.steps.size - 2)
        span = self.steps[left + 1] - self.steps[left]
        weight = np.clip((at - self.steps[left]) / span, 0.0, 1.0)
        if self.table.ndim == 2:
            weight = weight[:, None]
        low, high = self.table[left], self.table[left + 1]
        return low + weight * (high - low)

    def describe(self) -> Any:
        """Describe the schedule by its table (JSON-able)."""
        return {
            "schedule": "piecewise-linear",
            "steps": self.steps.astype(np.int64).tolist(),
            "values": self.table.tolist(),
        }

    def __repr__(self) -> str:
        steps = self.steps.astype(int).tolist()
        points = list(zip(steps, self.table.tolist(), strict=True))
        return f"piecewise_linear({points})"


def piecewise_linear(points: Sequence[tuple[int, Any]]) -> PiecewiseLinear:
    """Build a piecewise-linear schedule from ``(step, value)`` pairs.

    Parameters
    ----------
    points : sequence of (int, float or array_like (B,))
        Increasing steps (ASE's ``nsteps``) and the value(s) there, in the
        argument's units (K for temperatures, eV/Å³ for pressures); constant
        before the first and after the last point. A number where other
        points give one value per structure stands for every structure.

    Returns
    -------
    PiecewiseLinear
        The schedule (pass it as ``temperature_K=`` / ``pressure_au=``).
    """
    pairs = list(points)
    if not pairs or not all(_is_pair(point) for point in pairs):
        raise ValueError(
            "a piecewise-linear schedule needs (step, value) pairs, e.g. "
            "[(0, 300), (1000, 1200)]"
        )
    steps = [point[0] for point in pairs]
    values = [np.asarray(point[1], dtype=np.float64) for point in pairs]
    try:  # a number stands for every structure
        values = list(np.broadcast_arrays(*values))
    except ValueError:
        shapes = sorted({value.shape for value in values})
        raise ValueError(
            f"the values of a schedule have shapes {shapes}; give numbers or one "
            "value per structure at every step"
        ) from None
    return PiecewiseLinear(steps, np.stack(values))


def as_schedule(value: Any) -> Schedule | None:
    """Return ``value`` as a :class:`Schedule`, or None for a plain target.

    A :class:`Schedule`, a callable, or a sequence of ``(step, value)`` pairs
    is a schedule; numbers and per-structure arrays are not (a pair is never
    one structure's value, so the forms do not overlap).
    """
    if isinstance(value, Schedule):
        return value
    if callable(value) and not isinstance(value, np.ndarray | torch.Tensor):
        return Schedule(value)
    if isinstance(value, str | bytes | np.ndarray | torch.Tensor):
        if isinstance(value, np.ndarray) and value.ndim == 2 and value.shape[1] == 2:
            return PiecewiseLinear(value[:, 0], value[:, 1])
        return None
    if isinstance(value, Sequence) and value and all(_is_pair(p) for p in value):
        return piecewise_linear(value)
    return None


class ScheduledParameter:
    """A target attribute (``temperature_K``, ...) that may follow a schedule.

    Assigning a schedule (see :func:`as_schedule`) stores it; reading the
    attribute then gives its value(s) at the current ``nsteps`` (float64
    array, shape () or (B,)). Assigning a number or an array stores it as
    before and drops the schedule.
    """

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        if instance is None:
            return self
        schedule = instance.__dict__.get("_schedules", {}).get(self.name)
        if schedule is not None:
            return schedule(getattr(instance, "nsteps", 0))
        try:
            return instance.__dict__[f"_{self.name}_value"]
        except KeyError:
            raise AttributeError(self.name) from None

    def __set__(self, instance: Any, value: Any) -> None:
        schedules = instance.__dict__.setdefault("_schedules", {})
        schedule = as_schedule(value)
        if schedule is None:
            schedules.pop(self.name, None)
            instance.__dict__[f"_{self.name}_value"] = value
        else:
            schedules[self.name] = schedule
            instance.__dict__[f"_{self.name}_value"] = None


class ScheduleHook:
    """nvalchemi hook writing scheduled targets into the engine's state.

    Runs at ``BEFORE_STEP``: the step from ``dyn.nsteps = n`` takes each
    schedule's value at ``n``. Values for :data:`BLOCK_STEPS` steps are
    checked and converted on the host (``dyn._scheduled_block``) and sent to
    the device together; each step then copies one row on the device.

    Parameters
    ----------
    dyn : BatchedMolecularDynamics
        The dynamics whose schedules (``dyn._schedules``) this hook applies.
    """

    frequency = 1

    def __init__(self, dyn: BatchedMolecularDynamics) -> None:
        stages = import_quietly("nvalchemi.dynamics.base").DynamicsStage
        self.stage = stages.BEFORE_STEP
        self._dyn = dyn
        self._start = -1
        self._blocks: dict[str, torch.Tensor] = {}
        self._key: tuple[int, ...] = ()

    def __call__(self, ctx: Any, stage: Any) -> None:
        """Write this step's scheduled values (nothing when none is scheduled)."""
        dyn = self._dyn
        schedules: dict[str, Schedule] = dyn.__dict__.get("_schedules", {})
        if not schedules:
            return
        step = int(dyn.nsteps)
        key = tuple(id(schedule) for schedule in schedules.values())
        if key != self._key or not 0 <= step - self._start < BLOCK_STEPS:
            self._fill(schedules, step)
            self._key = key
        state = engine_state(dyn.engine)
        if state is None:  # pragma: no cover - BEFORE_STEP runs after priming
            return
        row = step - self._start
        with torch.no_grad():
            for name, block in self._blocks.items():
                target = getattr(state, dyn._scheduled_fields[name])
                _write(target, block[row])

    def _fill(self, schedules: dict[str, Schedule], step: int) -> None:
        steps = np.arange(step, step + BLOCK_STEPS, dtype=np.int64)
        self._start = step
        self._blocks = {
            name: self._dyn._scheduled_block(name, steps, schedule.values(steps))
            for name, schedule in schedules.items()
        }


def _write(target: torch.Tensor, row: torch.Tensor) -> None:
    """Copy one value per structure into a [B], [B, 3] or [B, 3, 3] target."""
    if target.dim() == 1 or target[0].numel() == 1:
        target.copy_(row.reshape(target.shape).to(target.dtype))
        return
    trailing = target.shape[1:]
    if trailing.numel() == 3:  # diagonal components
        target.copy_(row.reshape(-1, 1).expand(-1, 3).reshape(target.shape))
        return
    eye = torch.eye(3, dtype=target.dtype, device=target.device)
    target.copy_((row.reshape(-1, 1, 1) * eye).reshape(target.shape))


def _is_pair(item: Any) -> bool:
    return (
        isinstance(item, tuple | list)
        and len(item) == 2
        and isinstance(item[0], int | np.integer | float | np.floating)
        and not isinstance(item[0], bool)
    )


def _as_values(value: Any, step: int) -> npt.NDArray[np.float64]:
    if isinstance(value, str | bytes | bool):
        raise TypeError(f"schedule value at step {step} is {value!r}; give a number")
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    array = np.asarray(value, dtype=np.float64)
    if array.ndim > 1:
        raise ValueError(
            f"schedule value at step {step} has shape {array.shape}; give a number "
            "or one per structure"
        )
    return array


def _callable_name(function: Callable[..., Any]) -> str:
    module = getattr(function, "__module__", None) or ""
    name = getattr(function, "__qualname__", None) or type(function).__qualname__
    return f"{module}.{name}" if module else name
