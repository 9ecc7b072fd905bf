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
  kernel call given its own length. With equal lengths every step is
  nvalchemi's bit for bit.

Two further fixes, kept from the engine this replaces in ``md/npt.py``:

* **Chains of length 1.** nvalchemiops 0.5's NHC kernel
  (``_npt_thermostat_chain_update_kernel``) reads ``eta_dot[s, 1]`` whatever
  the chain length, one element past the end of structure s's row of a
  ``[B, 1]`` tensor (the next structure's value, or the heap). Such a chain's
  velocities are given a zero column the kernel reads and never writes (the
  state's ``[B, 1]`` tensor becomes a view of a ``[B, 2]`` zero buffer),
  rebuilt at every half step if the state was replaced (refill, checkpoint).
  The kernel still applies its "last link" update to the single link, with
  the previous link read at index -1, so a 1-link chain does not conserve
  the MTK energy (see ``md/npt.py``).
* **Deprecation warnings.** nvalchemi 0.3 passes ``cells_inv``/``volumes`` to
  nvalchemiops 0.5 kernels that deprecated them; the half steps run with
  those two warnings ignored (:func:`deprecated_arguments_ignored`).

Units are nvalchemi's: ``dt``, ``barostat_time``, ``thermostat_time`` in fs,
``temperature`` in K (``KB_EV``; the state holds kT in eV), ``pressure`` in
eV/Å³, state times in the internal (= ASE) time unit.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from nvalchemi.data import Batch
from nvalchemi.dynamics import NPT

from nvalchemi_ase._compat import npt_operators

if TYPE_CHECKING:
    from nvalchemi.models.base import BaseModelMixin

__all__ = ["ChainNPT", "deprecated_arguments_ignored"]

#: Messages of the nvalchemiops deprecations nvalchemi 0.3's NPT/NPH trigger.
_DEPRECATED_ARGUMENTS = ("'cells_inv' is deprecated", "'volumes' is deprecated")

#: The chain-velocity fields of the state: particles [B, chain_length],
#: barostat [B, barostat_chain_length].
_CHAIN_VELOCITIES = ("nhc_eta_dot", "nhc_b_eta_dot")


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


def _pad_chain_velocities(state: Batch, key: str) -> None:
    """Give a length-1 chain's velocities ``state[key]`` the zero column read.

    The ``[B, 1]`` tensor is replaced by the first column of a ``[B, 2]``
    buffer whose second column is zero (Warp indexes the view through its
    strides, so ``eta_dot[s, 1]`` reads that zero; no kernel writes it).
    Idempotent; only for chains of length 1.
    """
    velocities = getattr(state, key)
    if velocities.stride() == (2, 1):
        return  # already a view of a padded buffer
    padded = velocities.new_zeros(velocities.shape[0], 2)
    padded[:, :1].copy_(velocities)
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
        """Zero column for each length-1 chain (see the module docstring)."""
        if self.chain_length == 1:
            _pad_chain_velocities(self._state, "nhc_eta_dot")
        if self.barostat_chain_length == 1:
            _pad_chain_velocities(self._state, "nhc_b_eta_dot")

    # -- the chains' half steps ----------------------------------------------

    def _particle_chain_half_step(self, batch: Batch, ops: Any) -> None:
        """NHC-p half step, then ``v *= exp(-η̇_1 dt/2)`` (nvalchemi's operator)."""
        state = self._state
        ops.npt_thermostat_half_step(
            state.nhc_eta,
            state.nhc_eta_dot,
            self._compute_ke(batch),
            state.temperature,
            state.nhc_Q,
            state.num_atoms_per_system,
            self.chain_length,
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
            self.barostat_chain_length,
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
                self._compute_P(batch, volumes),
                state.pressure,
                volumes,
                state.W,
                self._compute_ke(batch),
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
            volumes = self._compute_volumes(batch)
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
            volumes = self._compute_volumes(batch)
            cells_inv = torch.linalg.inv_ex(batch.cell)[0].contiguous()
            self._barostat_and_velocity_half_steps(
                batch, ops, volumes, cells_inv, velocities_first=True
            )
            self._barostat_chain_half_step(batch, ops)
            self._particle_chain_half_step(batch, ops)
