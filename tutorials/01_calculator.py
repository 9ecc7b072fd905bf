# %% [markdown]
# # 01 · The ASE calculator and batched single points
#
# `NVAlchemiCalculator` is an ordinary ASE calculator over any nvalchemi model.
# Attach it to an `Atoms` and use `get_potential_energy()`, `get_forces()`,
# `get_stress()` as always; or hand it a whole list of structures and get all the
# results from **one** model call with `calculate_batch`. Units are ASE's: eV,
# eV/Å, eV/Å³ (Voigt order xx, yy, zz, yz, xz, xy; tensile stress positive).
#
# This tutorial runs on Lennard-Jones argon (`MODEL = "lj"`, seconds on a CPU).
# Set `MODEL = "sevennet-0"` below to run it on SevenNet-0 instead, a universal
# machine-learned potential whose weights ship inside the `sevenn` package (no
# download; `pip install "nvalchemi-ase[sevennet]"`): the structures switch to
# Si, Cu and a water molecule.

# /// script
# dependencies = ["nvalchemi-ase"]
# ///

# %%
import time

import numpy as np
from ase.build import bulk, molecule
from ase.calculators.fd import calculate_numerical_forces

from nvalchemi_ase import NVAlchemiCalculator, atoms_to_batch, batch_to_atoms

MODEL = "lj"  # or "sevennet-0"
calc = NVAlchemiCalculator(MODEL, device="cpu")
print(f"model {MODEL}, device {calc.device}, dtype {calc.dtype}")
print("properties:", calc.implemented_properties)

# %% [markdown]
# ## One structure, the ASE way

# %%
if MODEL == "lj":
    atoms = bulk("Ar", "fcc", a=5.26, cubic=True)
else:
    atoms = bulk("Si", "diamond", a=5.43, cubic=True)
atoms.rattle(0.05, seed=0)
atoms.calc = calc
print("energy  [eV]    ", atoms.get_potential_energy())
print("forces  [eV/Å]  ", atoms.get_forces()[:2])
print("stress  [eV/Å³] ", atoms.get_stress())

# %% [markdown]
# The forces are the negative gradient of the energy: check two atoms against
# finite differences (LJ runs in float64, so they agree to about 1e-7 eV/Å;
# SevenNet-0 is a float32 model, to about 1e-3 eV/Å).

# %%
numerical = calculate_numerical_forces(atoms, eps=1e-3, iatoms=[0, 1])
print("max |F - F_fd| =", np.abs(atoms.get_forces()[:2] - numerical).max(), "eV/Å")

# %% [markdown]
# ## Many structures, one model call
#
# `calculate_batch` evaluates any mix of bulk crystals, slabs and molecules in
# one forward pass and returns the same numbers as one-by-one calls.

# %%
if MODEL == "lj":
    images = [bulk("Ar", "fcc", a=a, cubic=True) for a in np.linspace(5.1, 5.5, 24)]
else:
    images = [bulk("Cu", "fcc", a=a, cubic=True) for a in np.linspace(3.45, 3.75, 24)]
    images.append(molecule("H2O"))  # no cell, no pbc: mixed freely
start = time.perf_counter()
results = calc.calculate_batch(images, ["energy", "forces", "stress"])
batched = time.perf_counter() - start
start = time.perf_counter()
single = [calc.calculate_batch([atoms], ["energy", "forces"])[0] for atoms in images]
one_by_one = time.perf_counter() - start
print(
    f"{len(images)} structures: batched {batched:.2f} s, one by one {one_by_one:.2f} s"
)
print(
    "largest energy difference:",
    max(abs(r["energy"] - s["energy"]) for r, s in zip(results, single, strict=True)),
    "eV",
)

# %% [markdown]
# An equation of state falls out of the batched energies (the molecule, if any,
# has no stress: its cell has no volume).

# %%
bulk_results = [(a, r) for a, r in zip(images, results, strict=True) if "stress" in r]
volumes = np.array([a.get_volume() / len(a) for a, _ in bulk_results])
energies = np.array([r["energy"] / len(a) for a, r in bulk_results])
fit = np.polyfit(volumes, energies, 3)
v0 = min(
    np.roots(np.polyder(fit)), key=lambda v: abs(v.imag) + abs(v.real - volumes.mean())
)
print(f"equilibrium volume ≈ {v0.real:.2f} Å³/atom")

# %% [markdown]
# ## The adapter: `Atoms` ⇄ nvalchemi `Batch`
#
# The calculator is built on `atoms_to_batch`/`batch_to_atoms`, which you can use
# directly to hand structures to nvalchemi's own engines. Nothing is lost on the
# way: masses, momenta, tags, charges and `FixAtoms` come back.

# %%
batch = atoms_to_batch(images[:3], device="cpu")
print(batch, batch.positions.dtype)
back = batch_to_atoms(batch)
print(
    all(
        (a.positions == b.positions).all()
        for a, b in zip(images[:3], back, strict=True)
    )
)
