"""``optimize.FIRE`` is ASE's FIRE step for step, for every structure of a batch.

The engine (``engines.fire.FIRE``) does ASE's arithmetic with per-structure
sums, so each structure's path must equal ``ase.optimize.FIRE`` on the same
model to rounding, including the uphill resets of ``downhill_check`` and the
calls of ``position_reset_callback``.
"""

from __future__ import annotations

import numpy as np
import pytest
from ase.constraints import FixAtoms
from ase.optimize import FIRE as AseFIRE

from nvalchemi_ase import NVAlchemiCalculator
from nvalchemi_ase.optimize import FIRE
from tests.structures import cluster, rattled_bulk

PATH_TOL = 1e-12  # Å: the same arithmetic, summed in another order
FMAX = 1e-3


def _structures():
    frozen = rattled_bulk(repeat=2, seed=5, stdev=0.12)
    frozen.set_constraint(FixAtoms(indices=[0, 7]))
    return [
        rattled_bulk(repeat=2, seed=3, stdev=0.15),
        rattled_bulk(repeat=3, seed=4, stdev=0.1),
        cluster(),
        frozen,
    ]


def _ase_run(atoms, model, **kwargs):
    reference = atoms.copy()
    reference.calc = NVAlchemiCalculator(model, device="cpu", dtype="float64")
    optimizer = AseFIRE(reference, logfile=None, **kwargs)
    optimizer.run(fmax=FMAX, steps=400)
    return reference, optimizer.nsteps


@pytest.mark.parametrize("downhill_check", [False, True])
def test_each_structure_follows_ases_fire(downhill_check, lj_calc64):
    images = _structures()
    starts = [atoms.copy() for atoms in images]
    steps = []
    optimizer = FIRE(
        images, model=lj_calc64.model, logfile=None, downhill_check=downhill_check
    )
    optimizer.attach(lambda: steps.append(optimizer.converged_mask.copy()))
    assert optimizer.run(fmax=FMAX, steps=400)
    converged_at = np.argmax(np.array(steps), axis=0)  # first step each converged
    for index, (atoms, start) in enumerate(zip(images, starts, strict=True)):
        reference, ase_steps = _ase_run(
            start, lj_calc64.model, downhill_check=downhill_check
        )
        np.testing.assert_allclose(atoms.positions, reference.positions, atol=PATH_TOL)
        assert converged_at[index] == ase_steps, f"images[{index}]"


def test_position_reset_callback_sees_what_ases_sees(lj_calc64):
    start = rattled_bulk(repeat=3, seed=4, stdev=0.1)
    ours, theirs = [], []

    def record(into):
        return lambda optimizable, r, e, e_last: into.append((r.copy(), e, e_last))

    FIRE(
        start.copy(),
        model=lj_calc64.model,
        logfile=None,
        downhill_check=True,
        position_reset_callback=record(ours),
    ).run(fmax=FMAX, steps=400)
    _ase_run(
        start,
        lj_calc64.model,
        downhill_check=True,
        position_reset_callback=record(theirs),
    )
    assert len(ours) == len(theirs) > 0  # this path does go uphill
    for (r, e, e_last), (r_ase, e_ase, e_last_ase) in zip(ours, theirs, strict=True):
        np.testing.assert_allclose(
            r.reshape(-1, 3), r_ase.reshape(-1, 3), atol=PATH_TOL
        )
        assert e == pytest.approx(e_ase, abs=1e-10)
        assert e_last == pytest.approx(e_last_ase, abs=1e-10)


def test_an_initial_mixing_parameter_other_than_astart_is_ases(lj_calc64):
    start = rattled_bulk(repeat=2, seed=3, stdev=0.15)
    atoms = start.copy()
    FIRE(atoms, model=lj_calc64.model, logfile=None, a=0.3, astart=0.1).run(
        fmax=FMAX, steps=400
    )
    reference, _ = _ase_run(start, lj_calc64.model, a=0.3, astart=0.1)
    np.testing.assert_allclose(atoms.positions, reference.positions, atol=PATH_TOL)
