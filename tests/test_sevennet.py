"""SevenNet-0 as a batched nvalchemi model, against sevenn's own ASE calculator.

The reference is ``sevenn.calculator.SevenNetCalculator('7net-0')`` evaluating
each structure alone (its own matscipy neighbour list, its own force/stress
code); ours evaluates the whole mixed batch in one forward pass on nvalchemi's
neighbour list. Finite differences check forces and stress independently.
"""

from __future__ import annotations

import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
from ase import Atoms, units
from ase.build import bulk, fcc111, molecule
from ase.calculators.fd import calculate_numerical_forces, calculate_numerical_stress

pytest.importorskip("sevenn")

from nvalchemi_ase import NVAlchemiCalculator
from nvalchemi_ase._quiet import import_quietly
from nvalchemi_ase.convert import atoms_to_batch
from nvalchemi_ase.md import VelocityVerlet
from nvalchemi_ase.models import load_model, model_native_dtype
from nvalchemi_ase.models.sevennet import SEVENNET_0_CUTOFF
from nvalchemi_ase.optimize import FIRE
from tests._tolerances import (
    FD_FORCE_ATOL,
    FD_STEP,
    FD_STRAIN,
    FD_STRESS_ATOL,
)

# Batched float32 model vs sevenn's calculator on one structure (both run
# SevenNet's float32 weights in float32: float32 round-off of sums over edges).
ENERGY_RTOL = 1e-5
FORCE_ATOL = 1e-4  # eV/Å
STRESS_ATOL = 1e-5  # eV/Å³
# Two neighbour lists (cutoff vs cutoff + skin) in float64: round-off only.
SKIN = 1.0  # Å
SKIN_ENERGY_RTOL = 1e-12
SKIN_FORCE_ATOL = 1e-10  # eV/Å
SKIN_STRESS_ATOL = 1e-12  # eV/Å³
# Smoke runs on a batch of two rattled 8-atom crystals.
MD_STEPS = 5
FIRE_STEPS = 8


def _rattled(atoms: Atoms, stdev: float, seed: int) -> Atoms:
    atoms.rattle(stdev, seed=seed)
    return atoms


def _triclinic() -> Atoms:
    """SiGe in a sheared primitive diamond cell: no right angle, two elements."""
    atoms = bulk("Si", "diamond", a=5.43).repeat((2, 2, 2))
    atoms.symbols[::4] = "Ge"
    strain = np.array([[1.02, 0.05, -0.03], [0.00, 0.98, 0.04], [0.02, 0.00, 1.01]])
    atoms.set_cell(atoms.cell.array @ strain, scale_atoms=True)
    return _rattled(atoms, 0.04, seed=3)


def _slab() -> Atoms:
    atoms = fcc111("Cu", size=(3, 3, 4), vacuum=7.0)  # pbc (T, T, F)
    return _rattled(atoms, 0.03, seed=4)


def _molecule_in_box() -> Atoms:
    atoms = molecule("CH3CH2OH")
    atoms.center(vacuum=5.0)
    atoms.pbc = False
    return _rattled(atoms, 0.02, seed=5)


def _molecule_without_cell() -> Atoms:
    return _rattled(molecule("H2O"), 0.02, seed=6)


# name -> builder; sizes 1 to 200 atoms, periodic and not, mixed in one batch.
STRUCTURES = {
    "Cu_primitive": lambda: bulk("Cu", "fcc", a=3.61),  # 1 atom: only self-images
    "Si_diamond": lambda: _rattled(bulk("Si", "diamond", a=5.43, cubic=True), 0.05, 1),
    "NaCl_rocksalt": lambda: _rattled(
        bulk("NaCl", "rocksalt", a=5.64, cubic=True).repeat(2), 0.05, 2
    ),
    "MgO_rocksalt": lambda: _rattled(
        bulk("MgO", "rocksalt", a=4.21, cubic=True).repeat((2, 1, 1)), 0.05, 7
    ),
    "Cu_fcc_200": lambda: _rattled(
        bulk("Cu", "fcc", a=3.61, cubic=True).repeat((5, 5, 2)), 0.05, 8
    ),
    "SiGe_triclinic": _triclinic,
    "Cu111_slab": _slab,
    "ethanol_in_box": _molecule_in_box,
    "water_no_cell": _molecule_without_cell,
}
NO_STRESS = {"water_no_cell"}  # cell of rank < 3: ASE defines no stress


@pytest.fixture(scope="module")
def model():
    return load_model("sevennet-0")


@pytest.fixture(scope="module")
def calc32(model):
    return NVAlchemiCalculator(model, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def model64():
    """A second instance: calculators move their model to their dtype."""
    return load_model("sevennet-0").to(dtype=torch.float64)


@pytest.fixture(scope="module")
def calc64(model64):
    return NVAlchemiCalculator(model64, device="cpu", dtype="float64")


@pytest.fixture(scope="module")
def reference():
    from sevenn.calculator import SevenNetCalculator

    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="No tensor product accelerator", category=UserWarning
        )
        return SevenNetCalculator("7net-0", device="cpu")


@pytest.fixture(scope="module")
def mixed_batch_results(calc32):
    images = {name: build() for name, build in STRUCTURES.items()}
    results = calc32.calculate_batch(
        list(images.values()), ["energy", "forces", "stress"]
    )
    return dict(zip(images, results, strict=True))


def _reference_results(atoms: Atoms, reference) -> dict:
    atoms = atoms.copy()
    reference.calculate(atoms, ["energy", "forces", "stress"])
    return reference.results


@pytest.mark.slow  # the batch holds 200 atoms; sevenn's calculator runs each alone
@pytest.mark.parametrize("name", list(STRUCTURES))
def test_each_structure_of_a_mixed_batch_equals_sevenn_alone(
    name, mixed_batch_results, reference
):
    ours = mixed_batch_results[name]
    theirs = _reference_results(STRUCTURES[name](), reference)
    assert ours["energy"] == pytest.approx(theirs["energy"], rel=ENERGY_RTOL, abs=0)
    np.testing.assert_allclose(
        ours["forces"], theirs["forces"], rtol=0, atol=FORCE_ATOL
    )
    if name in NO_STRESS:
        assert "stress" not in ours
    else:
        np.testing.assert_allclose(
            ours["stress"], theirs["stress"], rtol=0, atol=STRESS_ATOL
        )


@pytest.mark.slow
def test_the_mixed_batch_is_not_trivial(mixed_batch_results):
    sizes = [len(STRUCTURES[name]()) for name in STRUCTURES]
    assert min(sizes) == 1
    assert max(sizes) == 200
    forces = np.concatenate([r["forces"] for r in mixed_batch_results.values()])
    assert np.abs(forces).max() > 0.5  # rattled: real forces to compare
    stresses = [r["stress"] for r in mixed_batch_results.values() if "stress" in r]
    assert np.abs(stresses).max() > 1e-3  # and real stresses


# structure -> atoms whose forces are differentiated (6 evaluations each)
FD_ATOMS = {
    "SiGe_triclinic": [0, 5],  # a Ge and a Si
    "Cu111_slab": [0, 35],  # bottom and top layer
    "ethanol_in_box": [0, 2, 5],  # C, O, H
}


@pytest.mark.slow  # 6 float64 model calls per atom
@pytest.mark.parametrize("name", list(FD_ATOMS))
def test_float64_forces_match_finite_differences(name, calc64):
    atoms = STRUCTURES[name]()
    atoms.calc = calc64
    checked = FD_ATOMS[name]
    numerical = calculate_numerical_forces(atoms, eps=FD_STEP, iatoms=checked)
    assert np.abs(numerical).max() > 0.1
    np.testing.assert_allclose(
        atoms.get_forces()[checked],
        numerical,
        rtol=0,
        atol=FD_FORCE_ATOL[torch.float64],
    )


@pytest.mark.slow  # 12 float64 model calls
def test_float64_stress_matches_finite_differences(calc64):
    atoms = _triclinic()
    atoms.calc = calc64
    numerical = calculate_numerical_stress(atoms, eps=FD_STRAIN)
    assert np.abs(numerical).max() > 1e-3
    np.testing.assert_allclose(
        atoms.get_stress(), numerical, rtol=0, atol=FD_STRESS_ATOL[torch.float64]
    )


def _evaluate_with_list_cutoff(model, atoms_list, list_cutoff):
    base = import_quietly("nvalchemi.models.base")
    neighbors = import_quietly("nvalchemi.neighbors")
    batch = atoms_to_batch(atoms_list, device="cpu", dtype=torch.float64)
    neighbors.compute_neighbors(batch, config=base.NeighborConfig(cutoff=list_cutoff))
    n_pairs = batch.neighbor_list.shape[0]
    with model.narrowed_outputs({"energy", "forces", "stress"}):
        outputs = model(batch)
    return n_pairs, {key: value.detach().numpy() for key, value in outputs.items()}


@pytest.mark.slow  # loads a second, float64 model
def test_results_do_not_depend_on_the_neighbour_list_skin(model64):
    images = [STRUCTURES["SiGe_triclinic"](), STRUCTURES["ethanol_in_box"]()]
    pairs, exact = _evaluate_with_list_cutoff(model64, images, SEVENNET_0_CUTOFF)
    pairs_skin, skinned = _evaluate_with_list_cutoff(
        model64, images, SEVENNET_0_CUTOFF + SKIN
    )
    assert pairs_skin > pairs * 1.2  # the skin really added pairs to drop
    np.testing.assert_allclose(
        skinned["energy"], exact["energy"], rtol=SKIN_ENERGY_RTOL, atol=0
    )
    np.testing.assert_allclose(
        skinned["forces"], exact["forces"], rtol=0, atol=SKIN_FORCE_ATOL
    )
    np.testing.assert_allclose(
        skinned["stress"], exact["stress"], rtol=0, atol=SKIN_STRESS_ATOL
    )


def test_a_list_shorter_than_the_cutoff_is_refused(model):
    batch = atoms_to_batch([STRUCTURES["Si_diamond"]()], device="cpu")
    base = import_quietly("nvalchemi.models.base")
    import_quietly("nvalchemi.neighbors").compute_neighbors(
        batch, config=base.NeighborConfig(cutoff=SEVENNET_0_CUTOFF - 1.0)
    )
    with pytest.raises(ValueError, match=r"at least 5\.0"):
        model(batch)


def test_stress_only_when_asked(model):
    batch = atoms_to_batch([STRUCTURES["Si_diamond"]()], device="cpu")
    import_quietly("nvalchemi.neighbors").compute_neighbors(
        batch, config=model.model_config.neighbor_config
    )
    assert model.model_config.active_outputs == {"energy", "forces"}
    assert set(model(batch)) == {"energy", "forces"}
    with model.narrowed_outputs({"energy"}):
        assert set(model(batch)) == {"energy"}
    with model.narrowed_outputs({"energy", "forces", "stress"}):
        outputs = model(batch)
    assert outputs["stress"].shape == (1, 3, 3)
    assert outputs["energy"].shape == (1, 1)
    assert outputs["forces"].shape == (8, 3)


@pytest.mark.slow
def test_follows_dtype_float32_native(model, model64, calc32, calc64):
    assert model_native_dtype(model) == torch.float32
    assert model_native_dtype(model64) == torch.float64
    atoms = STRUCTURES["NaCl_rocksalt"]()
    e32 = calc32.calculate_batch([atoms])[0]["energy"]
    e64 = calc64.calculate_batch([atoms])[0]["energy"]
    assert e64 == pytest.approx(e32, rel=ENERGY_RTOL)
    assert e64 != e32  # really evaluated in two precisions


def test_unknown_element_is_named(calc32):
    polonium = Atoms("Po2", positions=[[0, 0, 0], [0, 0, 2.6]])
    positions = polonium.positions.copy()
    with pytest.raises(ValueError, match=r"images\[0\].*Po, Z = 84"):
        calc32.calculate_batch([polonium])
    assert np.array_equal(polonium.positions, positions)


@pytest.mark.slow  # loads the weights a second time
def test_both_names_load_the_same_weights(model):
    alias = load_model("7net-0")
    assert model_native_dtype(alias) == torch.float32  # SevenNet's native precision
    for ours, theirs in zip(
        model.state_dict().values(), alias.state_dict().values(), strict=True
    ):
        assert torch.equal(ours, theirs)


def test_missing_sevenn_names_the_extra(monkeypatch):
    from nvalchemi_ase.models import sevennet

    monkeypatch.setitem(sys.modules, "sevenn.checkpoint", None)
    with pytest.raises(ImportError, match=r'pip install "nvalchemi-ase\[sevennet\]"'):
        sevennet.sevennet_0()


@pytest.mark.slow  # a fresh interpreter imports torch, nvalchemi and sevenn
def test_loading_and_evaluating_print_nothing_and_change_no_global_state():
    code = """
import sys, warnings, torch
warnings.simplefilter("error", UserWarning)
filters, threads = list(warnings.filters), torch.get_num_threads()
import nvalchemi_ase.models
assert "sevenn" not in sys.modules and "nvalchemi" not in sys.modules, "not lazy"
from ase.build import bulk
from nvalchemi_ase import NVAlchemiCalculator
atoms = bulk("Si", "diamond", a=5.43)
atoms.calc = NVAlchemiCalculator("sevennet-0", device="cpu")
atoms.get_forces()
assert [f for f in warnings.filters if f in filters] == filters
assert torch.get_default_dtype() == torch.float32
assert torch.get_num_threads() == threads
"""
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""


def _small_batch() -> list[Atoms]:
    return [
        _rattled(bulk("Si", "diamond", a=5.43, cubic=True), 0.1, seed=11),
        _rattled(bulk("MgO", "rocksalt", a=4.21, cubic=True), 0.1, seed=12),
    ]


@pytest.mark.slow
def test_velocity_verlet_runs(model):
    images = _small_batch()
    for atoms in images:
        atoms.set_momenta(np.zeros((len(atoms), 3)))
    dyn = VelocityVerlet(images, 1.0 * units.fs, model=model, dtype="float32")
    assert dyn.run(MD_STEPS)
    for atoms in images:
        energy = atoms.get_potential_energy()
        assert np.isfinite(energy)
        assert np.isfinite(atoms.get_forces()).all()
        assert np.abs(atoms.get_momenta()).max() > 0  # the forces moved the atoms


@pytest.mark.slow
def test_fire_lowers_forces(model):
    images = _small_batch()
    start = [
        np.linalg.norm(result["forces"], axis=1).max()
        for result in NVAlchemiCalculator(model, device="cpu").calculate_batch(images)
    ]
    opt = FIRE(images, logfile=None, model=model, dtype="float32")
    opt.run(fmax=1e-3, steps=FIRE_STEPS)
    for atoms, fmax_start in zip(images, start, strict=True):
        assert np.isfinite(atoms.get_potential_energy())
        assert np.linalg.norm(atoms.get_forces(), axis=1).max() < 0.5 * fmax_start


def test_column_slice_merging_keeps_values_and_gradients():
    from nvalchemi_ase.models.sevennet.speed import merge_column_slices

    class Toy(torch.nn.Module):
        def forward(self, x1, x2, w):
            a, b, c = w[:, 0:3], w[:, 3:4], w[:, 6:8]  # a gap and an unused tail
            return (a * x1[:, 0:3]).sum(1) + b[:, 0] * c.prod(1) + x2[:, 1:2].sum(1)

    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self._compiled_main_left_right = torch.fx.symbolic_trace(Toy())

    holder = Holder()
    generator = torch.Generator().manual_seed(0)
    inputs = [
        torch.randn(5, n, generator=generator, dtype=torch.float64) for n in (4, 2, 9)
    ]
    before = [t.clone().requires_grad_(True) for t in inputs]
    after = [t.clone().requires_grad_(True) for t in inputs]
    expected = holder._compiled_main_left_right(*before)
    expected.sum().backward()
    assert merge_column_slices(holder) == 3  # w's cuts; single cuts are left alone
    result = holder._compiled_main_left_right(*after)
    result.sum().backward()
    torch.testing.assert_close(result, expected, rtol=0, atol=0)
    for ours, theirs in zip(after, before, strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=0, atol=0)


def test_the_slice_merging_applies_to_sevennet(model):
    from nvalchemi_ase.models.sevennet.speed import split_columns

    rewritten = [
        node
        for layer in model.network.children()
        if type(layer).__name__ == "IrrepsConvolution"
        for node in layer.convolution._compiled_main_left_right.graph.nodes
        if node.target is split_columns
    ]
    assert len(rewritten) >= 5  # at least the path weights of every convolution
