"""``NVTBussi``: velocity Verlet with stochastic velocity rescaling (CSVR).

Bussi, Donadio and Parrinello, J. Chem. Phys. 126, 014101 (2007), appendix
eq. (A7). At the start of each step the velocities of structure b are scaled
by α_b with

    α_b² = (√e + R₁ √c)² + c Σ_{i=2}^{N_f} R_i²,   e = exp(−dt/τ_b),
    c = (1 − e) K̄_b / (N_f K_b),   K̄_b = ½ N_f k_B T0_b,

where K_b is the kinetic energy, N_f = 3 × (free atoms) (ASE's count), and the
R_i are standard normal draws. Drawing all N_f normals per structure (one per
velocity component of its free atoms, R₁ the first) gives the χ² sum exactly
with public torch samplers, at the cost of one [V, 3] draw per step. The
kinetic energy then samples the canonical distribution of N_f quadratic
degrees of freedom; ``transferred_energy`` accumulates the energy the
thermostat added, so ``E_total − transferred_energy`` is conserved up to the
integration error.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from nvalchemi.data import Batch

from nvalchemi_ase.engines._common import (
    ParameterValue,
    active_graphs,
    keep_inactive,
    per_graph_sum,
)
from nvalchemi_ase.engines._verlet import (
    CoupledThermostatVerlet,
    degrees_of_freedom,
    kinetic_energy,
)

if TYPE_CHECKING:
    from nvalchemi.models.base import BaseModelMixin

__all__ = ["NVTBussi"]


class NVTBussi(CoupledThermostatVerlet):
    """Batched Bussi–Donadio–Parrinello stochastic velocity rescaling (NVT).

    Parameters
    ----------
    model : BaseModelMixin
        The potential.
    dt : float
        Time step, fs.
    temperature : float or torch.Tensor, shape [B]
        Target temperature, K (nvalchemi's ``KB_EV`` convention).
    taut : float or torch.Tensor, shape [B]
        Thermostat time constant τ, fs (> 0).
    random_seed : int
        Seed of the noise (one ``torch.Generator`` for the batch, reseeded
        from ``random_seed`` and ``step_count`` every step). Each structure
        gets its own draws; a structure's noise depends on the seed and the
        batch composition.
    **kwargs
        ``n_steps``, ``hooks``, ``convergence_hook`` and ``BaseDynamics``
        options.

    Notes
    -----
    State per structure: ``kT`` [B] eV, ``taut`` [B] ASE time units and
    ``transferred_energy`` [B] eV; the last is kept unchanged for graphs with
    ``status >= exit_status``. A structure without kinetic energy is left
    alone (α = 1), as rescaling cannot heat it.
    """

    def __init__(
        self,
        model: BaseModelMixin,
        dt: float,
        temperature: ParameterValue,
        taut: ParameterValue,
        random_seed: int = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            model, dt, temperature, taut, random_seed=random_seed, **kwargs
        )

    def _extra_state(
        self, count: int, device: torch.device, dtype: torch.dtype
    ) -> dict[str, torch.Tensor]:
        return {"transferred_energy": torch.zeros(count, dtype=dtype, device=device)}

    def before_first_kick(self, batch: Batch, free: torch.Tensor) -> None:
        """Rescale each structure's velocities by its stochastic factor α."""
        energy = kinetic_energy(batch)
        dof = degrees_of_freedom(batch, free)
        first, rest = self._noise(batch, free)
        state = self._state
        decay = torch.exp(-self._dt_internal / state.taut)
        target = 0.5 * dof * state.kT
        heated = energy > 0
        coupling = (1.0 - decay) * target / (dof.clamp_min(1.0) * energy)
        coupling = torch.where(heated, coupling, 0.0)
        alpha_squared = (decay.sqrt() + first * coupling.sqrt()) ** 2 + coupling * rest
        alpha_squared = torch.where(heated, alpha_squared, 1.0)
        batch.velocities.mul_(
            alpha_squared.sqrt()[batch.batch_idx.long()].unsqueeze(-1)
        )
        keep_inactive(
            state.transferred_energy,
            state.transferred_energy + (alpha_squared - 1.0) * energy,
            active_graphs(self, batch),
        )

    def _noise(
        self, batch: Batch, free: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """R₁ and Σ_{i≥2} R_i² of each structure, both shape [B].

        One normal per velocity component of the free atoms; R₁ is the x
        component of each structure's first free atom.
        """
        velocities = batch.velocities
        normals = torch.randn(
            velocities.shape,
            generator=self._step_generator(velocities.device),
            dtype=velocities.dtype,
            device=velocities.device,
        )
        normals = torch.where(free, normals, 0.0)
        index = batch.batch_idx.long()
        atoms = torch.arange(batch.num_nodes, device=velocities.device)
        first_atom = torch.full(
            (batch.num_graphs,), batch.num_nodes, dtype=torch.long, device=index.device
        )
        first_atom.scatter_reduce_(
            0, index, torch.where(free.squeeze(-1), atoms, batch.num_nodes), "amin"
        )
        padded = torch.cat([normals[:, 0], normals.new_zeros(1)])
        first = padded[first_atom]
        squares = per_graph_sum((normals * normals).sum(dim=-1), batch)
        return first, (squares - first * first).clamp_min(0.0)

    @property
    def transferred_energy(self) -> torch.Tensor | None:
        """Energy added by the thermostat so far, eV, shape [B] (None before a step)."""
        state = getattr(self, "_state", None)
        return None if state is None else state.transferred_energy
