"""``LangevinHooverBAOAB``: BAOAB Langevin for the atoms, Langevin–Hoover for the cell.

The batched form of ASE 3.29's ``ase.md.langevinbaoab.LangevinBAOAB``: BAOAB
splitting (Leimkuhler and Matthews, J. Chem. Phys. 138, 174102 (2013)) for
the atoms and, with an external stress, the Langevin–Hoover barostat of
Quigley and Probert (J. Chem. Phys. 120, 11432 (2004)) for the cell, in ASE's
arrangement. One step, for every structure b at once::

    pre_update:   P B  Ac A  O Oc  A Ac
    [model evaluates forces and stress at the new positions and cell]
    post_update:  (cell force)  B P

with ``B`` the half kick ``v += ½ dt F/m``, ``A`` the half drift
``x += ½ dt v``, ``O`` the Ornstein–Uhlenbeck step
``v ← v · exp(-(γ 1 + G) dt) + √(kT (1 - e^{-2γdt}) / m) ξ`` (G the drag of the
cell velocity on the atoms), and for the cell ``P`` the half kick
``p_ε += ½ dt f_ε``, ``Ac`` the half drift (cell and positions scaled by
``exp(½ dt p_ε / W)``) and ``Oc`` its own Ornstein–Uhlenbeck step. The cell
force is ``f_ε = V (X + σ_ext) + tr(K)/N_f 1`` with ``K = Σ m v ⊗ v``,
``X = (K - V σ)/V`` and ``σ`` the model's (tensile-positive) stress, so the
barostat holds the mean stress *including* the kinetic part at ``σ_ext``
(``σ_ext = -p 1`` for a pressure p). With ``hydrostatic=True`` the cell
keeps its shape: ``p_ε`` and ``f_ε`` are multiples of the identity
(``f_ε = tr`` of the matrix above), as ASE's scalar form.

Without a temperature the atoms' ``O`` has γ = 0 (NVE, or NPH with an
external stress); without a stress there is no cell step (NVT or NVE). The
random draws (one normal per velocity component, then one per cell degree of
freedom) come from a ``torch.Generator`` reseeded from ``random_seed`` and the
step count, so ASE's trajectories are matched only when nothing is random
(NVE, NPH), to rounding.

Units, as the other engines here: time step and time constants in fs,
temperature in K (nvalchemi's ``KB_EV``), barostat mass in eV fs², stress in
eV/Å³; velocities in Å per ASE time unit. Frozen atoms get no kick, drift or
noise; the cell step scales them with the cell, as ASE's ``set_cell(...,
scale_atoms=True)`` does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from nvalchemi.data import Batch

from nvalchemi_ase.engines._common import (
    ParameterValue,
    check_parameter,
    free_atoms,
    make_state,
    per_graph_sum,
    to_per_system,
)
from nvalchemi_ase.engines._verlet import ThermostattedVerlet, degrees_of_freedom
from nvalchemi_ase.units import FS_PER_ASE_TIME, thermal_energy_nvalchemi

if TYPE_CHECKING:
    from nvalchemi.models.base import BaseModelMixin

__all__ = ["LangevinHooverBAOAB"]


class LangevinHooverBAOAB(ThermostattedVerlet):
    """Batched BAOAB Langevin dynamics with an optional Langevin–Hoover barostat.

    Parameters
    ----------
    model : BaseModelMixin
        The potential (with ``stress`` for a barostat).
    dt : float
        Time step, fs.
    temperature : float or torch.Tensor, shape [B], optional
        Target temperature, K; None for no thermostat (NVE / NPH).
    t_tau : float or torch.Tensor, shape [B], optional
        Langevin time constant of the atoms, fs (γ = 1/τ); needed with a
        temperature.
    external_stress : array_like, shape [3, 3] or [B, 3, 3], optional
        Stress the barostat holds, eV/Å³ (tensile positive: ``-p`` times the
        identity for a pressure p); None for a fixed cell.
    barostat_mass : float or torch.Tensor, shape [B], optional
        Barostat mass W, eV fs²; needed with a stress.
    p_tau : float or torch.Tensor, shape [B], optional
        Langevin time constant of the cell, fs; None or ``inf`` for no cell
        thermostat (the cell then equilibrates through the atoms).
    hydrostatic : bool
        Keep the cell's shape (only its volume changes).
    random_seed : int
        Seed of the noise.
    **kwargs
        ``n_steps``, ``hooks``, ``convergence_hook`` and ``BaseDynamics``
        options.

    Notes
    -----
    State per structure: ``kT`` [B] eV, ``gamma`` [B] and ``cell_gamma`` [B]
    per ASE time unit, and with a barostat ``mass`` [B] eV (ASE time)²,
    ``external_stress``, ``p_eps`` (eV ASE time) and ``f_eps`` (eV), all
    [B, 3, 3]. A structure's first cell force is computed at its first step
    from its stress and velocities then (ASE computes it at construction).
    """

    def __init__(
        self,
        model: BaseModelMixin,
        dt: float,
        *,
        temperature: ParameterValue | None = None,
        t_tau: ParameterValue | None = None,
        external_stress: Any = None,
        barostat_mass: ParameterValue | None = None,
        p_tau: ParameterValue | None = None,
        hydrostatic: bool = False,
        random_seed: int = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__(model, dt, random_seed=random_seed, **kwargs)
        if temperature is not None and t_tau is None:
            raise ValueError("a temperature needs t_tau (fs), the Langevin time")
        self._temperature = (
            None
            if temperature is None
            else check_parameter("temperature", temperature, minimum=0.0)
        )
        self._t_tau = (
            None
            if t_tau is None
            else check_parameter("t_tau", t_tau, minimum=0.0, strict=True)
        )
        self.barostat = external_stress is not None
        self._cell_force_pending = False  # rows without a cell force yet
        self.hydrostatic = bool(hydrostatic)
        self._external_stress = None
        if self.barostat:
            self._external_stress = _stress_matrices(external_stress)
            if barostat_mass is None:
                raise ValueError("an external stress needs barostat_mass (eV fs²)")
            self._barostat_mass = check_parameter(
                "barostat_mass", barostat_mass, minimum=0.0, strict=True
            )
            self._p_tau = (
                None
                if p_tau is None
                else check_parameter("p_tau", p_tau, minimum=0.0, strict=True)
            )
            # instance-level keys: this engine reads stress and moves cells
            self.__needs_keys__ = {"forces", "stress"}
            self.__provides_keys__ = {"positions", "velocities", "cell"}

    # -- state ------------------------------------------------------------------

    def _init_state(self, batch: Batch) -> None:
        self._state = self._new_state(batch.num_graphs, batch)

    def _make_new_state(self, n: int, template_batch: Batch) -> Batch:
        return self._new_state(n, template_batch)

    def _new_state(self, count: int, template: Batch) -> Batch:
        device, dtype = template.device, template.positions.dtype

        def per_system(name: str, value: ParameterValue) -> torch.Tensor:
            return to_per_system(name, value, count, device, dtype)

        zeros = torch.zeros(count, dtype=dtype, device=device)
        if self._temperature is None:
            kT, gamma = zeros, zeros.clone()
        else:
            assert self._t_tau is not None  # checked in __init__  # noqa: S101
            kT = thermal_energy_nvalchemi(per_system("temperature", self._temperature))
            gamma = FS_PER_ASE_TIME / per_system("t_tau", self._t_tau)
        fields = {"kT": kT, "gamma": gamma}
        if self.barostat:
            fields |= self._barostat_state(count, device, dtype, per_system)
            self._cell_force_pending = True  # a host flag: no read of the device
        return make_state(fields, device)

    def _barostat_state(
        self, count: int, device: torch.device, dtype: torch.dtype, per_system: Any
    ) -> dict[str, torch.Tensor]:
        stress = torch.as_tensor(self._external_stress, dtype=dtype, device=device)
        if stress.shape[0] == 1:
            stress = stress.expand(count, 3, 3)
        if stress.shape[0] != count:
            raise ValueError(
                f"external_stress has {stress.shape[0]} matrices for {count} "
                "structures; give one or one per structure"
            )
        if self._p_tau is None or self._temperature is None:
            cell_gamma = torch.zeros(count, dtype=dtype, device=device)
        else:
            cell_gamma = FS_PER_ASE_TIME / per_system("p_tau", self._p_tau)
        zeros = torch.zeros((count, 3, 3), dtype=dtype, device=device)
        return {
            "mass": per_system("barostat_mass", self._barostat_mass)
            / FS_PER_ASE_TIME**2,
            "cell_gamma": cell_gamma,
            "external_stress": stress.clone(),
            "p_eps": zeros,
            "f_eps": zeros.clone(),
            # rows whose cell force is not computed yet (the state is created
            # before the first force evaluation, and for admitted structures)
            "f_eps_pending": torch.ones(count, dtype=torch.bool, device=device),
        }

    # -- the step ---------------------------------------------------------------

    def pre_update(self, batch: Batch) -> None:
        """P B Ac A O Oc A Ac: everything up to the force evaluation.

        Parameters
        ----------
        batch : Batch
            ``velocities`` [V, 3], ``positions`` [V, 3] Å and (barostat)
            ``cell`` [B, 3, 3] Å updated in place.
        """
        self._check_batch(batch)
        with torch.no_grad():
            free = free_atoms(batch).unsqueeze(-1)
            generator = self._step_generator(batch.positions.device)
            if self.barostat and self._cell_force_pending:
                self._complete_cell_force(batch, free)
            self._cell_kick()
            self._half_kick(batch, free)
            self._cell_drift(batch)
            self._half_drift(batch, free)
            self._ornstein_uhlenbeck(batch, free, generator)
            self._cell_ornstein_uhlenbeck(generator)
            self._half_drift(batch, free)
            self._cell_drift(batch)

    def post_update(self, batch: Batch) -> None:
        """Cell force, B, P: the rest of the step with the new forces and stress.

        Parameters
        ----------
        batch : Batch
            ``velocities`` [V, 3] updated in place.
        """
        with torch.no_grad():
            free = free_atoms(batch).unsqueeze(-1)
            if self.barostat:
                self._state.f_eps.copy_(self._cell_force(batch, free))
            self._half_kick(batch, free)
            self._cell_kick()

    # -- the atoms --------------------------------------------------------------

    def _half_drift(self, batch: Batch, free: torch.Tensor) -> None:
        drift = torch.where(free, 0.5 * self._dt_internal * batch.velocities, 0.0)
        batch.positions.add_(drift)

    def _ornstein_uhlenbeck(
        self, batch: Batch, free: torch.Tensor, generator: torch.Generator
    ) -> None:
        state = self._state
        dt = self._dt_internal
        index = batch.batch_idx.long()
        velocities = batch.velocities
        if self.barostat:
            identity = torch.eye(3, dtype=velocities.dtype, device=velocities.device)
            drag = state.gamma.view(-1, 1, 1) * identity + self._cell_drag(batch, free)
            propagator = torch.linalg.matrix_exp(-dt * drag)  # [B, 3, 3]
            damped = torch.einsum("vb,vab->va", velocities, propagator[index])
        else:
            damped = velocities * torch.exp(-dt * state.gamma)[index].unsqueeze(-1)
        if self._temperature is None:  # NVE / NPH: friction and noise are zero
            velocities.copy_(torch.where(free, damped, 0.0))
            return
        amplitude = torch.sqrt(state.kT * (1.0 - torch.exp(-2.0 * dt * state.gamma)))
        noise = torch.randn(
            velocities.shape,
            generator=generator,
            dtype=velocities.dtype,
            device=velocities.device,
        )
        per_atom = amplitude[index] / batch.atomic_masses.sqrt()
        new = damped + per_atom.unsqueeze(-1) * noise
        velocities.copy_(torch.where(free, new, 0.0))

    # -- the cell ---------------------------------------------------------------

    def _complete_cell_force(self, batch: Batch, free: torch.Tensor) -> None:
        """Give new rows the cell force of their current state (ASE: at start)."""
        state = self._state
        pending = state.f_eps_pending.view(-1, 1, 1)
        state.f_eps.copy_(
            torch.where(pending, self._cell_force(batch, free), state.f_eps)
        )
        state.f_eps_pending.zero_()
        self._cell_force_pending = False

    def _cell_kick(self) -> None:
        if self.barostat:
            self._state.p_eps.add_(0.5 * self._dt_internal * self._state.f_eps)

    def _cell_drift(self, batch: Batch) -> None:
        """Scale cell and positions by ``exp(½ dt p_ε / W)`` (ASE: scale_atoms)."""
        if not self.barostat:
            return
        state = self._state
        rate = state.p_eps / state.mass.view(-1, 1, 1)
        scale = torch.linalg.matrix_exp(0.5 * self._dt_internal * rate)  # [B, 3, 3]
        cell = batch.cell
        cell.copy_(cell @ scale.mT)
        positions = batch.positions
        positions.copy_(
            torch.einsum("vb,vab->va", positions, scale[batch.batch_idx.long()])
        )

    def _cell_drag(self, batch: Batch, free: torch.Tensor) -> torch.Tensor:
        """G = (p_ε + tr(p_ε)/N_f 1) / W, shape [B, 3, 3], per ASE time unit."""
        state = self._state
        dof = degrees_of_freedom(batch, free).clamp_min(1.0)
        trace = state.p_eps.diagonal(dim1=-2, dim2=-1).sum(-1)
        identity = torch.eye(3, dtype=trace.dtype, device=trace.device)
        drag = state.p_eps + (trace / dof).view(-1, 1, 1) * identity
        return drag / state.mass.view(-1, 1, 1)

    def _cell_ornstein_uhlenbeck(self, generator: torch.Generator) -> None:
        if not self.barostat or self._temperature is None or self._p_tau is None:
            return  # no cell thermostat: p_eps moves by its kicks only
        state = self._state
        dt = self._dt_internal
        p_eps = state.p_eps
        p_eps.mul_(torch.exp(-dt * state.cell_gamma).view(-1, 1, 1))
        amplitude = torch.sqrt(
            state.kT * (1.0 - torch.exp(-2.0 * dt * state.cell_gamma)) * state.mass
        )
        shape = (p_eps.shape[0], 1, 1) if self.hydrostatic else p_eps.shape
        noise = torch.randn(
            shape, generator=generator, dtype=p_eps.dtype, device=p_eps.device
        )
        if self.hydrostatic:
            noise = noise * torch.eye(3, dtype=p_eps.dtype, device=p_eps.device)
        else:
            noise = 0.5 * (noise + noise.mT)  # symmetric: no rotation
        p_eps.add_(amplitude.view(-1, 1, 1) * noise)

    def _cell_force(self, batch: Batch, free: torch.Tensor) -> torch.Tensor:
        """f_ε [B, 3, 3], eV: K - Vσ + Vσ_ext + tr(K)/N_f 1 (hydrostatic: its trace)."""
        state = self._state
        velocities = batch.velocities
        masses = torch.where(free, batch.atomic_masses.unsqueeze(-1), 0.0)
        kinetic = per_graph_sum(
            (masses * velocities).unsqueeze(2) * velocities.unsqueeze(1), batch
        )  # K = Σ m v ⊗ v, eV
        volume = torch.linalg.det(batch.cell).abs().view(-1, 1, 1)
        dof = degrees_of_freedom(batch, free).clamp_min(1.0)
        kinetic_trace = kinetic.diagonal(dim1=-2, dim2=-1).sum(-1)
        identity = torch.eye(3, dtype=kinetic.dtype, device=kinetic.device)
        force = (
            kinetic
            - volume * batch.stress.detach()
            + volume * state.external_stress
            + (kinetic_trace / dof).view(-1, 1, 1) * identity
        )
        if self.hydrostatic:
            trace = force.diagonal(dim1=-2, dim2=-1).sum(-1)
            force = trace.view(-1, 1, 1) * identity
        return force


def _stress_matrices(value: Any) -> np.ndarray:
    """External stress as [1, 3, 3] or [B, 3, 3] float64, eV/Å³ (finite)."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    array = np.asarray(value, dtype=np.float64)
    if array.shape == (3, 3):
        array = array[None]
    if array.ndim != 3 or array.shape[1:] != (3, 3):
        raise ValueError(
            f"external_stress must be [3, 3] or [B, 3, 3] (eV/Å³), got {array.shape}"
        )
    if not np.isfinite(array).all():
        raise ValueError("external_stress must be finite")
    return array
