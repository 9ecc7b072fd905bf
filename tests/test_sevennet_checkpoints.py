"""Every SevenNet checkpoint of the sevenn wheel, against sevenn's own calculator.

SevenNet-0 itself is checked in ``tests/test_sevennet.py``; here the other three
(22 May 2024, l3i5, and MF-0 on each of its two fidelities) run one mixed batch
through our wrapper and each structure alone through
``sevenn.calculator.SevenNetCalculator`` reading the same file from the wheel
(its own neighbour list and force/stress code). Loading a checkpoint takes 5-15 s
on a CPU, so the comparisons are marked slow.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from ase import Atoms
from ase.build import bulk, fcc111, molecule

pytest.importorskip("sevenn")

from nvalchemi_ase import NVAlchemiCalculator
from nvalchemi_ase.models import load_model, registry, supported_elements
from nvalchemi_ase.models.sevennet import loading

# Both run the float32 weights in float32 (as tests/test_sevennet.py).
ENERGY_RTOL = 1e-5
FORCE_ATOL = 1e-4  # eV/Å
STRESS_ATOL = 1e-5  # eV/Å³

# name for load_model -> (checkpoint in loading.CHECKPOINTS, sevenn's modal or None)
CASES = {
    "sevennet-0-22may2024": ("sevennet-0-22may2024", None),
    "sevennet-l3i5": ("sevennet-l3i5", None),
    "sevennet-mf-0-pbe": ("sevennet-mf-0", "PBE"),
    "sevennet-mf-0-r2scan": ("sevennet-mf-0", "R2SCAN"),
}


def _images() -> list[Atoms]:
    ethanol = molecule("CH3CH2OH")
    ethanol.center(vacuum=4.0)
    silicon = bulk("Si", "diamond", a=5.43, cubic=True)
    salt = bulk("NaCl", "rocksalt", a=5.64, cubic=True)
    slab = fcc111("Cu", (2, 2, 3), vacuum=6.0)
    images = [ethanol, silicon, salt, slab, bulk("Cu", "fcc", a=3.61)]
    for seed, atoms in enumerate(images):
        atoms.rattle(0.04, seed=seed)
    return images


def _sevenn_calculator(checkpoint: str, modal: str | None):
    from sevenn.calculator import SevenNetCalculator

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sevenn's accelerator and jit notices
        with loading.quiet_sevenn():
            return SevenNetCalculator(
                loading.checkpoint_path(checkpoint), device="cpu", modal=modal
            )


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_batch_matches_sevenns_calculator(name):
    checkpoint, modal = CASES[name]
    model = load_model(name)
    assert len(supported_elements(model) or ()) == 89
    images = _images()
    ours = NVAlchemiCalculator(model, device="cpu", dtype="float32").calculate_batch(
        images, ["energy", "forces", "stress"]
    )
    reference = _sevenn_calculator(checkpoint, modal)
    for index, (atoms, mine) in enumerate(zip(images, ours, strict=True)):
        atoms = atoms.copy()
        atoms.calc = reference
        where = f"{name}: structure {index} ({atoms.get_chemical_formula()})"
        energy = atoms.get_potential_energy()
        assert mine["energy"] == pytest.approx(energy, rel=ENERGY_RTOL), where
        np.testing.assert_allclose(
            mine["forces"], atoms.get_forces(), rtol=0, atol=FORCE_ATOL, err_msg=where
        )
        if atoms.pbc.all():
            np.testing.assert_allclose(
                mine["stress"], atoms.get_stress(), rtol=0, atol=STRESS_ATOL
            )


@pytest.mark.slow
def test_the_two_fidelities_of_mf_0_differ_and_modal_names_agree():
    images = _images()[1:3]
    energies = {}
    for name, model in (
        ("pbe", load_model("sevennet-mf-0", modal="PBE")),
        ("r2scan", load_model("sevennet-mf-0-r2scan")),
    ):
        calc = NVAlchemiCalculator(model, device="cpu")
        energies[name] = [r["energy"] for r in calc.calculate_batch(images)]
    # r2SCAN and PBE total energies differ by eV per structure, not round-off
    assert np.abs(np.subtract(energies["pbe"], energies["r2scan"])).min() > 0.1


def test_mf_0_needs_a_known_modal_before_any_work():
    with pytest.raises(ValueError, match=r"choose modal= one of \['pbe', 'r2scan'\]"):
        load_model("sevennet-mf-0")
    with pytest.raises(ValueError, match=r"got 'hse'"):
        load_model("sevennet-mf-0", modal="hse")
    with pytest.raises(TypeError, match=r"unknown parameter\(s\) \['modal'\]"):
        load_model("sevennet-l3i5", modal="pbe")


def test_every_wheel_checkpoint_has_a_name_and_a_file():
    for name in loading.CHECKPOINTS:
        info = registry.lookup(name)
        assert info is not None, name
        assert info.extra == "sevennet"
        assert info.weights == "ship in the sevenn wheel"
        assert loading.checkpoint_path(name).endswith(".pth")
    for alias in ("7net-0_22May2024", "7net-l3i5", "7net-mf-0"):  # sevenn's names
        assert registry.lookup(alias) is not None, alias
