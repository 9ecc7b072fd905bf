# %% [markdown]
# # 02 · Relaxing many structures at once
#
# `nvalchemi_ase.optimize` has ASE's optimizers (`FIRE`, `FIRE2`, `LBFGS`, `BFGS`,
# `MDMin`) with ASE's arguments, but each object relaxes a whole list of
# structures on nvalchemi's batched engines. Every structure converges on its own:
# once its largest force is below `fmax` it stops moving while the others go on.
#
# The model is Lennard-Jones argon (`MODEL = "lj"`, seconds on a CPU); set
# `MODEL = "sevennet-0"` below to relax Cu, Al, Si and NaCl crystals with
# SevenNet-0 instead (`pip install "nvalchemi-ase[sevennet]"`).

# /// script
# dependencies = ["nvalchemi-ase"]
# ///

# %%
from pathlib import Path

import numpy as np
from ase.build import bulk
from ase.filters import FrechetCellFilter

from nvalchemi_ase import NVAlchemiCalculator, to_dataframe
from nvalchemi_ase.dynamics.recorder import Recorder
from nvalchemi_ase.optimize import FIRE, LBFGS

OUT = Path("tutorial-output")
OUT.mkdir(exist_ok=True)
MODEL = "lj"  # or "sevennet-0"
calc = NVAlchemiCalculator(MODEL, device="cpu")

# %% [markdown]
# ## Twelve rattled crystals in one optimizer

# %%
rng = np.random.default_rng(0)
if MODEL == "lj":
    prototypes = [bulk("Ar", "fcc", a=5.26, cubic=True)]
else:
    prototypes = [
        bulk("Cu", "fcc", a=3.61, cubic=True),
        bulk("Al", "fcc", a=4.05, cubic=True),
        bulk("Si", "diamond", a=5.43, cubic=True),
        bulk("NaCl", "rocksalt", a=5.64, cubic=True),
    ]
rattle = 0.08 if MODEL == "lj" else 0.02  # Å; argon is soft, so rattle it harder
images = []
for index in range(12):
    atoms = prototypes[index % len(prototypes)].copy()
    atoms.rattle(rattle * (1 + 0.5 * (index % 3)), seed=index)
    atoms.calc = calc
    images.append(atoms)

opt = FIRE(
    images,
    logfile=OUT / "relax.log",
    trajectory=str(OUT / "relax_{i}.traj"),
    progress=True,  # a bar: a widget in a notebook, text on a terminal
)
record = Recorder(opt)
converged = opt.run(fmax=0.05, steps=300)
print("all converged:", converged, "after", opt.nsteps, "batched steps")
print("step at which each converged:", opt.converged_at_step)
print("largest force per structure [eV/Å]:", np.round(opt.fmax_per_structure, 4))
print("plot:", record.plot(OUT / "relax.png", title="12 structures, one FIRE"))

# %% [markdown]
# The same run as a table, one row per structure (a pandas `DataFrame`; units in
# `table.attrs["units"]`), and the plot inline: `record.plot()` without a file
# name is shown by the notebook.

# %%
table = to_dataframe(opt)
print(table[["formula", "energy", "fmax", "converged_at_step"]].describe())
table.head()

# %%
record.plot(title="12 structures, one FIRE")

# %% [markdown]
# The batch log has one line per step (`relax.log`); a path template with `{i}`
# gives every structure ASE's own log instead. Each structure also got its own
# trajectory, readable with `ase.io.read` or `ase gui`.

# %%
print((OUT / "relax.log").read_text().splitlines()[-1])

# %% [markdown]
# ## The cell too: ASE's `FrechetCellFilter`
#
# Wrapping structures in ASE's cell filters relaxes the cell as well: FIRE,
# BFGS and MDMin follow ASE's own path on the filter, FIRE2 and LBFGS run
# nvalchemi's variable-cell engines.

# %%
strained = prototypes[0].copy()
strained.set_cell(strained.cell * 1.04, scale_atoms=True)
strained.calc = calc
LBFGS(FrechetCellFilter(strained), logfile=None).run(fmax=0.01)
a = (strained.get_volume() * 4 / len(strained)) ** (1 / 3)  # 4 atoms per fcc cube
stress = np.abs(strained.get_stress()).max()
print(f"relaxed fcc lattice constant: {a:.4f} Å (largest stress {stress:.1e} eV/Å³)")
