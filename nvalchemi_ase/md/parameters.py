"""Changing a thermostat's parameters between runs, as ASE's setters do.

ASE's MD classes change their parameters in place (``Langevin.set_friction``,
``Andersen.set_andersen_prob``, ``set_timestep``, ...). Here the parameters
live per structure in the nvalchemi engine's state, which the engine creates
at its first evaluation: a setter primes the dynamics (the evaluation the
next step would do anyway, and reuses) and writes the new values into that
state, so the next step uses them. Values given for one structure are
broadcast; one value per structure is allowed where the constructor allows it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import torch
from ase import Atoms

from nvalchemi_ase._compat import engine_state
from nvalchemi_ase.md.md import _positive

if TYPE_CHECKING:
    from nvalchemi_ase.md.md import BatchedMolecularDynamics

__all__ = ["as_given", "positive_timestep", "update_engine_state"]


def update_engine_state(
    dyn: BatchedMolecularDynamics, field: str, values: torch.Tensor
) -> None:
    """Write per-structure values into the engine's state field ``field``.

    Parameters
    ----------
    dyn : BatchedMolecularDynamics
        The dynamics (primed here if it has not evaluated yet).
    field : str
        Name of a [B] field of the engine's state, in the engine's units.
    values : torch.Tensor, shape [B]
        New values, on the dynamics' device and dtype.
    """
    dyn._prime()  # the engine builds its state at priming
    state = engine_state(dyn.engine)
    if state is None:  # pragma: no cover - every engine here builds one
        raise RuntimeError(f"{type(dyn.engine).__name__} has no per-structure state")
    target = getattr(state, field)
    with torch.no_grad():
        target.copy_(values.reshape(target.shape).to(target.dtype))


def positive_timestep(timestep: float) -> float:
    """Check a new time step, ASE time units, as the constructors do.

    Parameters
    ----------
    timestep : float
        Time step, ASE time units.

    Returns
    -------
    float
        ``timestep``.

    Raises
    ------
    TypeError, ValueError
        For a non-number, zero, a negative or a non-finite value.
    """
    return _positive("timestep", timestep)


def as_given(
    dyn: BatchedMolecularDynamics, values: npt.NDArray[np.float64]
) -> float | npt.NDArray[np.float64]:
    """Return a float when the dynamics was given one ``Atoms`` (as ASE), else (B,).

    Parameters
    ----------
    dyn : BatchedMolecularDynamics
        The dynamics.
    values : numpy.ndarray, shape (B,), or a float
        One value per structure (a float: already one structure's value).

    Returns
    -------
    float or numpy.ndarray
    """
    atoms: Any = dyn.atoms
    if isinstance(atoms, Atoms):
        return float(np.asarray(values, dtype=np.float64).reshape(-1)[0])
    return values
