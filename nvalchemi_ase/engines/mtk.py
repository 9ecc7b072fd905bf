"""``ChainNPT``: nvalchemi's MTK ``NPT`` with one length per Nosé-Hoover chain.

nvalchemi 0.3's ``NPT`` thermostats the particles with one Nosé-Hoover chain
and the cell (barostat) with another, but takes a single ``chain_length``: it
sizes both chains' tensors with it and passes it to both chain updates. ASE's
``IsotropicMTKNPT``/``MTKNPT`` take ``tchain`` and ``pchain``. This subclass
keeps nvalchemi's engine (its state, kernels and splitting) and changes only
what the two lengths touch:

* **State.** ``chain_length`` sizes the particle chain (``nhc_eta``,
  ``nhc_eta_dot``, ``nhc_Q`` [B, chain_length]) as in nvalchemi;
  ``barostat_chain_length`` sizes the barostat chain (``nhc_b_eta``,
  ``nhc_b_eta_dot``, ``nhc_b_Q`` [B, barostat_chain_length]), its masses
  computed by nvalchemi's ``nhc_compute_masses`` from the same arguments
  nvalchemi's ``NPT`` gives it. With equal lengths nvalchemi's state is used
  as it is.
* **Half steps.** ``pre_update``/``post_update`` are nvalchemi's, operator for
  operator and in its order (NHC-p → NHC-b → barostat → velocities →
  positions → cell, and the mirror after the forces), with each chain's
  kernel call given its own length. With equal lengths (of 2 or more links)
  every step is nvalchemi's bit for bit.

Two further fixes (the first one extends the padding the engine this
replaces in ``md/npt.py`` did for the chain velocities only):

* **Chains of length 1.** nvalchemiops 0.5's NHC kernel
  (``_npt_thermostat_chain_update_kernel``) reads ``eta_dot[s, 1]`` whatever
  the chain length, one element past the end of structure s's row of a
  ``[B, 1]`` tensor (the next structure's value, or the heap), and applies its
  "last link" update to a single link too, reading link -1 (the previous
  row), so a 1-link chain was neither safe nor conserving. Such a chain's
  ``[B, 1]`` tensors (η, η̇, Q) become views of ``[B, 2]`` buffers whose
  second column is a frozen link (η = η̇ = 0, Q = inf) and the kernel is
  called with 2 links: it then gives the first link exactly the one-link
  chain's kicks (:func:`_frozen_second_link`), and reads nothing outside the
  row. The views are rebuilt at every half step if the state was replaced
  (refill, checkpoint).
* **Deprecation warnings.** nvalchemi 0.3 passes ``cells_inv``/``volumes`` to
  nvalchemiops 0.5 kernels that deprecated them; the half steps run with
  those two warnings ignored (:func:`deprecated_arguments_ignored`).

Units are nvalchemi's: ``dt``, ``barostat_time``, ``thermostat_time`` in fs,
``temperature`` in K (``KB_EV``; the state holds kT in eV), ``pressure`` in
eV/Å³, state times in the internal (= ASE) time unit.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from nvalchemi.data import Batch
from nvalchemi.dynamics import NPT

from nvalchemi_ase._compat import (
    npt_kinetic_energies,
    npt_operators,
    npt_pressure_tensor,
    npt_volumes,
)

if TYPE_CHECKING:
    from nvalchemi.models.base import BaseModelMixin

__all__ = ["ChainNPT", "deprecated_arguments_ignored"]

#: Messages of the nvalchemiops deprecations nvalchemi 0.3's NPT/NPH trigger.
_DEPRECATED_ARGUMENTS = ("'cells_inv' is deprecated", "'volumes' is deprecated")

#: The chain-velocity fields of the state: particles [B, chain_length],
#: barostat [B, barostat_chain_length].
_CHAIN_VELOCITIES = ("nhc_eta_dot", "nhc_b_eta_dot")

#: Each chain's positions, velocities and masses.
_PARTICLE_CHAIN = ("nhc_eta", "nhc_eta_dot", "nhc_Q")
_BAROSTAT_CHAIN = ("nhc_b_eta", "nhc_b_eta_dot", "nhc_b_Q")


@contextlib.contextmanager
def deprecated_arguments_ignored() -> Iterator[None]:
    """Ignore nvalchemiops' ``cells_inv``/``volumes`` deprecations in the block."""
    with warnings.catch_warnings():
        for message in _DEPRECATED_ARGUMENTS:
            warnings.filterwarnings(
                "ignore",
                message=message,
                category=DeprecationWarning,
                module=r"nvalchemiops\.",
            )
        yield


def _frozen_second_link(state: Batch, keys: tuple[str, str, str]) -> None:
    """Give a 1-link chain ``state[keys]`` (η, η̇, Q) a frozen second link.

    Each ``[B, 1]`` tensor is replaced by the first column of a ``[B, 2]``
    buffer whose second column holds η = η̇ = 0 and Q = inf; the kernel is then
    called with 2 links. Its updates of that link add ``(Q_1 η̇_1² - kT)/inf
    = 0``, its factors ``exp(-η̇_2 dt/4)`` are 1 and ``η_2`` gains 0, so the
    first link gets exactly the one-link chain's kicks ``G_1 dt/4``, and no
    read leaves the structure's row. Idempotent (a padded view has stride
    ``(2, 1)``); redone when the state was replaced (refill, checkpoint).
    """
    eta, eta_dot, masses = (getattr(state, key) for key in keys)
    if masses.stride() == (2, 1):
        return  # already views of padded buffers
    pads = (0.0, 0.0, math.inf)
    for key, tensor, pad in zip(keys, (eta, eta_dot, masses), pads, strict=True):
        padded = torch.full(
            (tensor.shape[0], 2), pad, dtype=tensor.dtype, device=tensor.device
        )
        padded[:, :1].copy_(tensor)
        state[key] = padded[:, :1]


class ChainNPT(NPT):  # type: ignore[misc]
    """nvalchemi's ``NPT`` with separate particle and barostat chain lengths.

    Parameters
    ----------
    model : BaseModelMixin
        The potential (with ``stress``).
    dt : float or torch.Tensor
        Time step, fs.
    temperature : float or torch.Tensor, shape [B]
        Target temperature, K (nvalchemi's ``KB_EV``).
    pressure : float or torch.Tensor
        Target pressure, eV/Å³: [B] or scalar (isotropic), [B, 3]
        (anisotropic) or [B, 3, 3] (triclinic), as nvalchemi's ``NPT``.
    barostat_time, thermostat_time : float or torch.Tensor
        Time constants τ_P and τ_T, fs.
    pressure_coupling : {"isotropic", "anisotropic", "triclinic"}
        Which cell degrees of freedom move.
    chain_length : int
        Links of the particle chain (ASE's ``tchain``), >= 1.
    barostat_chain_length : int, optional
        Links of the barostat chain (ASE's ``pchain``), >= 1; default
        ``chain_length`` (nvalchemi's ``NPT``).
    **kwargs
        Forwarded to nvalchemi's ``NPT`` (``hooks``, ``n_steps``, ...).
    """

    def __init__(
        self,
        model: BaseModelMixin,
        dt: float | torch.Tensor,
        temperature: float | torch.Tensor,
        pressure: float | torch.Tensor,
        barostat_time: float | torch.Tensor,
        thermostat_time: float | torch.Tensor,
        pressure_coupling: str = "isotropic",
        chain_length: int = 3,
        barostat_chain_length: int | None = None,
        **kwargs: Any,
    ) -> None:
        if barostat_chain_length is None:
            barostat_chain_length = chain_length
        for name, links in (
            ("chain_length", chain_length),
            ("barostat_chain_length", barostat_chain_length),
        ):
            # nvalchemiops' chain kernel has no guard: 0 links crash the process
            if int(links) < 1:
                raise ValueError(f"{name} must be >= 1, got {links}")
        super().__init__(
            model,
            dt=dt,
            temperature=temperature,
            pressure=pressure,
            barostat_time=barostat_time,
            thermostat_time=thermostat_time,
            pressure_coupling=pressure_coupling,
            chain_length=int(chain_length),
            **kwargs,
        )
        self.barostat_chain_length = int(barostat_chain_length)

    # -- state -------------------------------------------------------------

    def _init_state(self, batch: Batch) -> None:
        super()._init_state(batch)
        kT = self._state.temperature
        tau_p = self._state.barostat_time
        self._resize_barostat_chain(self._state, kT, tau_p, batch.num_graphs)

    def _make_new_state(self, n: int, template_batch: Batch) -> Batch:
        state = super()._make_new_state(n, template_batch)
        # as nvalchemi's: the first new structure's masses, for all n
        kT = state.temperature[:1]
        tau_p = state.barostat_time[:1]
        self._resize_barostat_chain(state, kT, tau_p, 1, rows=n)
        return state

    def _resize_barostat_chain(
        self,
        state: Batch,
        kT: torch.Tensor,
        tau_p: torch.Tensor,
        count: int,
        rows: int | None = None,
    ) -> None:
        """Resize the barostat chain of ``state`` to ``barostat_chain_length``.

        The masses are nvalchemi's ``NPT`` ones for that length:
        ``nhc_compute_masses`` over one unit-mass dummy particle per
        structure (three for the triclinic cell), with kT (eV) and τ_P
        (internal time) of ``count`` structures, expanded to ``rows``.
        """
        links = self.barostat_chain_length
        if links == self.chain_length:
            return  # nvalchemi's state is the one wanted
        ops = npt_operators()
        dev, dtype = kT.device, kT.dtype
        particles = 3 if ops.cell_dof_count(self.pressure_coupling) == 9 else 1
        masses = torch.ones(count * particles, dtype=dtype, device=dev)
        owners = torch.arange(count, device=dev, dtype=torch.int32)
        owners = owners.repeat_interleave(particles)
        chain_masses = ops.nhc_compute_masses(kT, tau_p, masses, owners, links)
        rows = count if rows is None else rows
        if rows != count:
            chain_masses = chain_masses.expand(rows, -1).contiguous()
        state["nhc_b_Q"] = chain_masses
        state["nhc_b_eta"] = torch.zeros(rows, links, dtype=dtype, device=dev)
        state["nhc_b_eta_dot"] = torch.zeros(rows, links, dtype=dtype, device=dev)

    def _pad_length_one_chains(self) -> None:
        """Give each 1-link chain a frozen second link (module docstring)."""
        if self.chain_length == 1:
            _frozen_second_link(self._state, _PARTICLE_CHAIN)
        if self.barostat_chain_length == 1:
            _frozen_second_link(self._state, _BAROSTAT_CHAIN)

    # -- the chains' half steps ----------------------------------------------

    def _particle_chain_half_step(self, batch: Batch, ops: Any) -> None:
        """NHC-p half step, then ``v *= exp(-η̇_1 dt/2)`` (nvalchemi's operator)."""
        state = self._state
        ops.npt_thermostat_half_step(
            state.nhc_eta,
            state.nhc_eta_dot,
            npt_kinetic_energies(self, batch),
            state.temperature,
            state.nhc_Q,
            state.num_atoms_per_system,
            max(self.chain_length, 2),  # 1 link: plus the frozen one
            state.dt,
        )
        scale = torch.exp(-state.nhc_eta_dot[:, 0] * state.dt * 0.5)
        batch.velocities.mul_(scale[batch.batch_idx].unsqueeze(-1))

    def _barostat_chain_half_step(self, batch: Batch, ops: Any) -> None:
        """NHC-b half step, then ``ε̇ *= exp(-ξ̇_1 dt/2)`` (nvalchemi's operator)."""
        state = self._state
        count = batch.num_graphs
        ke_cell = ops.cell_kinetic_energy(
            state.cell_velocity, state.W, self.pressure_coupling
        )
        # the kernel counts N_f = 3 * input: nvalchemi passes cell dof // 3
        cell_ndof = torch.full(
            (count,),
            ops.cell_dof_count(self.pressure_coupling) // 3,
            dtype=torch.int32,
            device=batch.device,
        )
        ops.npt_thermostat_half_step(
            state.nhc_b_eta,
            state.nhc_b_eta_dot,
            ke_cell,
            state.temperature,
            state.nhc_b_Q,
            cell_ndof,
            max(self.barostat_chain_length, 2),
            state.dt,
        )
        b_scale = torch.exp(-state.nhc_b_eta_dot[:, 0] * state.dt * 0.5)
        state.cell_velocity.mul_(b_scale.view(count, 1, 1))

    def _barostat_and_velocity_half_steps(
        self,
        batch: Batch,
        ops: Any,
        volumes: torch.Tensor,
        cells_inv: torch.Tensor,
        velocities_first: bool,
    ) -> None:
        """Barostat and force + strain velocity half steps, nvalchemi's operators."""
        state = self._state
        batch_idx = batch.batch_idx.int()

        def barostat() -> None:
            ops.npt_barostat_half_step(
                state.cell_velocity,
                npt_pressure_tensor(self, batch, volumes),
                state.pressure,
                volumes,
                state.W,
                npt_kinetic_energies(self, batch),
                state.num_atoms_per_system,
                state.dt,
            )

        def velocities() -> None:
            ops.nph_velocity_half_step(
                batch.velocities,
                batch.atomic_masses,
                batch.forces,
                state.cell_velocity,
                volumes,
                state.num_atoms_per_system,
                state.dt,
                batch_idx,
                cells_inv,
                self.pressure_coupling,
            )

        if velocities_first:
            velocities()
            barostat()
        else:
            barostat()
            velocities()

    def pre_update(self, batch: Batch) -> None:
        """NHC-p half → NHC-b half → baro half → v half → r full → cell full."""
        self._pad_length_one_chains()
        ops = npt_operators()
        with deprecated_arguments_ignored():
            volumes = npt_volumes(self, batch)
            cells_inv = torch.linalg.inv_ex(batch.cell)[0].contiguous()
            self._particle_chain_half_step(batch, ops)
            self._barostat_chain_half_step(batch, ops)
            self._barostat_and_velocity_half_steps(
                batch, ops, volumes, cells_inv, velocities_first=False
            )
            ops.npt_position_update(
                batch.positions,
                batch.velocities,
                batch.cell,
                self._state.cell_velocity,
                self._state.dt,
                cells_inv,
                batch.batch_idx.int(),
            )
            ops.npt_cell_update(batch.cell, self._state.cell_velocity, self._state.dt)

    def post_update(self, batch: Batch) -> None:
        """Velocity half → baro half → NHC-b half → NHC-p half."""
        self._pad_length_one_chains()
        ops = npt_operators()
        with deprecated_arguments_ignored():
            volumes = npt_volumes(self, batch)
            cells_inv = torch.linalg.inv_ex(batch.cell)[0].contiguous()
            self._barostat_and_velocity_half_steps(
                batch, ops, volumes, cells_inv, velocities_first=True
            )
            self._barostat_chain_half_step(batch, ops)
            self._particle_chain_half_step(batch, ops)
