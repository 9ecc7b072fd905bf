# %% [markdown]
# # 07 · MD analysis per structure: RDF, diffusion, viscosity
#
# A batched MD run is a screening tool once every structure gets its own
# analysis. Here three argon liquids (Lennard-Jones, ε = 0.0104 eV, σ = 3.40 Å)
# at three temperatures run in one batch; observers compute each one's MSD,
# VACF, stress autocorrelation and RDF while the run goes on, and the same
# numbers come back from the trajectory files.

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

from nvalchemi_ase import NVAlchemiCalculator
from nvalchemi_ase.analysis import (
    RDFObserver,
    TransportObserver,
    mean_squared_displacement,
)
from nvalchemi_ase.analysis.plots import plot_rdf, plot_transport
from nvalchemi_ase.md import Langevin, VelocityVerlet

OUT = Path("tutorial-output")
OUT.mkdir(exist_ok=True)
calc = NVAlchemiCalculator("lj", device="cpu", switch_width=1.5)

# %% [markdown]
# ## Three liquids in one batch
#
# 108 atoms each at 1.40 g/cm³; melted at 400 K, then brought to 90, 110 and
# 130 K with a Langevin thermostat (one temperature per structure).

# %%
temperatures = [90.0, 110.0, 130.0]
images = []
for index in range(len(temperatures)):
    atoms = bulk("Ar", "fcc", a=5.74, cubic=True).repeat(3)
    atoms.rattle(0.3, seed=index)
    atoms.calc = calc
    images.append(atoms)
Langevin(images, 10 * units.fs, temperature_K=400, friction=0.02, seed=0).run(100)
Langevin(images, 10 * units.fs, temperature_K=temperatures, friction=0.02, seed=1).run(
    200
)
print("temperatures [K]:", [round(a.get_temperature()) for a in images])

# %% [markdown]
# ## Observers on an NVE run
#
# `TransportObserver` keeps the last `window` samples only (a ring buffer), so
# memory does not grow with the run; `RDFObserver` keeps one histogram per
# element pair. The trajectory is written at the same interval, for comparison.

# %%
dyn = VelocityVerlet(
    images, 10 * units.fs, trajectory=str(OUT / "liquid_{i}.traj"), loginterval=2
)
transport = TransportObserver(dyn, window=75, block_length=100)
rdf = RDFObserver(dyn, rmax=8.0, nbins=80)
dyn.attach(transport, interval=2)
dyn.attach(rdf, interval=10)
dyn.run(600)

# The MSD slope at lag t is 6 × the running Green–Kubo integral at t, so the
# Einstein fit starts where that integral has levelled off (~0.5 ps here).
fit = (500.0, 1480.0)  # fs
msd, vacf = transport.msd(fit_window_fs=fit), transport.vacf()
eta = transport.viscosity()
for m, v, e in zip(msd, vacf, eta, strict=True):
    print(
        f"{e.temperature_K:5.0f} K"
        f"  D_MSD = {m.diffusion_cm2_s:.2e} ± {m.diffusion_error_cm2_s:.1e}"
        f"  D_VACF = {v.diffusion_cm2_s:.2e} ± {v.diffusion_error_cm2_s:.1e} cm²/s"
        f"  η = {e.viscosity:.2f} ± {e.viscosity_error:.2f} mPa·s"
    )
# literature for argon near its triple point: D ≈ 2.4e-5 cm²/s, η ≈ 0.27 mPa·s.
# 6 ps per liquid (3 blocks) is short: the error bars say so; a production run
# is 10-100 times longer (the observers' memory does not grow with it).

# %% [markdown]
# ## The same numbers from the files
#
# The `.traj` header holds the timestep and the frame interval.

# %%
from_files = mean_squared_displacement(
    [OUT / f"liquid_{i}.traj" for i in range(3)],
    window=75,
    block_length=100,
    fit_window_fs=fit,
)
print(
    "streamed == files:",
    np.allclose([r.diffusion for r in from_files], [r.diffusion for r in msd]),
)
for index, result in enumerate(rdf.result()):
    plot_rdf(result, OUT / f"rdf_{index}.png", title=f"{temperatures[index]:.0f} K")
plot_transport(msd[0], vacf[0], eta[0], OUT / "transport_0.png", title="90 K")

# %% [markdown]
# ## On the command line
#
# `nvalchemi-ase diffusion` and `nvalchemi-ase rdf` read the same files and
# write a CSV per structure, a results table, a JSON summary and plots.

# %%
subprocess.run(
    [
        sys.executable,
        "-m",
        "nvalchemi_ase",
        "diffusion",
        *[str(OUT / f"liquid_{i}.traj") for i in range(3)],
        "--window",
        "75",
        "--block-length",
        "100",
        "--fit-start",
        "500",
        "--fit-end",
        "1480",
        "--file-prefix",
        str(OUT / "cli") + "/",
        "--overwrite",
    ],
    check=True,
)
