"""Ion relaxations of the property workflows: in flight, per structure, per material."""

from __future__ import annotations

import numpy as np
import pytest
from ase.build import bulk

from nvalchemi_ase.optimize import FIRE
from nvalchemi_ase.properties import _common, equation_of_state
from tests.structures import A_AR

FMAX = 1e-4  # eV/Å


def _structures():
    """Six cells that relax in ~40 FIRE steps and one that takes twice as long."""
    out = []
    for seed, amount in enumerate([0.01] * 6 + [0.2]):
        atoms = bulk("Ar", "fcc", a=A_AR, cubic=True)
        atoms.rattle(amount, seed=seed)
        out.append(atoms)
    return out


def _graphs_evaluated(calc):
    """Count the structures (graphs) of every model call into the returned list."""
    counts = []
    handle = calc.model.register_forward_hook(
        lambda module, inputs, outputs: counts.append(int(inputs[0].num_graphs))
    )
    return counts, handle


def test_converged_structures_leave_the_batch(lj_calc64):
    structures = _structures()
    derived = [
        _common.Derived(k, atoms.copy(), f"cell {k}")
        for k, atoms in enumerate(structures)
    ]
    ledger = _common.Ledger(len(derived))
    counts, handle = _graphs_evaluated(lj_calc64)
    try:
        steps = _common.relax_structures(
            lj_calc64, derived, ledger, fmax=FMAX, steps=1000, optimizer="FIRE"
        )
    finally:
        handle.remove()
    assert not ledger.errors
    # each structure's path is its own: the steps of FIRE on it alone
    alone = []
    for atoms in structures:
        atoms.calc = lj_calc64
        opt = FIRE([atoms], logfile=None)
        opt.run(fmax=FMAX, steps=1000)
        alone.append(int(opt.converged_at_step[0]))
        np.testing.assert_allclose(
            derived[len(alone) - 1].atoms.positions, atoms.positions, atol=1e-8
        )
    assert steps.tolist() == alone
    assert max(alone) > 1.5 * sorted(alone)[-2]  # one slow structure
    # model work: each structure's own evaluations (+ a few at refills), far
    # from what a batch stepping all until the slowest converges would cost
    own = int((steps + 1).sum())
    held_to_the_end = len(derived) * (int(steps.max()) + 1)
    assert own <= sum(counts) < own + (held_to_the_end - own) / 4
    for item in derived:
        assert item.atoms.calc is None


@pytest.mark.slow  # ~4 CPU-s: among test-fast's costliest
def test_a_small_memory_budget_relaxes_the_same(lj_calc64):
    materials = _structures()[5:]
    atoms = [a for a in materials for _ in range(2)]
    assert _common.atom_budget(lj_calc64, atoms, 1.0) == 4  # the largest alone
    assert _common.atom_budget(lj_calc64, atoms, None) == 16
    default = equation_of_state(materials, lj_calc64, relax="ions", fmax=FMAX)
    tight = equation_of_state(
        materials, lj_calc64, relax="ions", fmax=FMAX, memory_budget=1.0
    )
    for a, b in zip(default, tight, strict=True):
        assert a.ok, a.error
        assert b.ok, b.error
        np.testing.assert_array_equal(a.relax_steps, b.relax_steps)
        np.testing.assert_allclose(a.energies, b.energies, rtol=1e-12)


def test_unconverged_relaxation_fails_its_material_only(lj_calc64):
    fast, slow = _structures()[5:]
    results = equation_of_state(
        [fast, slow], lj_calc64, relax="ions", fmax=FMAX, steps=60
    )
    assert results[0].ok, results[0].error
    assert (results[0].relax_steps > 0).all()
    assert not results[1].ok
    assert "relaxation did not converge to fmax 0.0001 eV/Å in 60 steps" in (
        results[1].error
    )
    assert results[1].error.startswith("volume ")
    assert "raise steps or loosen fmax" in results[1].error
    assert results[1].v0 is None


@pytest.mark.parametrize("properties", [["energy"], ["stress"]])
def test_reused_results_match_a_fresh_evaluation(lj_calc64, properties):
    derived = [
        _common.Derived(k, atoms, f"cell {k}") for k, atoms in enumerate(_structures())
    ]
    ledger = _common.Ledger(len(derived))
    results, steps = _common.relax_and_evaluate(
        lj_calc64, derived, ledger, properties, fmax=FMAX, steps=1000, optimizer="FIRE"
    )
    assert (steps > 0).all()
    fresh = _common.evaluate(lj_calc64, derived, [*properties, "forces"], ledger)
    for name in properties:
        np.testing.assert_allclose(
            _common.gather(results, range(len(derived)), name),
            _common.gather(fresh, range(len(derived)), name),
            rtol=1e-13,
            atol=1e-15,
        )
