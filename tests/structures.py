"""A catalogue of structures every layer is tested on (argon, for the LJ model)."""

from __future__ import annotations

import numpy as np
from ase import Atoms
from ase.build import bulk, fcc111
from ase.cluster import Icosahedron

A_AR = 5.26  # Å, fcc argon


def rattled_bulk(repeat: int = 3, seed: int = 1, stdev: float = 0.05) -> Atoms:
    atoms = bulk("Ar", "fcc", a=A_AR, cubic=True).repeat((repeat,) * 3)
    atoms.rattle(stdev, seed=seed)
    return atoms


def moving_argon_cells(count: int) -> list[Atoms]:
    """``count`` rattled argon cells of 4 and 8 atoms, momenta ~0.5 amu Å/fs."""
    images = []
    for index in range(count):
        atoms = bulk("Ar", "fcc", a=A_AR, cubic=True) * (1 + index % 2, 1, 1)
        atoms.rattle(0.05, seed=index)
        rng = np.random.default_rng(index)
        atoms.set_momenta(rng.normal(0.0, 0.5, (len(atoms), 3)))
        images.append(atoms)
    return images


def triclinic() -> Atoms:
    cell = np.array([[5.4, 0.0, 0.0], [1.3, 5.6, 0.0], [0.9, 1.2, 5.9]])
    rng = np.random.default_rng(7)
    frac = np.array([[0, 0, 0], [0.5, 0.5, 0], [0.5, 0, 0.5], [0, 0.5, 0.5]])
    atoms = Atoms("Ar4", scaled_positions=frac, cell=cell, pbc=True)
    atoms.positions += rng.normal(scale=0.08, size=(4, 3))
    return atoms


def slab() -> Atoms:
    """fcc(111), pbc (T, T, F) and a zero third cell vector, rattled."""
    atoms = fcc111("Ar", size=(3, 3, 3), a=A_AR, vacuum=None)
    atoms.pbc = (True, True, False)
    atoms.info.pop("adsorbate_info")  # ASE's site helper, not simulation data
    atoms.rattle(0.05, seed=3)
    return atoms


def cluster() -> Atoms:
    """Ar55 icosahedron: no pbc, zero cell."""
    atoms = Icosahedron("Ar", noshells=3, latticeconstant=A_AR)
    atoms.rattle(0.05, seed=4)
    return atoms


def one_atom_cell() -> Atoms:
    """One atom in a primitive fcc cell: every vector (3.7 Å) is below the cutoff."""
    return bulk("Ar", "fcc", a=A_AR)


def small_cell_rattled() -> Atoms:
    """Two atoms in a cell smaller than the 8.5 Å cutoff, off equilibrium."""
    atoms = bulk("Ar", "fcc", a=A_AR).repeat((2, 1, 1))
    atoms.positions[1] += [0.15, -0.1, 0.05]
    return atoms


def left_handed() -> Atoms:
    """A rattled cubic crystal whose cell has a negative determinant."""
    atoms = rattled_bulk(repeat=2, seed=5)
    cell = atoms.cell.array.copy()
    cell[[0, 1]] = cell[[1, 0]]
    atoms.set_cell(cell)
    return atoms


CATALOGUE = {
    "bulk": rattled_bulk,
    "triclinic": triclinic,
    "slab": slab,
    "cluster": cluster,
    "one_atom": one_atom_cell,
    "small_cell": small_cell_rattled,
    "left_handed": left_handed,
}


def thermalize(atoms: Atoms, temperature_K: float, seed: int) -> Atoms:
    """Maxwell-Boltzmann momenta (ASE >= 3.29 renamed the function)."""
    from ase.md import velocitydistribution

    rng = np.random.default_rng(seed)
    if hasattr(velocitydistribution, "thermalize_momenta"):
        velocitydistribution.thermalize_momenta(atoms, temperature_K, rng=rng)
    else:  # pragma: no cover - ASE < 3.29
        velocitydistribution.MaxwellBoltzmannDistribution(
            atoms, temperature_K=temperature_K, rng=rng
        )
    return atoms


def _bulk(rng: np.random.Generator, largest: int = 100) -> Atoms:
    """Primitive fcc argon, 1-``largest`` atoms, randomly strained and rattled."""
    while True:
        repeat = rng.integers(1, 6, size=3)
        if repeat.prod() <= largest:
            break
    atoms = bulk("Ar", "fcc", a=A_AR) * tuple(int(r) for r in repeat)
    strain = np.eye(3) + rng.uniform(-0.03, 0.03, (3, 3))
    atoms.set_cell(atoms.cell.array @ strain, scale_atoms=True)
    atoms.rattle(rng.uniform(0.02, 0.12), seed=int(rng.integers(1 << 30)))
    return atoms


def _molecule(rng: np.random.Generator, largest: int = 100) -> Atoms:
    """A compact, rattled argon cluster of 2-6 atoms, no cell."""
    count = int(rng.integers(2, 7))
    base = np.array(
        [
            [0, 0, 0],
            [3.8, 0, 0],
            [1.9, 3.3, 0],
            [1.9, 1.1, 3.1],
            [5.7, 3.3, 0],
            [-1.9, 3.3, 0],
        ]
    )[:count]
    atoms = Atoms(f"Ar{count}", positions=base, pbc=False)
    atoms.rattle(0.1, seed=int(rng.integers(1 << 30)))
    return atoms


def _slab(rng: np.random.Generator, largest: int = 100) -> Atoms:
    """A rattled fcc(111) slab, pbc (T, T, F) without a third vector."""
    size = (int(rng.integers(2, 4)), int(rng.integers(2, 4)), 2)
    atoms = fcc111("Ar", size=size, a=A_AR, vacuum=None)
    atoms.pbc = (True, True, False)
    atoms.info.pop("adsorbate_info", None)
    atoms.rattle(0.08, seed=int(rng.integers(1 << 30)))
    return atoms


def mixed(count: int, seed: int = 0, largest: int = 100) -> list[Atoms]:
    """``count`` molecules, slabs and bulk cells (1-``largest`` atoms)."""
    rng = np.random.default_rng(seed)
    makers = (_bulk, _molecule, _bulk, _slab)
    return [makers[index % len(makers)](rng, largest) for index in range(count)]


def carried_fields_images() -> list[Atoms]:
    """Every carried field, on bulk, slab, molecule, 1-atom and left-handed cells.

    Different sizes; momenta, isotope masses, ``FixAtoms``, tags, initial
    charges, ``info["charge"]`` and ``info["spin"]``.
    """
    from ase.build import molecule
    from ase.constraints import FixAtoms

    crystal = thermalize(rattled_bulk(repeat=2), 50.0, seed=1)
    masses = crystal.get_masses()
    masses[::3] = 36.0  # an isotope
    crystal.set_masses(masses)
    crystal.set_constraint(FixAtoms(indices=[0, 5]))
    crystal.info["charge"] = -1
    surface = slab()
    surface.set_tags(np.arange(len(surface)) % 3)
    surface.set_initial_charges(np.linspace(-0.5, 0.5, len(surface)))
    mol = molecule("CH3CH2OH")
    mol.info["spin"] = 2
    mol.info["charge"] = 1
    thermalize(mol, 300.0, seed=2)
    return [crystal, surface, mol, CATALOGUE["one_atom"](), CATALOGUE["left_handed"]()]
