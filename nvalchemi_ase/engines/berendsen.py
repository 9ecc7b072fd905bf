"""``NVTBerendsen``: velocity Verlet with Berendsen's weak-coupling rescaling.

Berendsen et al., J. Chem. Phys. 81, 3684 (1984). At the start of each step the
velocities of structure b are scaled by

    λ_b = sqrt(1 + (T0_b / T_b − 1) dt / τ_b),  clipped to [0.9, 1.1]

with T_b the kinetic temperature over ``3 × (free atoms)`` degrees of freedom
(ASE's count). Optionally (``fix_com``), after the first half kick each
structure's mean momentum per atom is subtracted, as ASE's ``NVTBerendsen``
does with ``fixcm=True``. The ensemble is *not* canonical: kinetic-energy
fluctuations are suppressed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from nvalchemi.data import Batch

from nvalchemi_ase.engines._common import (
    ParameterValue,
    per_graph_sum,
)
from nvalchemi_ase.engines._verlet import (
    CoupledThermostatVerlet,
    degrees_of_freedom,
    kinetic_energy,
)

if TYPE_CHECKING:
    from nvalchemi.models.base import BaseModelMixin

__all__ = ["NVTBerendsen"]

#: Berendsen's limits on the per-step velocity scale factor (as ASE's).
SCALE_LIMITS = (0.9, 1.1)


class NVTBerendsen(CoupledThermostatVerlet):
    """Batched NVT Berendsen (weak-coupling velocity rescaling).

    Parameters
    ----------
    model : BaseModelMixin
        The potential.
    dt : float
        Time step, fs.
    temperature : float or torch.Tensor, shape [B]
        Target temperature, K (nvalchemi's ``KB_EV`` convention), scalar or
        one per structure.
    taut : float or torch.Tensor, shape [B]
        Coupling time τ, fs (> 0), scalar or one per structure.
    fix_com : bool
        Subtract each structure's mean momentum per atom after the first half
        kick (ASE's ``fixcm=True``; frozen atoms count in the mean with zero
        momentum, and are then kept at zero velocity).
    **kwargs
        ``n_steps``, ``hooks``, ``convergence_hook`` and ``BaseDynamics``
        options.

    Notes
    -----
    State per structure (``self._state``): ``kT`` [B] eV and ``taut`` [B] in
    ASE time units; nothing evolves, so graphs with ``status >= exit_status``
    need no state restored.
    """

    def __init__(
        self,
        model: BaseModelMixin,
        dt: float,
        temperature: ParameterValue,
        taut: ParameterValue,
        fix_com: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(model, dt, temperature, taut, **kwargs)
        self.fix_com = bool(fix_com)

    def before_first_kick(self, batch: Batch, free: torch.Tensor) -> None:
        """Scale each structure's velocities towards the target temperature."""
        energy = kinetic_energy(batch)
        thermal_now = 2.0 * energy / degrees_of_freedom(batch, free).clamp_min(1.0)
        state = self._state
        ratio = state.kT / torch.where(energy > 0, thermal_now, 1.0)
        radicand = 1.0 + (ratio - 1.0) * (self._dt_internal / state.taut)
        scale = torch.sqrt(radicand.clamp_min(0.0)).clamp(*SCALE_LIMITS)
        scale = torch.where(energy > 0, scale, 1.0)
        batch.velocities.mul_(scale[batch.batch_idx.long()].unsqueeze(-1))

    def before_drift(self, batch: Batch, free: torch.Tensor) -> None:
        """With ``fix_com``, remove each structure's mean momentum per atom."""
        if not self.fix_com:
            return
        masses = batch.atomic_masses.unsqueeze(-1)
        momenta = masses * batch.velocities
        mean = per_graph_sum(momenta, batch) / batch.num_nodes_per_graph.unsqueeze(-1)
        batch.velocities.sub_(mean[batch.batch_idx.long()] / masses)
