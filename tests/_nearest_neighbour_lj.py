"""Argon Lennard-Jones cut between the first and second neighbour shells of fcc.

With only nearest-neighbour bonds, surface and vacancy energies are bond counts
times the pair energy at the nearest-neighbour distance, exactly: the analytic
references of the surface, adsorption and defect tests.
"""

from __future__ import annotations

import numpy as np

from tests.structures import A_AR

EPSILON, SIGMA = 0.0104, 3.40  # eV, Å (the "lj" defaults)
#: Between the fcc shells at a/√2 = 3.72 Å and a = 5.26 Å.
NN_CUTOFF = 4.5


def pair_energy(r: float) -> float:
    """Unshifted LJ pair energy at distance ``r`` Å, eV (the model's form)."""
    return 4 * EPSILON * ((SIGMA / r) ** 12 - (SIGMA / r) ** 6)


#: One nearest-neighbour bond of fcc argon at A_AR, eV (negative).
BOND = pair_energy(A_AR / np.sqrt(2))


def nn_calculator():
    """float64 CPU calculator of the nearest-neighbour LJ model."""
    from nvalchemi_ase import NVAlchemiCalculator
    from nvalchemi_ase.models.builtin import lennard_jones

    return NVAlchemiCalculator(
        lennard_jones(cutoff=NN_CUTOFF), device="cpu", dtype="float64"
    )
