# %% [markdown]
# # 05 · Analysing results: plots, trajectories, `ase gui`
#
# Every run can record per-structure time series straight from the batch
# (`Recorder`) and draw them (`Recorder.plot`); trajectories are plain ASE files
# with energies and forces, so `ase.io.read` and `ase gui` read them.

# /// script
# dependencies = ["nvalchemi-ase"]
# ///

# %%
import subprocess
import sys
from pathlib import Path

import numpy as np
from ase import units
from ase.build import bulk
from ase.io import read
from ase.md.velocitydistribution import Stationary

from nvalchemi_ase import NVAlchemiCalculator, to_dataframe
from nvalchemi_ase.dynamics.recorder import Recorder
from nvalchemi_ase.md import IsotropicMTKNPT

OUT = Path("tutorial-output")
OUT.mkdir(exist_ok=True)
calc = NVAlchemiCalculator("lj", device="cpu", switch_width=1.5)

# %% [markdown]
# ## NPT for four crystals at four pressures

# %%
pressures_gpa = np.array([0.0, 0.1, 0.2, 0.4])
images = []
for index in range(len(pressures_gpa)):
    atoms = bulk("Ar", "fcc", a=5.3, cubic=True).repeat(2)
    atoms.rattle(0.02, seed=index)
    rng = np.random.default_rng(index)
    masses = atoms.get_masses()[:, None]
    atoms.set_momenta(
        rng.normal(size=(len(atoms), 3)) * np.sqrt(masses * units.kB * 40.0)
    )
    Stationary(atoms)  # start at ~40 K with no centre-of-mass drift
    atoms.calc = calc
    images.append(atoms)
dyn = IsotropicMTKNPT(
    images,
    4 * units.fs,
    temperature_K=40.0,
    pressure_au=pressures_gpa * units.GPa,
    tdamp=100 * units.fs,
    pdamp=500 * units.fs,
    trajectory=str(OUT / "npt_{i}.traj"),
    loginterval=20,
)
record = Recorder(dyn, interval=10)
dyn.run(400)
series = record.as_arrays()
print({key: value.shape for key, value in series.items()})
print(
    "mean pressure of the second half [GPa]:",
    np.round(np.nanmean(series["pressure_gpa"][len(series["step"]) // 2 :], axis=0), 3),
)
print(
    "final volume per atom [Å³]:", [round(a.get_volume() / len(a), 2) for a in images]
)
print("plot:", record.plot(OUT / "npt.png", title="NPT at four pressures"))

# %% [markdown]
# The state at the end of the run as a table (energies in eV, temperatures in K,
# volumes in Å³), one row per structure:

# %%
table = to_dataframe(dyn)
table["pressure_gpa"] = pressures_gpa
table[["formula", "pressure_gpa", "volume", "temperature", "energy"]]

# %% [markdown]
# ## Trajectories are ASE files
#
# Each frame carries energy, forces and stress.

# %%
frames = read(OUT / "npt_3.traj", ":")
print(
    len(frames),
    "frames;",
    frames[-1].get_potential_energy(),
    "eV;",
    frames[-1].get_stress()[:3],
    "eV/Å³",
)

# %% [markdown]
# `ase gui` opens them; its terminal mode prints any expression per frame
# (here: frame index, energy, largest force):

# %%
table = subprocess.run(
    [
        sys.executable,
        "-m",
        "ase",
        "gui",
        "-t",
        "-g",
        "i, e, fmax",
        str(OUT / "npt_3.traj"),
    ],
    capture_output=True,
    text=True,
    check=True,
).stdout
print(table)
