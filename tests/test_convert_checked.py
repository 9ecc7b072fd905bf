"""A batch built from checked structures: ``check_images`` then ``batch_from_checked``.

The reference is :func:`~nvalchemi_ase.convert.atoms_to_batch` of the same
structures: the batch must be the same, field by field and bit for bit; a
structure the check refuses is refused with the same reason as before.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ase import Atoms
from ase.build import bulk

from nvalchemi_ase import NVAlchemiCalculator
from nvalchemi_ase.convert import (
    StructureError,
    atoms_to_batch,
    batch_from_checked,
    check_images,
    update_atoms,
)
from nvalchemi_ase.runners._common import Admission
from tests.structures import A_AR, carried_fields_images, cluster


@pytest.fixture(scope="module")
def model():
    return NVAlchemiCalculator("lj", device="cpu", dtype="float64").model


def _assert_same_batch(ours, reference) -> None:
    assert ours.num_graphs == reference.num_graphs
    assert ours.num_nodes == reference.num_nodes
    assert torch.equal(ours.batch_ptr, reference.batch_ptr)
    keys = {key for level in reference.keys.values() for key in level}
    assert {key for level in ours.keys.values() for key in level} == keys
    for key in sorted(keys):
        mine, theirs = ours[key], reference[key]
        assert mine.dtype == theirs.dtype, key
        assert mine.shape == theirs.shape, key
        assert torch.equal(mine, theirs), key


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_batch_from_checked_is_atoms_to_batch_bit_for_bit(model, dtype):
    images = [*carried_fields_images(), cluster()]  # 1-55 atoms, every field
    checked = check_images(images, model=model, skin=1.0)
    ours = batch_from_checked(checked, device="cpu", dtype=dtype)
    reference = atoms_to_batch(images, device="cpu", dtype=dtype, warn_dropped=False)
    _assert_same_batch(ours, reference)
    assert checked.images == images
    assert checked.holds(images)
    assert not checked.holds(images[::-1])


def test_a_checked_set_builds_one_batch_and_leaves_the_atoms_alone(model):
    images = [bulk("Ar", "fcc", a=A_AR) * (n, 1, 1) for n in (1, 2, 3)]
    before = [atoms.positions.copy() for atoms in images]
    checked = check_images(images, model=model)
    batch = batch_from_checked(checked, device="cpu")
    with torch.no_grad():
        batch.positions.add_(1.0)  # the batch owns its arrays now
    for atoms, positions in zip(images, before, strict=True):
        np.testing.assert_array_equal(atoms.positions, positions)
    with pytest.raises(ValueError, match="built a batch already"):
        batch_from_checked(checked, device="cpu")


def _refused_set() -> list[Atoms]:
    good = bulk("Ar", "fcc", a=A_AR, cubic=True)
    close = good.copy()
    close.positions[1] = close.positions[0] + [0.01, 0.0, 0.0]
    # a periodic axis far too thin for LJ's cutoff (8.5 Å)
    thin = Atoms("Ar", cell=[20.0, 20.0, 0.3], pbc=True)
    nan = good.copy()
    nan.positions[2, 0] = np.nan
    return [good, close, thin, good.copy(), nan, Atoms()]


def test_admission_refuses_as_before_and_checks_only_sets_that_pass(model):
    admission = Admission(model, None)
    images = _refused_set()
    reasons, checked = admission.checked(images)
    assert checked is None  # one was refused: nothing to build from
    assert reasons == [admission(atoms) for atoms in images]
    assert reasons == admission.refusals(images)
    assert [reason is None for reason in reasons] == [
        True,
        False,
        False,
        True,
        False,
        False,
    ]
    for atoms, reason in zip(images, reasons, strict=True):
        if reason is None:
            continue
        with pytest.raises((StructureError, ValueError)) as error:
            check_images([atoms], model=model, skin=1.0)
        assert (
            reason.split(":")[0]
            in f"{getattr(error.value, 'field', '')}: {error.value}"
        )
    good = [images[0], images[3]]
    reasons, checked = admission.checked(good)
    assert reasons == [None, None]
    assert checked is not None
    assert checked.holds(good)
    _assert_same_batch(
        batch_from_checked(checked, device="cpu"),
        atoms_to_batch(good, device="cpu", warn_dropped=False),
    )


def test_update_atoms_only_checks_and_writes_the_chosen_structures():
    images = [bulk("Ar", "fcc", a=A_AR) * (n, 1, 1) for n in (1, 2, 3)]
    batch = atoms_to_batch(images, device="cpu", warn_dropped=False)
    with torch.no_grad():
        batch.positions.add_(0.25)
    targets = [atoms.copy() for atoms in images]
    before = [atoms.positions.copy() for atoms in targets]
    update_atoms(targets, batch, results=False, only=[1])
    np.testing.assert_array_equal(targets[0].positions, before[0])
    np.testing.assert_array_equal(targets[2].positions, before[2])
    np.testing.assert_allclose(targets[1].positions, before[1] + 0.25, atol=1e-12)
    wrong = [targets[0], targets[1], targets[2][:1]]  # the chosen one is wrong
    with pytest.raises(ValueError, match=r"images\[2\] has 1 atoms"):
        update_atoms(wrong, batch, results=False, only=[2])
    np.testing.assert_array_equal(targets[2].positions, before[2])
