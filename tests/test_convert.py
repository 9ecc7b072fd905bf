"""The Atoms <-> Batch adapter: lossless, vectorised, validated."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from ase import Atoms, units
from ase.build import molecule
from ase.calculators.singlepoint import SinglePointCalculator
from ase.constraints import FixAtoms, FixBondLength

import nvalchemi_ase.convert as convert_module
from nvalchemi_ase._compat import frozen_category
from nvalchemi_ase.convert import (
    FROZEN_CATEGORY,
    NotCarriedWarning,
    StructureError,
    atoms_to_batch,
    batch_to_atoms,
    update_atoms,
)
from tests.helpers import assert_same_snapshot, snapshot
from tests.structures import (
    CATALOGUE,
    carried_fields_images,
    cluster,
    rattled_bulk,
    slab,
    thermalize,
)


def test_round_trip_keeps_every_carried_field():
    images = carried_fields_images()
    back = batch_to_atoms(atoms_to_batch(images, device="cpu"))
    assert len(back) == len(images)
    for original, restored in zip(images, back, strict=True):
        np.testing.assert_array_equal(restored.numbers, original.numbers)
        np.testing.assert_allclose(
            restored.positions, original.positions, rtol=0, atol=1e-14
        )
        np.testing.assert_allclose(restored.cell.array, original.cell.array, atol=1e-14)
        np.testing.assert_array_equal(restored.pbc, original.pbc)
        np.testing.assert_allclose(
            restored.get_masses(), original.get_masses(), rtol=1e-15
        )
        assert ("masses" in restored.arrays) == ("masses" in original.arrays)
        np.testing.assert_allclose(
            restored.get_momenta(), original.get_momenta(), rtol=1e-13, atol=1e-15
        )
        assert ("momenta" in restored.arrays) == ("momenta" in original.arrays)
        np.testing.assert_allclose(
            restored.get_initial_charges(), original.get_initial_charges(), atol=1e-15
        )
        np.testing.assert_array_equal(restored.get_tags(), original.get_tags())
        for key in ("charge", "spin"):
            assert restored.info.get(key, 0) == original.info.get(key, 0)
        assert [c.todict() for c in restored.constraints] == [
            c.todict() for c in original.constraints
        ]


def test_conversion_does_not_modify_inputs():
    images = carried_fields_images()
    before = [snapshot(atoms) for atoms in images]
    atoms_to_batch(images, device="cpu")
    for snap, atoms in zip(before, images, strict=True):
        assert_same_snapshot(snap, atoms)


def test_fields_equal_nvalchemis_own_from_atoms_path():
    from nvalchemi.data import AtomicData, Batch

    images = [rattled_bulk(repeat=2), CATALOGUE["triclinic"](), CATALOGUE["one_atom"]()]
    ours = atoms_to_batch(images, device="cpu", dtype=torch.float64)
    theirs = Batch.from_data_list(
        [AtomicData.from_atoms(a, dtype=torch.float64) for a in images]
    )
    for key in (
        "positions",
        "atomic_numbers",
        "atomic_masses",
        "cell",
        "pbc",
        "atom_categories",
        "velocities",
    ):
        assert ours[key].dtype == theirs[key].dtype, key
        torch.testing.assert_close(ours[key], theirs[key], rtol=0, atol=0, msg=key)
    torch.testing.assert_close(ours.batch_ptr, theirs.batch_ptr)
    torch.testing.assert_close(ours.batch_idx, theirs.batch_idx)


def test_batch_layout_and_dtype():
    images = [rattled_bulk(repeat=2), cluster()]
    batch = atoms_to_batch(images, device="cpu", dtype="float32")
    assert batch.num_graphs == 2
    assert batch.num_nodes == sum(map(len, images))
    assert batch.positions.dtype == torch.float32
    assert batch.cell.shape == (2, 3, 3)
    assert batch.pbc.tolist() == [[True] * 3, [False] * 3]
    assert batch.atomic_numbers.dtype == torch.int32
    assert batch.positions.device.type == "cpu"


def test_single_atoms_becomes_one_graph():
    batch = atoms_to_batch(rattled_bulk(repeat=2), device="cpu")
    assert batch.num_graphs == 1


def test_padding_vectors_are_orthogonal_right_handed_and_removed_on_return():
    wire = Atoms(
        "Ar3",
        positions=[[0, 0, 0], [0.1, 0.2, 3.7], [0.3, -0.2, 7.4]],
        cell=[0, 0, 11.1],
        pbc=[False, False, True],
    )
    images = [slab(), cluster(), wire]
    batch = atoms_to_batch(images, device="cpu")
    cells = batch.cell.numpy()
    padding = batch.cell_padding.numpy()
    assert padding.tolist() == [[False, False, True], [True] * 3, [True, True, False]]
    for cell, pad in zip(cells, padding, strict=True):
        assert np.linalg.det(cell) > 0
        for k in np.flatnonzero(pad):
            for j in range(3):
                if j != k:
                    assert abs(cell[k] @ cell[j]) < 1e-9 * np.linalg.norm(cell[j]) ** 2
    for original, restored in zip(images, batch_to_atoms(batch), strict=True):
        np.testing.assert_array_equal(restored.cell.array, original.cell.array)


def test_velocities_are_angstrom_per_ase_time_for_nvalchemis_integrator():
    """Free atoms (beyond the cutoff) move by v * timestep under nvalchemi's NVE."""
    from nvalchemi.dynamics import NVE

    from nvalchemi_ase.dynamics.neighbors import neighbor_hooks
    from nvalchemi_ase.models import load_model
    from nvalchemi_ase.units import ase_time_to_fs

    atoms = Atoms("Ar2", positions=[[0, 0, 0], [30.0, 0, 0]])
    atoms.set_momenta([[4.0, -1.0, 0.5], [-2.0, 3.0, 1.0]])
    timestep = 1.5 * units.fs
    model = load_model("lj").to(dtype=torch.float64)
    batch = atoms_to_batch(atoms, device="cpu")
    # the eager list hook: nvalchemi's own (model.make_neighbor_hooks()) is
    # torch.compile'd, tens of seconds on a CPU for the same list
    hooks = neighbor_hooks(model, skin=1.0)
    engine = NVE(model, dt=ase_time_to_fs(timestep), hooks=hooks)
    engine.run(batch, n_steps=1)
    moved = batch.positions.numpy() - atoms.positions
    np.testing.assert_allclose(moved, atoms.get_velocities() * timestep, rtol=1e-12)


def test_update_atoms_writes_state_and_results_in_place():
    images = [rattled_bulk(repeat=2), cluster()]
    batch = atoms_to_batch(images, device="cpu")
    batch.positions += 0.01
    batch.velocities[:] = 0.02
    batch.cell[0] *= 1.01
    batch.energy = torch.tensor([[-1.0], [-2.0]], dtype=torch.float64)
    batch.forces = torch.full((batch.num_nodes, 3), 0.5, dtype=torch.float64)
    batch.stress = torch.eye(3, dtype=torch.float64).expand(2, 3, 3).clone()
    old_positions = [a.positions.copy() for a in images]
    update_atoms(images, batch)
    for atoms, old in zip(images, old_positions, strict=True):
        np.testing.assert_allclose(atoms.positions, old + 0.01, atol=1e-14)
        np.testing.assert_allclose(atoms.get_velocities(), 0.02, rtol=1e-14)
        assert isinstance(atoms.calc, SinglePointCalculator)
        np.testing.assert_array_equal(atoms.get_forces(), 0.5)
    assert images[0].get_potential_energy() == -1.0
    np.testing.assert_allclose(images[0].cell.array, 1.01 * 2 * 5.26 * np.eye(3))
    np.testing.assert_allclose(images[0].get_stress(), [1, 1, 1, 0, 0, 0])
    np.testing.assert_array_equal(images[1].cell.array, 0.0)  # padding not written


def test_update_atoms_rejects_a_different_list_without_writing():
    images = [rattled_bulk(repeat=2), cluster()]
    batch = atoms_to_batch(images, device="cpu")
    wrong = [images[1], images[0]]
    before = [snapshot(a) for a in wrong]
    with pytest.raises(ValueError, match=r"images\[0\] has 55 atoms but graph 0"):
        update_atoms(wrong, batch)
    for snap, atoms in zip(before, wrong, strict=True):
        assert_same_snapshot(snap, atoms)


def test_batch_to_atoms_attaches_results_with_stress_only_for_full_cells():
    images = [rattled_bulk(repeat=2), slab()]
    batch = atoms_to_batch(images, device="cpu")
    batch.energy = torch.tensor([[-3.0], [-4.0]], dtype=torch.float64)
    batch.forces = torch.zeros(batch.num_nodes, 3, dtype=torch.float64)
    batch.stress = torch.zeros(2, 3, 3, dtype=torch.float64)
    bulk_back, slab_back = batch_to_atoms(batch)
    assert bulk_back.get_potential_energy() == -3.0
    assert bulk_back.get_stress().shape == (6,)
    assert slab_back.get_potential_energy() == -4.0
    assert "stress" not in slab_back.calc.results


def test_ghost_atoms_round_trip_with_ases_mass():
    """ASE's ghost atom X (Z = 0, 1.0 amu) is carried; which models take it is
    the model check's business (tests/test_ase_suite_leftovers.py)."""
    ghosts = thermalize(rattled_bulk(repeat=2), 50.0, seed=3)
    ghosts.numbers[::4] = 0
    images = [rattled_bulk(repeat=1), ghosts, Atoms("X", positions=[[0, 0, 0]])]
    before = [snapshot(atoms) for atoms in images]
    batch = atoms_to_batch(images, device="cpu")
    np.testing.assert_array_equal(
        batch.atomic_numbers.numpy(), np.concatenate([a.numbers for a in images])
    )
    np.testing.assert_array_equal(
        batch.atomic_masses.numpy(), np.concatenate([a.get_masses() for a in images])
    )
    for original, restored in zip(images, batch_to_atoms(batch), strict=True):
        np.testing.assert_array_equal(restored.numbers, original.numbers)
        np.testing.assert_array_equal(restored.get_masses(), original.get_masses())
        assert "masses" not in restored.arrays
        np.testing.assert_allclose(
            restored.get_momenta(), original.get_momenta(), rtol=1e-13, atol=1e-15
        )
    for snap, atoms in zip(before, images, strict=True):
        assert_same_snapshot(snap, atoms)


@pytest.mark.parametrize(
    ("make", "field", "pattern"),
    [
        (
            lambda a: a.positions.__setitem__((3, 1), np.nan),
            "positions[3]",
            "not finite",
        ),
        (
            lambda a: a.positions.__setitem__((2, 0), np.inf),
            "positions[2]",
            "not finite",
        ),
        (lambda a: a.numbers.__setitem__(1, -1), "numbers[1]", "outside 0-118"),
        (lambda a: a.numbers.__setitem__(4, 119), "numbers[4]", "outside 0-118"),
        (lambda a: a.cell.__setitem__(2, 0.0), "cell", "periodic .* zero"),
        (lambda a: a.set_masses(-np.ones(len(a))), "masses[0]", "not positive"),
        (
            lambda a: a.info.__setitem__("charge", "neutral"),
            'info["charge"]',
            "not a number",
        ),
    ],
)
def test_bad_input_names_structure_field_and_fix_and_mutates_nothing(
    make, field, pattern
):
    good = rattled_bulk(repeat=2)
    bad = rattled_bulk(repeat=2, seed=9)
    make(bad)
    images = [good, bad]
    before = [snapshot(a) for a in images]
    with pytest.raises(StructureError) as info:
        atoms_to_batch(images, device="cpu")
    message = str(info.value)
    assert message.startswith(f"images[1].{field}:")
    assert pattern.split(" ")[0] in message
    assert ";" in message  # a fix follows the problem
    assert info.value.index == 1
    for snap, atoms in zip(before, images, strict=True):
        assert_same_snapshot(snap, atoms)


def test_empty_structure_and_empty_list_and_wrong_type():
    with pytest.raises(
        StructureError, match=r"images\[1\]\.numbers: the structure has no atoms"
    ):
        atoms_to_batch([cluster(), Atoms()], device="cpu")
    with pytest.raises(ValueError, match="images is empty"):
        atoms_to_batch([], device="cpu")
    with pytest.raises(TypeError, match=r"images\[0\] is a str"):
        atoms_to_batch(["Ar"], device="cpu")


def test_fields_that_cannot_be_carried_warn_once_per_key():
    atoms = cluster()
    atoms.info["mood"] = "happy"
    atoms.set_initial_magnetic_moments(np.ones(len(atoms)))
    atoms.set_constraint(FixBondLength(0, 1))
    with pytest.warns(NotCarriedWarning) as record:
        atoms_to_batch([atoms, atoms.copy()], device="cpu")
    messages = sorted(str(w.message).split(" has ")[0] for w in record)
    assert messages == [
        'arrays["initial_magmoms"]',
        "constraint FixBondLengths",
        'info["mood"]',
    ]
    # Python's default action shows each message once per call site (the
    # warnings registry); the package keeps no warn-once state of its own.
    with warnings.catch_warnings(record=True) as repeated:
        warnings.simplefilter("default")
        for _ in range(3):
            atoms_to_batch(atoms, device="cpu")
    assert len([w for w in repeated if w.category is NotCarriedWarning]) == 3
    assert not hasattr(convert_module, "_warned_keys")


def test_frozen_atoms_become_nvalchemis_frozen_category():
    atoms = rattled_bulk(repeat=2)
    atoms.set_constraint(FixAtoms(mask=atoms.positions[:, 2] < 2.0))
    batch = atoms_to_batch(atoms, device="cpu")
    frozen = (batch.atom_categories == FROZEN_CATEGORY).numpy()
    np.testing.assert_array_equal(frozen, atoms.positions[:, 2] < 2.0)
    assert frozen_category() == FROZEN_CATEGORY  # the one nvalchemi freezes


def test_ten_thousand_structures_convert_in_one_pass():
    images = [molecule("H2O") for _ in range(10_000)]
    for index in (0, 4_321, 9_999):
        images[index].positions += index
    batch = atoms_to_batch(images, device="cpu")
    assert batch.num_graphs == 10_000
    assert batch.num_nodes == 30_000
    back = batch_to_atoms(batch)
    for index in (0, 4_321, 9_999):
        np.testing.assert_allclose(back[index].positions, images[index].positions)
