"""Neighbour lists a runner's working batch keeps: emptied rows, carried lists.

References: the same model on a list built from scratch for the same batch.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ase.build import bulk

from nvalchemi_ase import NVAlchemiCalculator
from nvalchemi_ase.convert import atoms_to_batch
from nvalchemi_ase.dynamics.neighbors import (
    carry_neighbor_lists,
    empty_neighbors,
    neighbor_hooks,
)

# Same float64 pairs, summed in another order at most.
FORCE_ATOL = 1e-12
SKIN = 1.0


@pytest.fixture(scope="module")
def model():
    return NVAlchemiCalculator("lj", device="cpu", dtype="float64").model


def _structures():
    """Argon cells of 4, 32, 8 and 108 atoms, rattled differently."""
    structures = []
    for seed, repeat in enumerate([(1, 1, 1), (2, 2, 2), (2, 1, 1), (3, 3, 3)]):
        atoms = bulk("Ar", "fcc", a=5.26, cubic=True) * repeat
        atoms.rattle(0.05, seed=seed)
        structures.append(atoms)
    return structures


class _Context:
    def __init__(self, batch):
        self.batch = batch


def _listed(model, structures, hooks=None):
    batch = atoms_to_batch(structures, device="cpu", dtype=torch.float64)
    hooks = neighbor_hooks(model, skin=SKIN) if hooks is None else hooks
    for hook in hooks:
        hook(_Context(batch), None)
    return batch, hooks


def _forces(model, batch):
    return model(batch)["forces"].detach().numpy().copy()


def _rows(batch, system):
    pointer = batch.batch_ptr.numpy()
    return slice(int(pointer[system]), int(pointer[system + 1]))


def test_emptied_structures_get_no_pairs_and_leave_the_others_unchanged(model):
    structures = _structures()
    batch, hooks = _listed(model, structures)
    before = _forces(model, batch)
    empty_neighbors(hooks, batch, torch.tensor([False, True, False, False]))
    after = _forces(model, batch)
    for system in (0, 2, 3):
        rows = _rows(batch, system)
        np.testing.assert_allclose(after[rows], before[rows], rtol=0, atol=FORCE_ATOL)
    assert np.abs(before[_rows(batch, 1)]).max() > 1e-3
    assert not after[_rows(batch, 1)].any()
    assert not batch.num_neighbors[_rows(batch, 1)].any()

    # structure 0 moves past the skin: its list is built again, 1's stays empty
    with torch.no_grad():
        batch.positions[_rows(batch, 0)] += torch.tensor([0.8 * SKIN, 0.0, 0.0])
    for hook in hooks:
        hook(_Context(batch), None)
    assert hooks[0].builds == 2
    moved = [atoms.copy() for atoms in structures]
    moved[0].positions += [0.8 * SKIN, 0.0, 0.0]
    fresh, _ = _listed(model, moved)
    now, reference = _forces(model, batch), _forces(model, fresh)
    for system in (0, 2, 3):
        rows = _rows(batch, system)
        np.testing.assert_allclose(now[rows], reference[rows], rtol=0, atol=FORCE_ATOL)
    assert not now[_rows(batch, 1)].any()


def test_carried_lists_give_fresh_lists_forces_and_build_only_the_admitted(model):
    structures = _structures()
    old_batch, old_hooks = _listed(model, structures[:3])
    refilled = [structures[0], structures[2], structures[3]]  # 1 left, 3 admitted
    new_batch = atoms_to_batch(refilled, device="cpu", dtype=torch.float64)
    new_hooks = neighbor_hooks(model, skin=SKIN)
    carry_neighbor_lists(
        old_hooks, new_hooks, old_batch, torch.tensor([0, 2]), new_batch
    )
    for hook in new_hooks:
        hook(_Context(new_batch), None)
    assert new_hooks[0]._rebuild_flags.tolist() == [False, False, True]
    fresh, _ = _listed(model, refilled)
    np.testing.assert_allclose(
        _forces(model, new_batch), _forces(model, fresh), rtol=0, atol=FORCE_ATOL
    )
    # the carried rows are the old rows, renumbered: same pairs, same order
    old_rows, new_rows = _rows(old_batch, 2), _rows(new_batch, 1)
    offset = old_rows.start - new_rows.start
    counts = old_batch.num_neighbors[old_rows]
    assert torch.equal(new_batch.num_neighbors[new_rows], counts)
    for old_row, new_row, count in zip(
        old_batch.neighbor_matrix[old_rows],
        new_batch.neighbor_matrix[new_rows],
        counts.tolist(),
        strict=True,
    ):
        assert torch.equal(new_row[:count], old_row[:count] - offset)
