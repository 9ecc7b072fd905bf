# %% [markdown]
# # 04 · Write your own integrator, run it from ASE
#
# nvalchemi's recipe for a new integrator is short: subclass `BaseDynamics`,
# declare what the model must give (`__needs_keys__`) and what the integrator
# writes (`__provides_keys__`), and implement `pre_update` (before the force
# call) and `post_update` (after it). The result runs on a batched `Batch`.
#
# `nvalchemi_ase.wrap.md_class` turns such a class into an ASE-style dynamics
# class: ASE's arguments and units, `attach`, `run`, trajectories and logs, for
# many `Atoms` at once. This tutorial writes velocity Verlet (the example of
# nvalchemi's dynamics-implementation guide), runs it on a batch of argon
# crystals with an observer and one trajectory per structure, checks energy
# conservation, and then runs one of this package's own engines, `Bussi`, on
# the same batch.

# /// script
# dependencies = ["nvalchemi-ase"]
# ///

# %%
from pathlib import Path

import numpy as np
from ase import units
from ase.build import bulk
from ase.io import read
from ase.md import velocitydistribution

from nvalchemi_ase import NVAlchemiCalculator

# Maxwell-Boltzmann momenta (ASE 3.29 renamed MaxwellBoltzmannDistribution)
thermalize = getattr(
    velocitydistribution,
    "thermalize_momenta",
    velocitydistribution.MaxwellBoltzmannDistribution,
)

OUT = Path("tutorial-output")
OUT.mkdir(exist_ok=True)

# Float64 LJ argon with a smooth (C2-switched) cutoff, so energy is conserved.
calc = NVAlchemiCalculator("lj", device="cpu", dtype="float64", switch_width=1.5)

rng = np.random.default_rng(4)
images = []
for index, repeat in enumerate([(2, 2, 2), (3, 2, 2), (2, 2, 2)]):
    atoms = bulk("Ar", "fcc", a=5.26, cubic=True).repeat(repeat)
    atoms.rattle(0.03, seed=index)
    thermalize(atoms, temperature_K=60.0, rng=rng)
    velocitydistribution.Stationary(atoms)
    atoms.calc = calc
    images.append(atoms)
print("structures:", [len(atoms) for atoms in images], "atoms")

# %% [markdown]
# ## The integrator, as nvalchemi's guide writes it
#
# Positions move in `pre_update`, velocities get the new forces in
# `post_update`; both wrap their in-place updates in `torch.no_grad()`. Its
# time step `dt` is used as is, in nvalchemi's internal time unit, which *is*
# the ASE time unit (velocities are Å per ASE time unit).

# %%
from typing import Any

import torch
from nvalchemi.data import Batch
from nvalchemi.dynamics.base import BaseDynamics


class VelocityVerlet(BaseDynamics):
    """Velocity Verlet integrator."""

    __needs_keys__: set[str] = {"forces"}  # noqa: RUF012
    __provides_keys__: set[str] = {"velocities", "positions"}  # noqa: RUF012

    def __init__(
        self,
        model,
        n_steps: int,
        dt: float = 1.0,
        hooks=None,
        convergence_hook=None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            model=model,
            hooks=hooks,
            convergence_hook=convergence_hook,
            n_steps=n_steps,
            **kwargs,
        )
        self.dt = dt
        self._prev_accelerations: torch.Tensor | None = None

    def pre_update(self, batch: Batch) -> None:
        """x(t+dt) = x(t) + v(t)*dt + 0.5*a(t)*dt^2"""
        positions, velocities, forces = batch.positions, batch.velocities, batch.forces
        masses = batch.atomic_masses.unsqueeze(-1)
        with torch.no_grad():
            if forces is not None and not torch.all(forces == 0):
                accelerations = forces / masses
                self._prev_accelerations = accelerations.clone()
                positions.add_(velocities * self.dt + 0.5 * accelerations * self.dt**2)
            else:
                positions.add_(velocities * self.dt)

    def post_update(self, batch: Batch) -> None:
        """v(t+dt) = v(t) + 0.5*(a(t) + a(t+dt))*dt"""
        velocities, forces = batch.velocities, batch.forces
        masses = batch.atomic_masses.unsqueeze(-1)
        with torch.no_grad():
            new_accelerations = forces / masses
            if self._prev_accelerations is not None:
                velocities.add_(
                    0.5 * (self._prev_accelerations + new_accelerations) * self.dt
                )
            else:
                velocities.add_(new_accelerations * self.dt)


# %% [markdown]
# ## Wrap it and run it from ASE
#
# `timestep_unit="ase"` says the engine's `dt` is in ASE time units, so the
# wrapped class takes ASE's `timestep` unchanged (use `"fs"` for engines that
# take femtoseconds, like nvalchemi's own integrators). The `{i}` in the
# trajectory name gives each structure its own file; the observer is an ordinary
# ASE observer, called every 25 steps with the `Atoms` up to date.

# %%
from nvalchemi_ase.wrap import md_class

ASEVerlet = md_class(VelocityVerlet, timestep_unit="ase")
dyn = ASEVerlet(
    images, 2 * units.fs, trajectory=str(OUT / "verlet_{i}.traj"), loginterval=25
)

energies = []  # (frames, structures), eV/atom


def record_energy():
    energies.append([atoms.get_total_energy() / len(atoms) for atoms in images])


dyn.attach(record_energy, interval=25)
dyn.run(250)  # 0.5 ps

energies = np.array(energies)
drift = np.abs(energies - energies[0]).max(axis=0)
for index, atoms in enumerate(images):
    print(
        f"structure {index}: {len(atoms):3d} atoms, T = {atoms.get_temperature():5.1f}"
        f" K, largest |E(t) - E(0)| = {drift[index]:.1e} eV/atom"
    )

frames = read(OUT / "verlet_1.traj", index=":")
print(f"verlet_1.traj: {len(frames)} frames of {len(frames[0])} atoms")

# %% [markdown]
# Total energy stays constant to about 1e-6 eV/atom over half a picosecond: the
# integrator is symplectic and the switched cutoff keeps the energy smooth. (The
# temperature falls from 60 K to about 35 K because the crystals started at
# their lattice sites: half the kinetic energy goes into potential energy.)
#
# ## A thermostat from `nvalchemi_ase.engines`: Bussi
#
# nvalchemi 0.3 has no Bussi (stochastic velocity rescaling), Berendsen or
# Andersen thermostat, and no BFGS or MDMin optimizer; `nvalchemi_ase.engines`
# adds them as batched `BaseDynamics` subclasses written like the class above,
# and `nvalchemi_ase.md` / `nvalchemi_ase.optimize` expose them with ASE's
# names and arguments. Here each structure gets its own target temperature and
# the run continues from where velocity Verlet left off. `transferred_energy`
# is the energy the thermostat has put in, so `E_total - transferred_energy`
# stays constant like NVE's total energy.

# %%
from nvalchemi_ase.md import Bussi

targets = [40.0, 80.0, 120.0]
bussi = Bussi(
    images,
    2 * units.fs,
    temperature_K=targets,
    taut=25 * units.fs,
    seed=7,
    trajectory=str(OUT / "bussi_{i}.traj"),
    loginterval=25,
)
temperatures = []
bussi.attach(
    lambda: temperatures.append([a.get_temperature() for a in images]), interval=5
)
bussi.run(400)

late = np.array(temperatures)[len(temperatures) // 2 :]
for index, target in enumerate(targets):
    spread = target * np.sqrt(2.0 / (3 * len(images[index])))  # canonical sigma_T
    print(
        f"structure {index}: target {target:5.1f} K (canonical spread "
        f"{spread:4.1f} K), mean T over the last 0.4 ps "
        f"{late[:, index].mean():5.1f} K, thermostat added "
        f"{bussi.transferred_energy[index]:+.3f} eV"
    )

# %% [markdown]
# Small crystals fluctuate a lot in the canonical ensemble (the spread is
# T sqrt(2 / 3N)), so short runs scatter around their targets; `tests/` checks
# the mean and the variance of the temperature over long batched runs.
