"""Factories for the models nvalchemi ships: Lennard-Jones and the demo model."""

from __future__ import annotations

import numbers
from typing import TYPE_CHECKING, Any

import torch

from nvalchemi_ase._quiet import import_quietly
from nvalchemi_ase.models import registry

if TYPE_CHECKING:
    from nvalchemi.models.base import BaseModelMixin

__all__ = [
    "ARGON",
    "demo",
    "lennard_jones",
    "register_models",
]

#: Lennard-Jones parameters of argon (eV, Å, Å): the defaults of ``"lj"``.
ARGON = {"epsilon": 0.0104, "sigma": 3.40, "cutoff": 8.5}


def lennard_jones(
    epsilon: float = ARGON["epsilon"],
    sigma: float = ARGON["sigma"],
    cutoff: float = ARGON["cutoff"],
    switch_width: float = 0.0,
) -> BaseModelMixin:
    """Nvalchemi's Warp Lennard-Jones model (one species; atomic numbers ignored).

    Parameters
    ----------
    epsilon : float
        Well depth, eV.
    sigma : float
        Zero-crossing distance, Å.
    cutoff : float
        Cutoff radius, Å. The energy is *not* shifted to zero there (ASE's
        ``LennardJones`` is), so energies differ from ASE's by
        ``n_pairs * u(cutoff)``; forces and stress are identical.
    switch_width : float
        Width, Å, of nvalchemi's C2 switching region ending at the cutoff; 0 is
        a hard cutoff. Use about 1.5 Å for energy-conserving MD.

    Returns
    -------
    BaseModelMixin
        ``LennardJonesModelWrapper`` with energy, forces and (opt-in) stress.
    """
    epsilon = _real("lj", "epsilon", epsilon, "eV")
    sigma = _real("lj", "sigma", sigma, "Å")
    cutoff = _real("lj", "cutoff", cutoff, "Å")
    switch_width = _real("lj", "switch_width", switch_width, "Å")
    for name, value in (("epsilon", epsilon), ("sigma", sigma), ("cutoff", cutoff)):
        if not value > 0 or value == float("inf"):
            raise ValueError(f"lj: {name} must be positive and finite, got {value}")
    if not 0 <= switch_width < cutoff:
        raise ValueError(
            f"lj: switch_width must be in [0, cutoff={cutoff}), got {switch_width}"
        )
    lj = import_quietly("nvalchemi.models.lj")
    return lj.LennardJonesModelWrapper(
        epsilon=epsilon, sigma=sigma, cutoff=cutoff, switch_width=switch_width
    )


def demo(seed: int = 0, hidden_dim: int = 64) -> BaseModelMixin:
    """Nvalchemi's demo model with reproducible random weights (not physical).

    Parameters
    ----------
    seed : int
        Seed for the weight initialisation; the global torch RNG is untouched.
    hidden_dim : int
        Width of the hidden layers.

    Returns
    -------
    BaseModelMixin
        ``DemoModelWrapper(DemoModel(hidden_dim=hidden_dim))``: energy and
        autograd forces from a point cloud, no neighbour list, no PBC, no stress.
    """
    seed = _integer("demo", "seed", seed)
    hidden_dim = _integer("demo", "hidden_dim", hidden_dim)
    if hidden_dim < 1:
        raise ValueError(f"demo: hidden_dim must be >= 1, got {hidden_dim}")
    demo_module = import_quietly("nvalchemi.models.demo")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        network = demo_module.DemoModel(hidden_dim=hidden_dim)
    return demo_module.DemoModelWrapper(network)


def _real(model: str, name: str, value: Any, unit: str) -> float:
    """Return ``value`` as a float, or raise naming the parameter and its unit.

    Strings are refused even when they parse (``--model lj:epsilon=abc`` gives
    the string ``"abc"``; ``"1"`` would silently be a number of a guessed unit).
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{model}: {name} must be a real number ({unit}), got {value!r} "
            f"({type(value).__name__})"
        )
    return float(value)


def _integer(model: str, name: str, value: Any) -> int:
    """Return ``value`` as an int, or raise naming the parameter."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"{model}: {name} must be an integer, got {value!r} "
            f"({type(value).__name__})"
        )
    return int(value)


def register_models() -> None:
    """Add ``"lj"`` and ``"demo"`` to the model registry."""
    registry.register(
        registry.ModelInfo(
            name="lj",
            factory=lennard_jones,
            summary="Lennard-Jones (nvalchemi's Warp kernel; argon by default)",
            elements="any (one species)",
            cutoff="8.5 Å (parameter)",
            dtype="any",
            licence="Apache-2.0 (nvalchemi)",
        )
    )
    registry.register(
        registry.ModelInfo(
            name="demo",
            factory=demo,
            summary=(
                "nvalchemi's demo model, random weights (a test model, not physics)"
            ),
            elements="1-99",
            cutoff="none (no neighbour list, no PBC)",
            dtype="float32",
            licence="Apache-2.0 (nvalchemi)",
        )
    )
