"""Batched Γ-point vibrations vs ASE's Vibrations, analytic vs finite Hessians."""

from __future__ import annotations

import json

import numpy as np
import pytest
from ase.build import molecule
from ase.cluster import Icosahedron
from ase.vibrations import Vibrations

from nvalchemi_ase import NVAlchemiCalculator
from nvalchemi_ase._quiet import import_quietly
from nvalchemi_ase.properties import vibrations
from tests.helpers import assert_same_snapshot, snapshot
from tests.structures import A_AR


def _clusters():
    icosahedron = Icosahedron("Ar", noshells=2, latticeconstant=A_AR)
    icosahedron.rattle(0.05, seed=2)
    return [icosahedron[:4], icosahedron[:5]]


def test_finite_differences_match_ases_vibrations(lj_calc64, tmp_path):
    clusters = _clusters()
    before = [snapshot(atoms) for atoms in clusters]
    results = vibrations(clusters, lj_calc64, displacement=0.01)
    for k, (atoms, result, seen) in enumerate(
        zip(clusters, results, before, strict=True)
    ):
        assert result.ok, result.error
        assert result.method == "finite"  # LJ has no analytic Hessian in nvalchemi
        copy = atoms.copy()
        copy.calc = lj_calc64
        reference = Vibrations(copy, delta=0.01, nfree=2, name=str(tmp_path / f"v{k}"))
        reference.run()
        data = reference.get_vibrations()
        np.testing.assert_allclose(
            result.hessian, data.get_hessian_2d(), rtol=1e-10, atol=1e-10
        )
        energies = data.get_energies()  # complex: imaginary modes
        imaginary = np.abs(energies.imag) > np.abs(energies.real)
        expected = np.where(imaginary, -np.abs(energies.imag), energies.real)
        np.testing.assert_allclose(result.energies, expected, atol=1e-10)
        np.testing.assert_allclose(
            result.frequencies_cm, np.sign(expected) * np.abs(data.get_frequencies())
        )
        assert_same_snapshot(seen, atoms)


def test_hessian_method_is_refused_by_models_without_it(lj_calc64):
    models = import_quietly("nvalchemi.models")
    with pytest.raises(models.DerivativeNotSupported):
        vibrations(_clusters()[:1], lj_calc64, method="hessian")


def _hessian_demo_calculator():
    """The demo model with nvalchemi's analytic Hessian enabled (autograd energy)."""
    demo = import_quietly("nvalchemi.models.demo")

    class HessianDemo(demo.DemoModelWrapper):
        def _validate_derivative_request(self, request):
            return None  # its energy is a plain torch graph: double backward works

    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        network = demo.DemoModel(hidden_dim=32)
    return NVAlchemiCalculator(HessianDemo(network), device="cpu", dtype="float64")


def test_analytic_hessians_match_batched_finite_differences():
    calc = _hessian_demo_calculator()
    molecules = [molecule("H2O"), molecule("NH3")]
    analytic = vibrations(molecules, calc)  # auto: the model supports it
    finite = vibrations(molecules, calc, method="finite", displacement=1e-4)
    for exact, approximate in zip(analytic, finite, strict=True):
        assert exact.method == "hessian"
        assert exact.displacement is None
        assert approximate.method == "finite"
        scale = np.abs(exact.hessian).max()
        np.testing.assert_allclose(
            exact.hessian, approximate.hessian, atol=1e-5 * scale
        )
        np.testing.assert_allclose(exact.hessian, exact.hessian.T, atol=1e-12 * scale)


def test_a_failing_structure_is_reported_and_the_others_finish(lj_calc64):
    good = _clusters()[0]
    broken = good.copy()
    broken.positions[1] = broken.positions[0]
    results = vibrations([broken, good], lj_calc64)
    assert [r.ok for r in results] == [False, True]
    assert "StructureError" in results[0].error
    assert results[0].hessian is None


def test_results_serialise_to_strict_json_with_units(lj_calc64):
    (result,) = vibrations(_clusters()[0], lj_calc64)
    data = json.loads(json.dumps(result.to_dict(), allow_nan=False))
    assert data["units"]["frequencies_cm"] == "1/cm"
    assert "vibrations" not in data
    assert np.array(data["hessian"]).shape == (12, 12)
