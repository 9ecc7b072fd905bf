# %% [markdown]
# # 08 · MACE + D3 dispersion, a batch at a time
#
# Any MACE model runs through nvalchemi's `MACEWrapper`: a foundation model by
# name (`"mace-mp-0-medium"`, read from the weights folder, never downloaded)
# or any model file (`"my.model"`), and `+d3` adds DFT-D3(BJ) dispersion with
# the functional's parameters from an offline table (`"my.model+d3(pbe)"`).
# This tutorial relaxes a batch with MACE + D3 and checks every number against
# mace-torch's own `MACECalculator` plus the same D3, structure by structure.
#
# Offline, with no foundation weights on this machine, it builds a small MACE
# with random weights (mace-torch's own constructors; not physics). Put
# `mace-mp-0-medium.model` in the weights folder (`$NVALCHEMI_ASE_WEIGHTS`,
# `nvalchemi-ase models` says where) and the same code runs MACE-MP-0.
# Needs `pip install "nvalchemi-ase[mace,d3]"` and mace-torch (`make test`
# installs both).

# /// script
# dependencies = ["nvalchemi-ase[mace,d3]"]
# ///

# %%
import warnings
from pathlib import Path

import numpy as np
import torch
from ase.build import bulk, fcc111, molecule
from ase.calculators.mixing import SumCalculator

from nvalchemi_ase import NVAlchemiCalculator, to_dataframe
from nvalchemi_ase.models.weights import weights_dir
from nvalchemi_ase.optimize import FIRE

OUT = Path("tutorial-output")
OUT.mkdir(exist_ok=True)
foundation = weights_dir() / "mace-mp-0-medium.model"

# %% [markdown]
# ## The model file

# %%
if foundation.is_file():
    model_file = foundation
else:  # a small random-weight MACE-MP-like model for H, C, O, Si, Cu
    from e3nn import o3
    from mace import modules

    elements = [1, 6, 8, 14, 29]
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    block = modules.interaction_classes["RealAgnosticResidualInteractionBlock"]
    network = modules.ScaleShiftMACE(
        r_max=4.5,
        num_bessel=8,
        num_polynomial_cutoff=5,
        max_ell=1,
        interaction_cls=block,
        interaction_cls_first=block,
        num_interactions=2,
        num_elements=len(elements),
        hidden_irreps=o3.Irreps("8x0e + 8x1o"),
        MLP_irreps=o3.Irreps("16x0e"),
        atomic_energies=np.linspace(-5.0, -1.0, len(elements)),
        avg_num_neighbors=12.0,
        atomic_numbers=elements,
        correlation=2,
        radial_MLP=[16, 16],
        gate=torch.nn.functional.silu,
        atomic_inter_scale=0.5,
        atomic_inter_shift=0.0,
    ).eval()
    torch.set_default_dtype(previous)
    model_file = OUT / "random.model"
    torch.save(network, model_file)
print("model file:", model_file)

# %% [markdown]
# ## Molecule, slab and bulk in one call, against MACECalculator + D3
#
# The composed name is one model: one batch, one call, MACE's and D3's own
# neighbour lists.

# %%
water = molecule("H2O")
water.center(vacuum=5.0)
slab = fcc111("Cu", (2, 2, 3), vacuum=6.0)
slab.info.pop("adsorbate_info")
silicon = bulk("Si", "diamond", a=5.43, cubic=True)
images = [water, slab, silicon]
for index, atoms in enumerate(images):
    atoms.rattle(0.03, seed=index)

calc = NVAlchemiCalculator(f"{model_file}+d3(pbe)", device="cpu", dtype="float64")
batched = calc.calculate_batch(images, ["energy", "forces"])

from mace.calculators import MACECalculator

default_dtype = torch.get_default_dtype()
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # mace's notices about torch.load and dtypes
    mace_calc = MACECalculator(
        model_paths=str(model_file), device="cpu", default_dtype="float64"
    )
# MACECalculator sets torch's global default dtype (to float64 here) and needs it
# while it computes; nvalchemi_ase never changes it. It is put back at the end.
d3 = NVAlchemiCalculator("d3(pbe)", device="cpu", dtype="float64")
for atoms, result in zip(images, batched, strict=True):
    reference = atoms.copy()
    reference.calc = SumCalculator([mace_calc, d3])
    de = abs(result["energy"] - reference.get_potential_energy())
    df = np.abs(result["forces"] - reference.get_forces()).max()
    print(f"{atoms.get_chemical_formula():8s} |ΔE| {de:.1e} eV, max |ΔF| {df:.1e} eV/Å")
    assert de < 1e-8
    assert df < 1e-8

# %% [markdown]
# ## Relax all three together

# %%
for atoms in images:
    atoms.calc = calc
opt = FIRE(images, logfile=None, trajectory=str(OUT / "mace_d3_{i}.traj"))
opt.run(fmax=0.05, steps=200)
table = to_dataframe(opt)
print(table[["formula", "energy", "fmax", "converged_at_step"]])
for atoms in images:  # each relaxed energy is MACECalculator + D3's there too
    reference = atoms.copy()
    reference.calc = SumCalculator([mace_calc, d3])
    assert abs(atoms.get_potential_energy() - reference.get_potential_energy()) < 1e-8
torch.set_default_dtype(default_dtype)
table
