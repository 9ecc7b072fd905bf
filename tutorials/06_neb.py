# %% [markdown]
# # 06 · Vacancy migration: many nudged elastic bands at once
#
# A vacancy in a metal moves when a neighbouring atom hops into it; the energy
# barrier of that hop sets the diffusion rate. Here four hops in copper (the
# nearest-neighbour hop in a small and a larger cell, in a strained cell, and in
# the top layer of a (100) surface) are computed together:
#
# * `nvalchemi_ase.mep.relax_paths` relaxes all the bands in one batch on
#   nvalchemi's NEB engine (one model call per step for every image of every
#   path), each path converging on its own;
# * `nvalchemi_ase.mep.NEB` is ASE's `NEB` for one path, driven by ASE's
#   optimizers, with its images evaluated in one model call.
#
# The model is SevenNet-0, a universal machine-learned potential
# (`pip install "nvalchemi-ase[sevennet]"`; 6.5 minutes on 2 CPU cores, seconds
# on a GPU). It gives 0.59-0.60 eV for the bulk hop in both cell sizes (the
# measured migration energy of copper is ~0.7 eV), 0.52 eV under 2 % tension and
# 0.51 eV in the (100) top layer.
# `NVALCHEMI_ASE_TUTORIAL_MODEL=lj` swaps in a Lennard-Jones fit to copper
# (ε = 0.409 eV, σ = 2.338 Å; Halicioglu & Pound 1975): seconds on a CPU, but a
# pair potential, which overestimates vacancy barriers in metals severalfold (it
# gives ~2.5 eV here; the measured migration energy of copper is ~0.7 eV). The
# test suite runs the tutorial that way.

# /// script
# dependencies = ["nvalchemi-ase"]
# ///

# %%
import os
from pathlib import Path

import ase.optimize
import numpy as np
from ase.build import bulk, fcc100
from ase.constraints import FixAtoms
from ase.io import write
from ase.mep import NEBTools
from matplotlib.figure import Figure

from nvalchemi_ase import NVAlchemiCalculator
from nvalchemi_ase.mep import NEB, plot_bands, relax_paths
from nvalchemi_ase.optimize import FIRE

OUT = Path("tutorial-output")
OUT.mkdir(exist_ok=True)
MODEL = os.environ.get("NVALCHEMI_ASE_TUTORIAL_MODEL", "sevennet-0")
if MODEL == "lj":
    calc = NVAlchemiCalculator(
        "lj", device="cpu", epsilon=0.409, sigma=2.338, cutoff=6.0, switch_width=1.0
    )
else:
    calc = NVAlchemiCalculator(MODEL, device="cpu")
A = 3.61  # Å, fcc copper

# %% [markdown]
# ## Four hops
#
# Each path is an `[initial, final]` pair: the vacancy at atom 0, then atom
# `hopper` moved onto its site. The endpoints are relaxed first, all eight in
# one batched optimizer.


# %%
def vacancy_hop(atoms, hopper):
    """Vacancy at atom 0 of ``atoms``; ``hopper`` jumps into it."""
    initial, final = atoms.copy(), atoms.copy()
    final.positions[hopper] = atoms.positions[0]
    del initial[0]
    del final[0]
    return [initial, final]


def nearest(atoms, shell):
    """Index of an atom in neighbour shell ``shell`` (1: nearest) of atom 0."""
    distances = atoms.get_distances(0, range(len(atoms)), mic=True)
    shells = np.unique(np.round(distances, 3))
    return int(np.flatnonzero(np.isclose(distances, shells[shell], atol=1e-3))[0])


small = bulk("Cu", "fcc", a=A, cubic=True).repeat(2)  # 32 sites
large = bulk("Cu", "fcc", a=A, cubic=True).repeat(3)  # 108 sites
strained = small.copy()
strained.set_cell(small.cell * 1.02, scale_atoms=True)  # +2 % in every direction
surface = fcc100("Cu", size=(3, 3, 3), a=A, vacuum=8.0)
surface.set_constraint(FixAtoms(mask=surface.get_tags() == 3))  # bottom layer
surface.info.clear()
top_layer = np.flatnonzero(surface.get_tags() == 1)
surface = surface[[*top_layer, *np.flatnonzero(surface.get_tags() != 1)]]  # top first
in_plane = surface.get_distances(0, range(1, len(top_layer)), mic=True)
surface_hopper = 1 + int(np.argmin(in_plane))  # a top-layer nearest neighbour

paths = {
    "1st neighbour, 31 atoms": vacancy_hop(small, nearest(small, 1)),
    "1st neighbour, 107 atoms": vacancy_hop(large, nearest(large, 1)),
    "1st neighbour, 31 atoms, +2 %": vacancy_hop(strained, nearest(strained, 1)),
    "(100) top layer, 26 atoms": vacancy_hop(surface, surface_hopper),
}
endpoints = [atoms for pair in paths.values() for atoms in pair]
for atoms in endpoints:
    atoms.calc = calc
FIRE(endpoints, logfile=None).run(fmax=0.01, steps=500)
print({name: len(pair[0]) for name, pair in paths.items()})

# %% [markdown]
# ## All bands in one batch
#
# `relax_paths` interpolates each band (linear, then IDPP as ASE's
# `interpolate("idpp")`, all bands at once), then runs climbing-image NEB. Bands
# may have different lengths and sizes; each stops when its largest NEB force
# is below `fmax`.

# %%
results = relax_paths(
    list(paths.values()), calc, n_images=[7, 7, 5, 9], fmax=0.05, climb=True
)
print(f"{'path':28s} {'images':>6s} {'Ef [eV]':>8s} {'Er [eV]':>8s} {'steps':>5s}")
for name, result in zip(paths, results, strict=True):
    print(
        f"{name:28s} {len(result.images):6d} {result.barrier_forward:8.3f} "
        f"{result.barrier_reverse:8.3f} {result.steps:5d}"
        + ("" if result.converged else "  (not converged)")
    )
plot_bands(results, OUT / "neb_bands.png", labels=list(paths), title="Cu vacancy hops")
for index, result in enumerate(results):
    write(OUT / f"neb_band_{index}.extxyz", result.images)  # energies and forces too

# %% [markdown]
# Every result holds its images with their own energies and forces, so ASE's
# `NEBTools` reads them directly (here: the barrier from ASE's force-consistent
# fit, and the image energies without a fit).

# %%
tools = NEBTools(results[0].images)
print("fitted barrier, ΔE [eV]:", np.round(tools.get_barrier(), 4))
print("highest image [eV]:", round(tools.get_barrier(fit=False)[0], 4))

# %% [markdown]
# ## One path the ASE way
#
# `nvalchemi_ase.mep.NEB` is ASE's `NEB` (same arguments, same numbers) whose
# interior images are evaluated in one model call per step; ASE's optimizers,
# trajectories and `NEBTools` work on it unchanged.

# %%
initial, final = paths["1st neighbour, 31 atoms"]
images = [initial.copy() for _ in range(6)] + [final.copy()]
for image in images:
    image.calc = calc
neb = NEB(images, climb=True, method="improvedtangent")
neb.interpolate("idpp", mic=True)
opt = ase.optimize.FIRE(neb, trajectory=str(OUT / "neb.traj"), logfile=None)
opt.run(fmax=0.05, steps=500)
barrier = NEBTools(images).get_barrier(fit=False)[0]
print(f"ASE FIRE: {opt.nsteps} steps, barrier {barrier:.3f} eV")
print(f"relax_paths (FIRE2):  barrier {results[0].barrier_forward:.3f} eV")

figure = Figure(figsize=(6, 4), layout="constrained")
NEBTools(images).plot_band(ax=figure.subplots())
figure.savefig(OUT / "neb_ase_band.png", dpi=100)
