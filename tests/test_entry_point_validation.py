"""Every entry point refuses what the calculator refuses, before any sizing.

A near-singular cell (a2 = a1 + 1e-4 Å) and one atom in a 0.02 Å cell once
made the runners' edge counting allocate hundreds of GiB before the model's
checks ran. Each entry point must now give the calculator's own message (the
field and the fix) and keep the memory it takes small.
"""

from __future__ import annotations

import math
import tracemalloc

import numpy as np
import pytest
from ase import Atoms
from ase.build import bulk

from nvalchemi_ase import NVAlchemiCalculator
from nvalchemi_ase.convert import StructureError
from nvalchemi_ase.models.memory import count_edges

#: What counting the edges of a refused structure may allocate (bytes).
MAX_PEAK = 64 * 2**20
#: The calculator's message for an atom near its own periodic image.
OWN_IMAGE = "from its own periodic image"


def _near_singular() -> Atoms:
    a1 = np.array([5.26, 0.0, 0.0])
    return Atoms(
        "Ar2",
        positions=[[0.0, 0.0, 0.0], [1.3, 1.3, 1.3]],
        cell=[a1, a1 + np.array([0.0, 1e-4, 0.0]), [0.0, 0.0, 5.26]],
        pbc=True,
    )


def _tiny_cell() -> Atoms:
    return Atoms("Ar", positions=[[0.0, 0.0, 0.0]], cell=np.eye(3) * 0.02, pbc=True)


DEGENERATE = {"near-singular": _near_singular, "tiny": _tiny_cell}


def _good() -> Atoms:
    return bulk("Ar", "fcc", a=5.26, cubic=True)


def _calculator_message(atoms: Atoms) -> str:
    with pytest.raises(StructureError) as caught:
        NVAlchemiCalculator("lj", device="cpu").calculate_batch([atoms])
    return str(caught.value).split(": ", 1)[1]


@pytest.mark.parametrize("name", DEGENERATE)
def test_edge_count_of_a_degenerate_cell_allocates_nothing_large(name):
    atoms = DEGENERATE[name]()
    tracemalloc.start()
    try:
        edges = count_edges(atoms, 8.5)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert edges == math.inf
    assert peak < MAX_PEAK


def test_edge_count_unchanged_for_ordinary_structures():
    from ase.neighborlist import neighbor_list

    for atoms in (_good(), _good().repeat(2), bulk("Si", cubic=True)):
        exact = len(neighbor_list("i", atoms, 5.0))
        assert count_edges(atoms, 5.0, samples=len(atoms)) == exact


@pytest.mark.parametrize("name", DEGENERATE)
def test_irelax_with_max_edges_refuses_with_the_calculators_message(name):
    from nvalchemi_ase.runners import irelax

    bad = DEGENERATE[name]()
    expected = _calculator_message(bad)
    out = dict(irelax([_good(), bad, _good()], "lj", max_edges=10**7, steps=2))
    assert OWN_IMAGE in out[1].info["failure"]
    assert out[1].info["failure"].endswith(expected)
    assert out[0].info["failure"] is None
    assert out[2].info["failure"] is None


@pytest.mark.parametrize("name", DEGENERATE)
def test_single_points_refuse_with_the_calculators_message(name):
    from nvalchemi_ase.runners import single_points

    bad = DEGENERATE[name]()
    out = single_points([_good(), bad], "lj")
    assert out[1].info["failure"].endswith(_calculator_message(bad))
    assert out[0].get_potential_energy() == pytest.approx(
        NVAlchemiCalculator("lj", device="cpu").calculate_batch([_good()])[0]["energy"],
        abs=1e-10,
    )


def test_relax_paths_refuses_before_interpolating():
    from nvalchemi_ase.mep import relax_paths

    good = _good()
    bad = _near_singular()
    with pytest.raises(StructureError, match=r"paths\[1\]\[0\]\.cell") as caught:
        relax_paths([[good, good.copy()], [bad, bad.copy()]], "lj", n_images=3)
    assert OWN_IMAGE in str(caught.value)
    assert caught.value.index == 1


@pytest.mark.slow
def test_single_points_with_sevennet_refuse_before_sizing():
    from nvalchemi_ase.runners import single_points

    out = single_points([bulk("Si", cubic=True), _tiny_cell()], "sevennet-0")
    assert OWN_IMAGE in out[1].info["failure"]
    assert out[0].info["failure"] is None


def test_cli_calc_refuses_a_degenerate_input(tmp_path, capsys):
    """The command line's main function in this process (a fresh interpreter
    adds ~12 s of CPU, and ``python -m nvalchemi_ase`` is tests/test_cli.py's)."""
    from ase.io import write

    from nvalchemi_ase.cli.main import main

    source = tmp_path / "in.extxyz"
    write(source, [_good(), _tiny_cell()])
    code = main(
        ["calc", str(source), "--model", "lj", "-o", str(tmp_path / "out.extxyz")]
    )
    stderr = capsys.readouterr().err
    assert code != 0
    assert "@1" in stderr
    assert OWN_IMAGE in stderr


@pytest.mark.parametrize("name", DEGENERATE)
def test_property_workflow_fails_only_the_degenerate_material(name):
    from nvalchemi_ase.properties import equation_of_state

    results = equation_of_state([_good(), DEGENERATE[name]()], "lj", n_volumes=5)
    assert results[0].ok
    assert not results[1].ok
    assert OWN_IMAGE in results[1].error
