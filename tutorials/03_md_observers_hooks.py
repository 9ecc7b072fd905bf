# %% [markdown]
# # 03 · Molecular dynamics with observers, nvalchemi hooks and stages
#
# `nvalchemi_ase.md` has ASE's integrators (`VelocityVerlet`, `Langevin`,
# `NoseHooverChainNVT`, `IsotropicMTKNPT`, `MTKNPT`, `Bussi`, `NVTBerendsen`,
# `Andersen`) with ASE's arguments and units, running many structures at once.
# Everything you `attach` behaves as in ASE; on top of that you can attach
# nvalchemi's own hooks, and ASE-style observers at any of nvalchemi's stages.
#
# Argon with Lennard-Jones keeps this fast on a CPU; swap in any model.

# /// script
# dependencies = ["nvalchemi-ase"]
# ///

# %%
from pathlib import Path

from ase import units
from ase.build import bulk

from nvalchemi_ase import NVAlchemiCalculator
from nvalchemi_ase.md import Langevin, VelocityVerlet

OUT = Path("tutorial-output")
OUT.mkdir(exist_ok=True)
calc = NVAlchemiCalculator("lj", device="cpu", switch_width=1.5)  # smooth cutoff

images = []
for index, size in enumerate((2, 2, 3)):
    atoms = bulk("Ar", "fcc", a=5.26, cubic=True).repeat(size)
    atoms.rattle(0.02, seed=index)
    atoms.calc = calc
    images.append(atoms)

# %% [markdown]
# ## ASE observers, ASE's schedule
#
# One temperature per structure (70, 90 and 110 K), a trajectory per structure,
# and an observer called every 50 steps, exactly when ASE would call it.

# %%
dyn = Langevin(
    images,
    4 * units.fs,
    temperature_K=[70.0, 90.0, 110.0],
    friction=0.02 / units.fs,
    seed=1,
    trajectory=str(OUT / "langevin_{i}.traj"),
    loginterval=25,
)


def report():
    temperatures = [atoms.get_temperature() for atoms in images]
    print(
        f"step {dyn.nsteps:4d}  T = " + "  ".join(f"{t:6.1f} K" for t in temperatures)
    )


dyn.attach(report, interval=50)
dyn.run(300)

# %% [markdown]
# ## nvalchemi hooks, attached the same way
#
# Anything that follows nvalchemi's `Hook` protocol (a `stage`, a `frequency`,
# `__call__(ctx, stage)`) runs natively inside the engine and sees the live
# `Batch` through its `DynamicsContext`.

# %%
from nvalchemi.dynamics import DynamicsStage
from nvalchemi.dynamics.hooks import EnergyDriftMonitorHook, NaNDetectorHook


class MaxSpeed:
    """A custom hook: the fastest atom of the batch after every 100th step."""

    stage = DynamicsStage.AFTER_STEP
    frequency = 100

    def __call__(self, ctx, stage):
        speed = ctx.batch.velocities.norm(dim=1).max().item()
        print(
            f"  hook: nvalchemi step_count {ctx.step_count}, fastest atom "
            f"{speed:.4f} Å/ASE-time"
        )


nve = VelocityVerlet(images, 2 * units.fs)
nve.attach(NaNDetectorHook())
nve.attach(EnergyDriftMonitorHook(threshold=1e-3, metric="per_atom_per_step"))
nve.attach(MaxSpeed())

# %% [markdown]
# ## ASE-style observers at any stage
#
# `attach_at(stage, function, interval)` calls an ordinary function at one of
# nvalchemi's stages, with the `Atoms` updated to the batch as it is there. Here
# we count model evaluations (`AFTER_COMPUTE`) and watch the total energy.

# %%
evaluations = []
nve.attach_at("AFTER_COMPUTE", lambda: evaluations.append(nve.nsteps))
energies = []
nve.attach(
    lambda: energies.append(sum(a.get_total_energy() for a in images)), interval=10
)
nve.run(300)
natoms = sum(len(a) for a in images)
print(
    f"model evaluations: {len(evaluations)} for 300 steps (one initial + one per step)"
)
print(
    f"total-energy drift: {(energies[-1] - energies[0]) / natoms:.2e} eV/atom over "
    f"{300 * 2 / 1000:.1f} ps"
)
