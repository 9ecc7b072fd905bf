"""SevenNet-0 on real crystals: lattice constants, B and C_ij within loose bounds.

A smoke check of the whole chain on a universal potential (no hard-coded
expected numbers: the bounds are wide ranges around experiment and PBE, which
SevenNet-0 was trained on). The numbers are printed (``pytest -s``).
"""

from __future__ import annotations

import importlib.util

import pytest
from ase.build import bulk

from nvalchemi_ase.properties import elastic_constants, equation_of_state

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("sevenn") is None, reason="needs sevenn"
    ),
]

# (builder of the primitive cell, bounds: a0 Å, B GPa, C11, C12, C44 GPa).
# Experiment / PBE: Si 5.43/5.47 Å, B 98/88, C 166 64 80; Cu 3.61/3.63, B 140,
# C 170 123 76; NaCl 5.64/5.70, B 24, C 49 13 13; MgO 4.21/4.25, B 160,
# C 297 95 155 (PBE softer).
CRYSTALS = {
    "Si": (
        lambda: bulk("Si", "diamond", a=5.43),
        {"a0": (5.3, 5.6), "B": (70, 120), "C11": (120, 200), "C12": (40, 90),
         "C44": (40, 100)},
    ),
    "Cu": (
        lambda: bulk("Cu", "fcc", a=3.61),
        {"a0": (3.5, 3.75), "B": (100, 180), "C11": (130, 230), "C12": (90, 170),
         "C44": (30, 100)},
    ),
    "NaCl": (
        lambda: bulk("NaCl", "rocksalt", a=5.64),
        {"a0": (5.5, 5.85), "B": (15, 35), "C11": (30, 70), "C12": (5, 25),
         "C44": (5, 20)},
    ),
    "MgO": (
        lambda: bulk("MgO", "rocksalt", a=4.21),
        {"a0": (4.1, 4.35), "B": (110, 200), "C11": (180, 340), "C12": (50, 130),
         "C44": (70, 180)},
    ),
}  # fmt: skip


def _within(name, quantity, value, bounds):
    low, high = bounds[quantity]
    assert low <= value <= high, f"{name} {quantity} = {value:.3f} not in {bounds}"


def test_lattice_constants_bulk_moduli_and_elastic_constants():
    names = list(CRYSTALS)
    primitive = [CRYSTALS[name][0]() for name in names]
    # EOS of the primitive cells (fcc lattices: V_conventional = 4 V_primitive)
    eos = equation_of_state(primitive, "sevennet-0", device="cpu")
    at_minimum = []
    for name, atoms, result in zip(names, primitive, eos, strict=True):
        assert result.ok, f"{name}: {result.error}"
        at_minimum.append(atoms.copy())
        at_minimum[-1].set_cell(result.cell0, scale_atoms=True)  # zero pressure
    # elastic constants at V0 (cubic: the scaled cell is at zero stress), ions
    # relaxed in every strained cell (Si's internal strain)
    elastic = elastic_constants(
        at_minimum, "sevennet-0", device="cpu", n_strains=2, fmax=5e-3
    )
    for name, fit, result in zip(names, eos, elastic, strict=True):
        assert result.ok, f"{name}: {result.error}"
        bounds = CRYSTALS[name][1]
        a0 = (4.0 * fit.v0) ** (1.0 / 3.0)
        stiffness = result.C
        print(  # noqa: T201 - the numbers are the point of a smoke test
            f"SevenNet-0 {name}: a0 {a0:.4f} Å, B(EOS) {fit.B:.1f} GPa, "
            f"C11 {stiffness[0, 0]:.1f}, C12 {stiffness[0, 1]:.1f}, "
            f"C44 {stiffness[3, 3]:.1f}, K_VRH {result.bulk_hill:.1f}, "
            f"G_VRH {result.shear_hill:.1f} GPa; |stress0| max "
            f"{abs(result.stress0).max():.3f} GPa"
        )
        _within(name, "a0", a0, bounds)
        _within(name, "B", fit.B, bounds)
        _within(name, "C11", stiffness[0, 0], bounds)
        _within(name, "C12", stiffness[0, 1], bounds)
        _within(name, "C44", stiffness[3, 3], bounds)
        # cubic symmetry holds to float32 noise
        assert abs(stiffness[1, 1] - stiffness[0, 0]) < 0.02 * stiffness[0, 0]
        assert abs(stiffness[5, 5] - stiffness[3, 3]) < 0.02 * stiffness[0, 0]
        # K from C agrees with the EOS's B (different strains, anharmonicity)
        assert result.bulk_hill == pytest.approx(fit.B, rel=0.2)
        assert abs(result.stress0).max() < 0.5  # V0 is (nearly) stress-free
