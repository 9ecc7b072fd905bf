"""MTK NPT with one-link Nosé-Hoover chains: finite, reproducible, independent.

nvalchemiops 0.5's chain kernel reads ``eta_dot[s, 1]`` even when the chain has
one link: past the end of the engine's ``[B, 1]`` chain velocities, i.e. heap
memory for the last structure (NaN after one step in most fresh processes) and
the next structure's thermostat for the others. ``nvalchemi_ase.engines.mtk``
gives a one-link chain a frozen second link (each chain by its own length). What
the heap holds depends on the process, so reproducibility is checked across fresh
interpreters; the coupling between structures of a batch shows in one.
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from ase import units
from ase.build import bulk

from nvalchemi_ase.md import MTKNPT, NPH, IsotropicMTKNPT
from tests.structures import A_AR, thermalize

ROOT = Path(__file__).resolve().parents[1]
# Each process reads its own heap (before the fix ~80 % of runs went NaN); each
# runs every class on SEEDS fresh engines (new allocations, new bytes past the
# end), so 2 processes make 2 x 3 chances a class where 4 processes of one run
# each made 4, at half the CPU (an interpreter costs ~15 s of CPU, a run ms).
PROCESSES = 2
POOL = 2  # the machine's cores
SEEDS = 3
STEPS = 5
DEPRECATED = ("'cells_inv' is deprecated", "'volumes' is deprecated")

# One fresh interpreter: IsotropicMTKNPT and MTKNPT, tchain = pchain = 1, each on
# SEEDS thermalised argon cells in turn (a new engine each); prints a JSON line
# with the final states.
WORKER = r"""
import json, sys, warnings
import numpy as np
from ase import units
from ase.build import bulk
from nvalchemi_ase import NVAlchemiCalculator
from nvalchemi_ase.md import MTKNPT, IsotropicMTKNPT
from tests.structures import A_AR, thermalize

steps, seeds = int(sys.argv[1]), int(sys.argv[2])
calc = NVAlchemiCalculator("lj", device="cpu", dtype="float64")
out = {}
for cls in (IsotropicMTKNPT, MTKNPT):
    for seed in range(seeds):
        cube = bulk("Ar", "fcc", a=A_AR, cubic=True) * (2, 2, 2)
        atoms = thermalize(cube, 300.0, seed)
        atoms.calc = calc
        volume = atoms.get_volume()
        dyn = cls(atoms, 2 * units.fs, temperature_K=300.0, pressure_au=0.0,
                  tdamp=100 * units.fs, pdamp=1000 * units.fs, tchain=1, pchain=1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dyn.run(steps)
        out[f"{cls.__name__}, seed {seed}"] = {
            "positions": atoms.positions.tobytes().hex(),
            "cell": atoms.cell.array.tobytes().hex(),
            "initial_volume": volume,
            "failures": len(getattr(dyn, "failures", [])),
            "warnings": sorted(
                {f"{w.category.__name__}: {w.message}" for w in caught}
            ),
        }
print("RESULT " + json.dumps(out))
"""


def _fresh_process_run(_: int) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", WORKER, str(STEPS), str(SEEDS)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0, done.stderr[-3000:]
    assert lines, done.stdout[-3000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


def _decode(hex_bytes: str, shape: tuple[int, ...] = (-1, 3)) -> np.ndarray:
    return np.frombuffer(bytes.fromhex(hex_bytes), dtype=np.float64).reshape(shape)


def _argon(seed: int = 0):
    return thermalize(bulk("Ar", "fcc", a=A_AR, cubic=True) * (2, 2, 2), 300.0, seed)


def _npt(cls, images, calc, **kwargs):
    for atoms in images if isinstance(images, list) else [images]:
        atoms.calc = calc
    return cls(
        images,
        2 * units.fs,
        temperature_K=300.0,
        pressure_au=0.0,
        tdamp=100 * units.fs,
        pdamp=1000 * units.fs,
        **kwargs,
    )


@pytest.mark.slow  # 2 interpreters, ~15 s of CPU each (imports included)
def test_one_link_chains_are_finite_and_identical_in_fresh_processes():
    with ThreadPoolExecutor(max_workers=POOL) as pool:
        results = list(pool.map(_fresh_process_run, range(PROCESSES)))
    classes = ("IsotropicMTKNPT", "MTKNPT")
    names = [f"{name}, seed {seed}" for name in classes for seed in range(SEEDS)]
    assert sorted(results[0]) == sorted(names)
    for name in names:
        runs = [result[name] for result in results]
        for process, run in enumerate(runs):
            positions, cell = _decode(run["positions"]), _decode(run["cell"])
            where = f"{name}, process {process}"
            assert np.isfinite(positions).all(), where
            assert np.isfinite(cell).all(), where
            assert run["failures"] == 0, where
            # the structure was integrated (a failed one keeps its initial state)
            assert abs(np.linalg.det(cell)) != run["initial_volume"], where
            assert not [w for w in run["warnings"] if "StructureFailed" in w], where
            assert not [w for w in run["warnings"] if any(m in w for m in DEPRECATED)]
        for process, run in enumerate(runs[1:], start=1):
            np.testing.assert_array_equal(
                _decode(run["positions"]),
                _decode(runs[0]["positions"]),
                err_msg=f"{name}: process {process} differs from process 0",
            )
            np.testing.assert_array_equal(
                _decode(run["cell"]), _decode(runs[0]["cell"])
            )


@pytest.mark.parametrize(("tchain", "pchain"), [(1, 1), (1, 3), (3, 1)])
@pytest.mark.parametrize("cls", [IsotropicMTKNPT, MTKNPT])
def test_one_link_chains_of_a_batch_do_not_couple(cls, tchain, pchain, lj_calc64):
    chains = {"tchain": tchain, "pchain": pchain}
    alone = _argon(seed=0)
    _npt(cls, alone, lj_calc64, **chains).run(STEPS)
    pair = [_argon(seed=0), _argon(seed=1)]
    _npt(cls, pair, lj_calc64, **chains).run(STEPS)
    assert np.isfinite(alone.positions).all()
    np.testing.assert_array_equal(pair[0].positions, alone.positions)
    np.testing.assert_array_equal(pair[0].cell.array, alone.cell.array)


def test_longer_chains_are_left_alone(lj_calc64):
    atoms = _argon()
    dyn = _npt(IsotropicMTKNPT, atoms, lj_calc64, tchain=3, pchain=3)
    dyn.run(2)
    state = dyn.engine._state
    for key in ("nhc_eta_dot", "nhc_b_eta_dot"):
        assert getattr(state, key).is_contiguous()
    assert np.isfinite(atoms.positions).all()


@pytest.mark.parametrize(
    ("tchain", "pchain", "padded"),
    [(1, 3, "nhc_eta_dot"), (3, 1, "nhc_b_eta_dot")],
)
def test_only_the_one_link_chain_is_padded(tchain, pchain, padded, lj_calc64):
    atoms = _argon()
    dyn = _npt(MTKNPT, atoms, lj_calc64, tchain=tchain, pchain=pchain)
    dyn.run(2)
    state = dyn.engine._state
    for key in ("nhc_eta_dot", "nhc_b_eta_dot"):
        velocities = getattr(state, key)
        if key == padded:
            assert velocities.shape == (1, 1)
            assert velocities.stride() == (2, 1)  # a view of the [1, 2] buffer
        else:
            assert velocities.is_contiguous()
    assert np.isfinite(atoms.positions).all()


def test_kernel_deprecations_are_silenced_locally(lj_calc64):
    before = list(warnings.filters)
    atoms = _argon()
    npt = _npt(IsotropicMTKNPT, atoms, lj_calc64, tchain=1, pchain=1)
    nph_atoms = _argon()
    nph_atoms.calc = lj_calc64
    nph = NPH(nph_atoms, 2 * units.fs, pressure_au=0.0, pdamp=1000 * units.fs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # overrides pytest's ignore entries
        npt.run(2)
        nph.run(2)
    assert [w for w in caught if any(m in str(w.message) for m in DEPRECATED)] == []
    assert warnings.filters == before


@pytest.mark.parametrize("tchain", [0, -1])
def test_chains_need_a_link(tchain, lj_calc64):
    with pytest.raises(ValueError, match="must be >= 1"):
        _npt(IsotropicMTKNPT, _argon(), lj_calc64, tchain=tchain, pchain=tchain)
