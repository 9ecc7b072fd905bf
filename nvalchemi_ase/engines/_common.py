"""Pieces every engine of :mod:`nvalchemi_ase.engines` shares.

Shapes use nvalchemi's axis letters: ``V`` atoms of the batch, ``B`` graphs
(structures). Per-structure engine state lives in a system-level nvalchemi
``Batch`` (one row per graph), so nvalchemi's base class can select, append,
save and restore it like its own engines' state.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from nvalchemi.data import Batch
from nvalchemi.dynamics.base import BaseDynamics

from nvalchemi_ase._compat import make_state_batch
from nvalchemi_ase.convert import FROZEN_CATEGORY

if TYPE_CHECKING:
    from nvalchemi.dynamics.base import ConvergenceHook
    from nvalchemi.hooks import Hook
    from nvalchemi.models.base import BaseModelMixin

__all__ = [
    "FROZEN_CATEGORY",
    "ParameterValue",
    "PerGraphEngine",
    "active_graphs",
    "check_parameter",
    "finite_positive",
    "fire_state",
    "free_atoms",
    "keep_inactive",
    "make_state",
    "mixed_seed",
    "per_graph_max",
    "per_graph_sum",
    "refuse_by_group",
    "to_per_system",
]

#: A scalar, or one value per structure (array-like or tensor of shape [B]).
ParameterValue = float | torch.Tensor | np.ndarray | list[float] | tuple[float, ...]

# Odd 64-bit constant (golden ratio) used to spread seeds before adding steps.
_SEED_MULTIPLIER = 0x9E3779B97F4A7C15
_SEED_MODULUS = 2**63


class PerGraphEngine(BaseDynamics):
    """A ``BaseDynamics`` that keeps its state per graph (``by_group`` refused).

    The base of this package's engines: their constructors take their own
    parameters and hand the rest here.

    Parameters
    ----------
    model : BaseModelMixin
        The potential.
    n_steps : int, optional
        Default step count of ``run``.
    hooks : list of Hook, optional
        Hooks to register.
    convergence_hook : ConvergenceHook or dict, optional
        Convergence criteria.
    **kwargs
        Forwarded to ``BaseDynamics`` (``by_group=True`` is refused).
    """

    def __init__(
        self,
        model: BaseModelMixin,
        *,
        n_steps: int | None = None,
        hooks: list[Hook] | None = None,
        convergence_hook: ConvergenceHook | dict | None = None,
        **kwargs: Any,
    ) -> None:
        refuse_by_group(type(self).__name__, kwargs)
        super().__init__(
            model=model,
            hooks=hooks,
            convergence_hook=convergence_hook,
            n_steps=n_steps,
            **kwargs,
        )


def refuse_by_group(engine_name: str, options: Mapping[str, Any]) -> None:
    """Raise if ``by_group=True`` is requested (state is kept per graph).

    Parameters
    ----------
    engine_name : str
        Name used in the message.
    options : Mapping
        Keyword arguments the engine forwards to ``BaseDynamics``.
    """
    if options.get("by_group", False):
        raise NotImplementedError(
            f"{engine_name} keeps its state per graph; by_group=True is not supported"
        )


def check_parameter(
    name: str,
    value: ParameterValue,
    *,
    minimum: float | None = None,
    strict: bool = False,
    maximum: float | None = None,
) -> ParameterValue:
    """Validate a scalar or per-structure parameter and return it unchanged.

    Parameters
    ----------
    name : str
        Parameter name for the message.
    value : float or array_like or torch.Tensor, shape () or (B,)
        The value(s).
    minimum : float, optional
        Lower bound (inclusive unless ``strict``).
    strict : bool
        Whether ``minimum`` itself is excluded.
    maximum : float, optional
        Upper bound (inclusive).

    Returns
    -------
    float or array_like or torch.Tensor
        ``value``.

    Raises
    ------
    ValueError
        If any value is not finite, out of range, or the array is not 0-/1-D.
    """
    array = np.asarray(
        value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else value,
        dtype=np.float64,
    )
    if array.ndim > 1:
        raise ValueError(f"{name} must be a scalar or 1-D, got shape {array.shape}")
    bad = ~np.isfinite(array)
    if minimum is not None:
        bad |= array <= minimum if strict else array < minimum
    if maximum is not None:
        bad |= array > maximum
    if bad.any():
        low = "" if minimum is None else (">" if strict else ">=") + f" {minimum}"
        high = "" if maximum is None else f"<= {maximum}"
        bounds = " and ".join(part for part in (low, high) if part)
        raise ValueError(
            f"{name} must be finite{' and ' + bounds if bounds else ''}, got "
            f"{array.tolist()}"
        )
    return value


def to_per_system(
    name: str,
    value: ParameterValue,
    count: int,
    device: torch.device,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Broadcast a scalar, or check a per-structure value, to a [count] tensor.

    Parameters
    ----------
    name : str
        Parameter name for the message.
    value : float or array_like or torch.Tensor, shape () or (count,)
        The value(s).
    count : int
        Number of structures B.
    device, dtype
        Placement of the result.

    Returns
    -------
    torch.Tensor, shape [count]
        A fresh tensor.
    """
    tensor = torch.as_tensor(value, dtype=dtype, device=device).reshape(-1)
    if tensor.numel() == 1:
        return tensor.expand(count).clone()
    if tensor.numel() != count:
        raise ValueError(
            f"{name} has {tensor.numel()} values for {count} structures; give one "
            "value or one per structure"
        )
    return tensor.clone()


def make_state(data: dict[str, torch.Tensor], device: torch.device) -> Batch:
    """Per-structure state as a system-level nvalchemi ``Batch`` (rows = graphs).

    Parameters
    ----------
    data : dict of str to torch.Tensor
        Tensors of shape [B, ...].
    device : torch.device
        Their device.

    Returns
    -------
    nvalchemi.data.Batch
        What ``BaseDynamics`` expects in ``self._state``.
    """
    return make_state_batch(data, device)


def fire_state(
    count: int,
    template: Batch,
    *,
    dt: float,
    a: float,
    cell_rows: bool,
    last_energy: bool = False,
) -> Batch:
    """Fresh per-structure state of the FIRE engines (ASE's FIRE and ABC-FIRE2).

    Parameters
    ----------
    count : int
        Number of structures B.
    template : Batch
        Supplies device and float dtype (``positions``).
    dt, a : float
        Initial time step (internal = ASE time units) and mixing parameter.
    cell_rows : bool
        Add ``cell_velocities`` [B, 3, 3] (zero), the cell rows of a filter.
    last_energy : bool
        Add ``last_energy`` [B] eV (zero), for ``downhill_check``.

    Returns
    -------
    nvalchemi.data.Batch
        ``dt``, ``a`` [B] float, ``count`` [B] long (ASE's ``Nsteps``, zero),
        ``started`` [B] bool (False), and the optional fields.
    """
    device, dtype = template.device, template.positions.dtype

    def full(value: float) -> torch.Tensor:
        return torch.full((count,), value, dtype=dtype, device=device)

    fields = {
        "dt": full(dt),
        "a": full(a),
        "count": torch.zeros(count, dtype=torch.long, device=device),
        "started": torch.zeros(count, dtype=torch.bool, device=device),
    }
    if last_energy:
        fields["last_energy"] = full(0.0)
    if cell_rows:
        fields["cell_velocities"] = torch.zeros(count, 3, 3, dtype=dtype, device=device)
    return make_state(fields, device)


def free_atoms(batch: Batch) -> torch.Tensor:
    """Atoms that may move: ``atom_categories != FROZEN_CATEGORY``, shape [V] bool."""
    categories = getattr(batch, "atom_categories", None)
    if categories is None:
        return torch.ones(batch.num_nodes, dtype=torch.bool, device=batch.device)
    return categories != FROZEN_CATEGORY


def per_graph_sum(values: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Sum per-atom values over each structure.

    Parameters
    ----------
    values : torch.Tensor, shape [V, ...]
        Per-atom values.
    batch : nvalchemi.data.Batch
        Supplies ``batch_idx`` and ``num_graphs``.

    Returns
    -------
    torch.Tensor, shape [B, ...]
    """
    total = values.new_zeros((batch.num_graphs, *values.shape[1:]))
    return total.index_add_(0, batch.batch_idx.long(), values)


def per_graph_max(values: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Largest of non-negative per-atom values in each structure.

    Parameters
    ----------
    values : torch.Tensor, shape [V]
        Non-negative per-atom values (norms).
    batch : nvalchemi.data.Batch
        Supplies ``batch_idx`` and ``num_graphs``.

    Returns
    -------
    torch.Tensor, shape [B]
        Zero for a structure without atoms.
    """
    largest = values.new_zeros(batch.num_graphs)
    return largest.scatter_reduce_(0, batch.batch_idx.long(), values, reduce="amax")


def active_graphs(engine: BaseDynamics, batch: Batch) -> torch.Tensor | None:
    """Graphs the engine may update (``status < exit_status``), [B] bool or None."""
    return engine.active_graph_mask(batch, engine.exit_status)


def keep_inactive(
    target: torch.Tensor, new: torch.Tensor, active: torch.Tensor | None
) -> None:
    """Write ``new`` into ``target`` for active graphs only, in place.

    nvalchemi's base class restores positions and velocities of graphs with
    ``status >= exit_status`` after a step but not an engine's own state; this
    keeps that state as it was for those graphs.

    Parameters
    ----------
    target : torch.Tensor, shape [B, ...]
        State tensor updated in place.
    new : torch.Tensor, shape [B, ...]
        Its new value.
    active : torch.Tensor, shape [B] bool, or None
        Graphs whose row is updated (None: all).
    """
    if active is None:
        target.copy_(new)
        return
    mask = active.view(-1, *([1] * (target.dim() - 1)))
    target.copy_(torch.where(mask, new, target))


def mixed_seed(seed: int, step: int) -> int:
    """Seed of one step's draws: a mix of the engine seed and the step count.

    Seeds ``s`` and ``s + 1`` give unrelated streams (a plain ``seed + step``
    would make engine ``s`` at step 1 repeat engine ``s + 1`` at step 0).

    Parameters
    ----------
    seed : int
        The engine's ``random_seed``.
    step : int
        The engine's ``step_count``.

    Returns
    -------
    int
        A seed in [0, 2**63).
    """
    return (seed * _SEED_MULTIPLIER + step * (_SEED_MULTIPLIER >> 7) + 1) % (
        _SEED_MODULUS
    )


def finite_positive(name: str, value: float) -> float:
    """Return ``float(value)`` if finite and > 0, else raise ValueError."""
    value = float(value)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be finite and positive, got {value}")
    return value
