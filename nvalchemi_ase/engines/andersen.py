"""``NVTAndersen``: velocity Verlet with Andersen's stochastic collisions.

Andersen, J. Chem. Phys. 72, 2384 (1980), in the per-component form ASE uses:
after the first half kick, every velocity component of every free atom of
structure b is, with probability p_b, replaced by a fresh draw from the
Maxwell–Boltzmann distribution N(0, k_B T0_b / m). With ``fix_com`` the free
atoms of each structure first get a common random velocity N(0, k_B T0_b /
M_b) (as ASE's ``Andersen`` does; it makes the scheme exact, see
:meth:`NVTAndersen._add_com_velocity`), and after the collisions the
structure's centre-of-mass velocity (over its free atoms) is removed, and
removed again after the second half kick, so the centre of mass does not
move.

With ``fix_com=False`` the velocities sample the canonical distribution of
3 × (free atoms) degrees of freedom; with ``fix_com=True`` that of the
3 × (free atoms) − 3 left once the centre-of-mass motion is removed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from nvalchemi.data import Batch

from nvalchemi_ase.engines._common import (
    ParameterValue,
    check_parameter,
    make_state,
    per_graph_sum,
    to_per_system,
)
from nvalchemi_ase.engines._verlet import ThermostattedVerlet, remove_com_velocity
from nvalchemi_ase.units import thermal_energy_nvalchemi

if TYPE_CHECKING:
    from nvalchemi.models.base import BaseModelMixin

__all__ = ["NVTAndersen"]


class NVTAndersen(ThermostattedVerlet):
    """Batched Andersen thermostat (per-component velocity collisions).

    Parameters
    ----------
    model : BaseModelMixin
        The potential.
    dt : float
        Time step, fs.
    temperature : float or torch.Tensor, shape [B]
        Bath temperature, K (nvalchemi's ``KB_EV`` convention).
    collision_probability : float or torch.Tensor, shape [B]
        Probability per step and velocity component of a collision, in
        [0, 1] (ASE's ``andersen_prob``).
    fix_com : bool
        Keep each structure's centre of mass at rest (ASE's ``fixcm``).
    random_seed : int
        Seed of the noise (one ``torch.Generator`` for the batch, reseeded
        from ``random_seed`` and ``step_count`` every step).
    **kwargs
        ``n_steps``, ``hooks``, ``convergence_hook`` and ``BaseDynamics``
        options.

    Notes
    -----
    State per structure: ``kT`` [B] eV and ``collision_probability`` [B];
    nothing evolves, so graphs with ``status >= exit_status`` need no state
    restored (their velocities are restored by ``BaseDynamics``).
    """

    def __init__(
        self,
        model: BaseModelMixin,
        dt: float,
        temperature: ParameterValue,
        collision_probability: ParameterValue,
        fix_com: bool = True,
        random_seed: int = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__(model, dt, random_seed=random_seed, **kwargs)
        self._temperature = check_parameter("temperature", temperature, minimum=0.0)
        self._probability = check_parameter(
            "collision_probability", collision_probability, minimum=0.0, maximum=1.0
        )
        self.fix_com = bool(fix_com)

    def _init_state(self, batch: Batch) -> None:
        self._state = self._new_state(batch.num_graphs, batch)

    def _make_new_state(self, n: int, template_batch: Batch) -> Batch:
        return self._new_state(n, template_batch)

    def _new_state(self, count: int, template: Batch) -> Batch:
        device, dtype = template.device, template.positions.dtype
        temperature = to_per_system(
            "temperature", self._temperature, count, device, dtype
        )
        probability = to_per_system(
            "collision_probability", self._probability, count, device, dtype
        )
        return make_state(
            {
                "kT": thermal_energy_nvalchemi(temperature),
                "collision_probability": probability,
            },
            device,
        )

    def before_drift(self, batch: Batch, free: torch.Tensor) -> None:
        """Collide velocity components with the bath; remove the COM velocity."""
        velocities = batch.velocities
        shape, dtype, device = velocities.shape, velocities.dtype, velocities.device
        generator = self._step_generator(device)
        chance = torch.rand(shape, generator=generator, dtype=dtype, device=device)
        normals = torch.randn(shape, generator=generator, dtype=dtype, device=device)
        index = batch.batch_idx.long()
        state = self._state
        if self.fix_com:
            self._add_com_velocity(batch, free, generator)
        width = torch.sqrt(state.kT[index] / batch.atomic_masses).unsqueeze(-1)
        collide = (chance < state.collision_probability[index].unsqueeze(-1)) & free
        velocities.copy_(torch.where(collide, width * normals, velocities))
        if self.fix_com:
            remove_com_velocity(batch, free)

    def _add_com_velocity(
        self, batch: Batch, free: torch.Tensor, generator: torch.Generator
    ) -> None:
        """Give each structure's free atoms a common thermal velocity N(0, kT/M).

        Velocities at rest in the centre-of-mass frame have covariance
        kT (M⁻¹ − 1 1ᵀ / M_total); adding this draw restores kT M⁻¹, which the
        collisions keep and the centre-of-mass removal projects back. Without
        it, removing the centre-of-mass velocity after partial collisions
        cools the structure by about (1 − p) / (N − 1) relative.
        """
        velocities = batch.velocities
        masses = torch.where(free.squeeze(-1), batch.atomic_masses, 0.0)
        total = per_graph_sum(masses, batch).clamp_min(torch.finfo(masses.dtype).tiny)
        draw = torch.randn(
            (batch.num_graphs, 3),
            generator=generator,
            dtype=velocities.dtype,
            device=velocities.device,
        )
        common = draw * torch.sqrt(self._state.kT / total).unsqueeze(-1)
        velocities.add_(torch.where(free, common[batch.batch_idx.long()], 0.0))

    def after_second_kick(self, batch: Batch, free: torch.Tensor) -> None:
        """With ``fix_com``, remove the COM velocity the kick may have added."""
        if self.fix_com:
            remove_com_velocity(batch, free)
