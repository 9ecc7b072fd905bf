"""``BatchedDynamics.written_copies``: what ``sync_structures`` writes, into copies.

The in-flight runner takes a finished structure's result from copies of its
``Atoms`` written by ``written_copies`` instead of writing the working ``Atoms``
(``sync_structures``) and copying them. The reference here is
``sync_structures`` itself, called on the same object at the same step: the
copies must hold the same state and results, bit for bit, and the working
``Atoms`` must be left as they were until then.
"""

from __future__ import annotations

import numpy as np
import pytest
from ase.build import bulk
from ase.filters import FrechetCellFilter

from nvalchemi_ase import optimize
from nvalchemi_ase.runners._common import NO_LIMIT
from tests.structures import A_AR, rattled_bulk


def _images() -> list:
    still = bulk("Ar", "fcc", a=A_AR, cubic=True)  # no force: never moves
    still.positions += 1e-9 * np.arange(12).reshape(4, 3)  # not float32-exact
    return [
        rattled_bulk(2, seed=1),
        still,
        rattled_bulk(2, seed=2),
        rattled_bulk(1, seed=3),
    ]


def _state(atoms) -> dict:
    return {
        "positions": atoms.positions.copy(),
        "cell": atoms.cell.array.copy(),
        "momenta": atoms.get_momenta().copy(),
    }


@pytest.mark.parametrize("cell_filter", [None, FrechetCellFilter])
def test_written_copies_hold_what_sync_structures_writes(cell_filter):
    images = _images()
    inputs = [atoms.copy() for atoms in images]
    given = images if cell_filter is None else [cell_filter(a) for a in images]
    opt = optimize.FIRE(given, logfile=None, model="lj", device="cpu", dtype="float32")
    run = opt.irun(1e-6, NO_LIMIT, sync_atoms=False)
    for _ in range(4):  # the first evaluation, then three steps
        next(run)
    working = [_state(atoms) for atoms in opt.images]
    selected = np.array([True, True, False, True])

    copies = opt.written_copies(selected)

    for atoms, before in zip(opt.images, working, strict=True):
        for key, value in _state(atoms).items():
            np.testing.assert_array_equal(value, before[key])  # untouched
    if cell_filter is None:  # under the filter its cell relaxes: it moves
        # the structure that never moved keeps its exact float64 input
        np.testing.assert_array_equal(copies[1][0].positions, inputs[1].positions)
    assert not np.array_equal(copies[0][0].positions, inputs[0].positions)

    opt.sync_structures(selected)
    for (copy, results), k in zip(copies, np.flatnonzero(selected), strict=True):
        reference = opt.images[k]
        assert copy is not reference
        assert copy.calc is None
        for key, value in _state(reference).items():
            np.testing.assert_array_equal(_state(copy)[key], value)
        assert sorted(copy.arrays) == sorted(reference.arrays)
        expected = reference.calc.results
        assert sorted(results) == sorted(expected)
        for key, value in expected.items():
            np.testing.assert_array_equal(results[key], value)
    run.close()
