"""Composed models (``a + b``, ``"lj+d3"``): the sum of the parts, on every path."""

from types import SimpleNamespace

import numpy as np
import pytest
from ase.build import bulk, fcc111, molecule
from ase.calculators.mixing import SumCalculator
from ase.md.verlet import VelocityVerlet as AseVelocityVerlet
from ase.optimize import FIRE as AseFIRE

from nvalchemi_ase import NVAlchemiCalculator
from nvalchemi_ase._compat import pipeline_batch_sources
from nvalchemi_ase.convert import atoms_to_batch
from nvalchemi_ase.models import load_model
from nvalchemi_ase.models.composition import (
    build_neighbors,
    compose,
    composed_parts,
    neighbor_configs,
)
from nvalchemi_ase.models.memory import memory_estimate

pytest.importorskip("tad_dftd3", reason="extra d3 (tad-dftd3) not installed")

# Sum of two float64 evaluations vs the composed one: round-off of the sum only.
SUM_RTOL = 1e-10
SUM_ATOL = 1e-10  # eV, eV/Å, eV/Å³
# Trajectories of the same forces summed in another order: 10 steps.
PATH_ATOL = 1e-8  # Å

LJ = "lj(cutoff=6.0)"  # argon, 6 Å; with D3's 10 Å: two lists (ratio > 1.5)
D3 = "d3(pbe, cutoff=10.0)"


def _structures():
    cluster = molecule("CH3CH2OH")
    slab = fcc111("Cu", (2, 2, 3), vacuum=6.0)
    slab.info.clear()  # ASE's adsorbate_info: not carried, warned about
    solid = bulk("NaCl", "rocksalt", 5.64, cubic=True)
    solid.rattle(0.05, seed=1)
    return [cluster, slab, solid]


def _spread():
    """A cluster, a slab and a solid with neighbours near argon LJ's minimum.

    Argon's σ = 3.4 Å: chemical bond lengths would give LJ forces of 1e5 eV/Å.
    """
    cluster = molecule("CH4")
    cluster.positions *= 3.6 / 1.09  # C-H 3.6 Å
    slab = fcc111("Cu", (2, 2, 3), a=5.3, vacuum=6.0)
    slab.info.clear()
    solid = bulk("NaCl", "rocksalt", 7.6, cubic=True)
    solid.rattle(0.05, seed=1)
    return [cluster, slab, solid]


@pytest.fixture(scope="module")
def parts():
    return load_model(LJ), load_model(D3)


@pytest.fixture(scope="module")
def composed():
    return load_model(f"{LJ}+{D3}")


def _summed(parts, structures, properties):
    runs = [
        NVAlchemiCalculator(part, device="cpu", dtype="float64").calculate_batch(
            structures, properties
        )
        for part in parts
    ]
    return [
        {key: a[key] + b[key] for key in a if key in b}
        for a, b in zip(*runs, strict=True)
    ]


def _assert_sum(results, expected):
    for mine, ref in zip(results, expected, strict=True):
        assert set(mine) == set(ref)
        for key in ref:
            np.testing.assert_allclose(
                mine[key], ref[key], rtol=SUM_RTOL, atol=SUM_ATOL, err_msg=key
            )


def test_names_build_sums_of_the_registered_parts(composed):
    names = [type(p).__name__ for p in composed_parts(composed)]
    assert names == ["LennardJonesModelWrapper", "DFTD3"]
    assert [c.cutoff for c in neighbor_configs(composed)] == [10.0, 6.0]
    shortcut = load_model("lj", dispersion="d3(b3lyp)")
    assert composed_parts(shortcut)[1].a1 == pytest.approx(0.3981)
    assert type(composed_parts(load_model("lj", dispersion=True))[1]).__name__ == (
        "DFTD3"
    )


def test_unknown_part_is_named():
    with pytest.raises(ValueError, match="'d4' \\(a part of 'lj\\+d4'\\)"):
        load_model("lj+d4")
    with pytest.raises(ValueError, match="parts joined by"):
        load_model("lj++d3")
    with pytest.raises(TypeError, match="parentheses"):
        load_model("lj+d3", epsilon=0.01)


def test_calculator_gives_the_sum_of_the_parts(parts, composed):
    structures = _structures()
    properties = ["energy", "forces", "stress"]
    calc = NVAlchemiCalculator(composed, device="cpu", dtype="float64")
    _assert_sum(
        calc.calculate_batch(structures, properties),
        _summed(parts, structures, properties),
    )
    single = structures[2].copy()
    single.calc = NVAlchemiCalculator(composed, device="cpu", dtype="float64")
    np.testing.assert_allclose(
        single.get_stress(),
        _summed(parts, [structures[2]], properties)[0]["stress"],
        rtol=SUM_RTOL,
        atol=SUM_ATOL,
    )


@pytest.mark.parametrize("policy", ["always", "never"])
def test_neighbour_sharing_policies_and_plain_plus_agree(parts, policy):
    structures = _structures()
    properties = ["energy", "forces", "stress"]
    expected = _summed(parts, structures, properties)
    shared = compose(*parts, neighbor_adaptation=policy)
    assert len(neighbor_configs(shared)) == (1 if policy == "always" else 2)
    for model in (shared, parts[0] + parts[1]):  # nvalchemi's own ``+`` too
        calc = NVAlchemiCalculator(model, device="cpu", dtype="float64")
        _assert_sum(calc.calculate_batch(structures, properties), expected)


def test_the_pipeline_hook_leaves_every_source_on_the_batch(composed):
    batch = atoms_to_batch(_structures(), device="cpu", dtype=None)
    build_neighbors(composed, batch)
    sources = pipeline_batch_sources(batch)
    assert sources is not None
    assert len(sources) == 2


def _sum_calculator(parts):
    return SumCalculator(
        [NVAlchemiCalculator(p, device="cpu", dtype="float64") for p in parts]
    )


def test_velocity_verlet_follows_ase_with_a_sum_calculator(parts, composed):
    from nvalchemi_ase.dynamics.neighbors import PipelineNeighborHook
    from nvalchemi_ase.md import VelocityVerlet

    structures = _spread()
    rng = np.random.default_rng(3)
    for atoms in structures:
        atoms.set_velocities(rng.normal(0.0, 0.01, (len(atoms), 3)))
    ours = [a.copy() for a in structures]
    calc = NVAlchemiCalculator(composed, device="cpu", dtype="float64")
    for atoms in ours:
        atoms.calc = calc
    dyn = VelocityVerlet(ours, timestep=1.0)
    dyn.run(10)
    (hook,) = [h for h in dyn.engine.hooks if isinstance(h, PipelineNeighborHook)]
    # D3 sums coordination numbers over its whole list: exact list, no skin
    assert [inner.skin for inner in hook.lists] == [0.0, 1.0]
    assert hook.builds == 11
    for atoms, mine in zip(structures, ours, strict=True):
        reference = atoms.copy()
        reference.calc = _sum_calculator(parts)
        AseVelocityVerlet(reference, timestep=1.0).run(10)
        np.testing.assert_allclose(
            mine.positions, reference.positions, rtol=0, atol=PATH_ATOL
        )


def test_fire_follows_ase_with_a_sum_calculator(parts, composed):
    from nvalchemi_ase.optimize import FIRE

    structures = _spread()
    ours = [a.copy() for a in structures]
    calc = NVAlchemiCalculator(composed, device="cpu", dtype="float64")
    for atoms in ours:
        atoms.calc = calc
    FIRE(ours, logfile=None).run(fmax=1e-6, steps=8)
    for atoms, mine in zip(structures, ours, strict=True):
        reference = atoms.copy()
        reference.calc = _sum_calculator(parts)
        AseFIRE(reference, logfile=None).run(fmax=1e-6, steps=8)
        np.testing.assert_allclose(
            mine.positions, reference.positions, rtol=0, atol=PATH_ATOL
        )


def test_relax_runner_refills_a_composed_model(parts, composed):
    from nvalchemi_ase.runners import relax

    extra = bulk("Ar", "fcc", 5.26, cubic=True)
    extra.rattle(0.05, seed=2)
    structures = [*_spread(), extra, bulk("Kr", "fcc", 5.7)]
    results = relax(
        structures, composed, fmax=0.05, steps=300, max_structures=2, progress=False
    )
    reference = _sum_calculator(parts)
    for atoms in results:
        check = atoms.copy()
        check.calc = reference
        assert np.linalg.norm(check.get_forces(), axis=1).max() < 0.05
        assert atoms.get_potential_energy() == pytest.approx(
            check.get_potential_energy(), rel=SUM_RTOL, abs=SUM_ATOL
        )


def test_cli_relax_with_a_composed_model(tmp_path, parts):
    from ase.io import read, write

    from nvalchemi_ase.cli.main import main

    structures = _spread()[::2]
    source = tmp_path / "in.extxyz"
    write(source, structures)
    out = tmp_path / "out.extxyz"
    code = main(
        [
            "relax",
            "--model",
            f"{LJ}+{D3}",
            "--dtype",
            "float64",
            str(source),
            "-o",
            str(out),
            "--quiet",
        ]
    )
    assert code in (0, None)
    frames = read(out, ":")
    assert len(frames) == len(structures)
    reference = _sum_calculator(parts)
    for frame in frames:
        energy = frame.get_potential_energy()
        frame.calc = reference
        assert energy == pytest.approx(frame.get_potential_energy(), abs=1e-8)


def test_memory_estimate_adds_the_parts(parts, composed):
    import torch

    whole = memory_estimate(composed, torch.float64, "cpu")
    split = [memory_estimate(p, torch.float64, "cpu") for p in parts]
    assert whole.bytes_per_atom == pytest.approx(sum(e.bytes_per_atom for e in split))
    assert SimpleNamespace(basis=whole.basis).basis.startswith("sum of its parts")


@pytest.mark.slow
def test_sevennet_plus_d3_is_the_sum_of_its_parts():
    pytest.importorskip("sevenn")
    import torch

    from tests._tolerances import EXACT

    structures = _structures()
    properties = ["energy", "forces", "stress"]
    composed = load_model("sevennet-0+d3")
    assert [type(p).__name__ for p in composed_parts(composed)] == [
        "SevenNetWrapper",
        "DFTD3",
    ]
    parts = composed_parts(composed)
    calc = NVAlchemiCalculator(composed, device="cpu", dtype="float32")
    results = calc.calculate_batch(structures, properties)
    runs = [
        NVAlchemiCalculator(p, device="cpu", dtype="float32").calculate_batch(
            structures, properties
        )
        for p in parts
    ]
    tol = EXACT[torch.float32]
    for mine, a, b in zip(results, *runs, strict=True):
        for key in ("energy", "forces", "stress"):
            if key in mine:
                np.testing.assert_allclose(
                    mine[key], a[key] + b[key], rtol=tol, atol=tol, err_msg=key
                )


def test_langevin_restart_of_a_composed_model_is_exact(composed, tmp_path):
    """Both lists go into the checkpoint and come back (per-list state)."""
    from nvalchemi_ase.md import Langevin

    def make(restart=None):
        images = _spread()
        calc = NVAlchemiCalculator(composed, device="cpu", dtype="float64")
        for atoms in images:
            atoms.calc = calc
        dyn = Langevin(
            images, 1.0, temperature_K=50.0, friction=0.01, seed=5, restart=restart
        )
        return images, dyn

    reference, dyn = make()
    dyn.run(6)
    path = tmp_path / "md.npz"
    _, first = make(restart=path)
    first.run(3)
    continued, second = make(restart=path)
    second.run(3)
    for want, got in zip(reference, continued, strict=True):
        np.testing.assert_array_equal(got.positions, want.positions)


def test_zero_damped_d3_composes_like_the_bj_one():
    """``lj+d3-zero``: the sum of the parts, in the calculator and in FIRE."""
    from nvalchemi_ase.optimize import FIRE

    zero = "d3-zero(pbe, cutoff=10.0)"
    parts = (load_model(LJ), load_model(zero))
    composed = load_model(f"{LJ}+{zero}")
    assert [type(p).__name__ for p in composed_parts(composed)] == [
        "LennardJonesModelWrapper",
        "D3ZeroDamping",
    ]
    assert composed_parts(load_model("lj", dispersion="d3-zero"))[1].params[
        "rs6"
    ] == pytest.approx(1.217)  # PBE's zero-damping radius scale
    structures = _structures()
    properties = ["energy", "forces", "stress"]
    calc = NVAlchemiCalculator(composed, device="cpu", dtype="float64")
    _assert_sum(
        calc.calculate_batch(structures, properties),
        _summed(parts, structures, properties),
    )
    ours = _spread()
    for atoms in ours:
        atoms.calc = NVAlchemiCalculator(composed, device="cpu", dtype="float64")
    FIRE(ours, logfile=None).run(fmax=1e-9, steps=8)
    for start, mine in zip(_spread(), ours, strict=True):
        start.calc = _sum_calculator(parts)
        AseFIRE(start, logfile=None).run(fmax=1e-9, steps=8)
        np.testing.assert_allclose(mine.positions, start.positions, atol=PATH_ATOL)
