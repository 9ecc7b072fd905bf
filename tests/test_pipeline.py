"""``optimizer | md``: relax on rank 0, MD on rank 1 (nvalchemi's DistributedPipeline).

Reference: the single-process ``optimizer + md`` on the same structures
(float64, LJ, deterministic velocity Verlet). Ranks are started by
``torch.distributed.run`` (gloo, CPU, 2 ranks) in a subprocess, as a user
starts them (:func:`tests.helpers.torchrun`).
"""

from __future__ import annotations

import numpy as np
import pytest
from ase.constraints import FixAtoms

from nvalchemi_ase import NVAlchemiCalculator, md, optimize
from nvalchemi_ase.compose import FINISHED
from nvalchemi_ase.pipeline import RelaxThenMDPipeline
from tests.helpers import torchrun
from tests.pipeline_worker import PIPE, TIMESTEP, images, state

# Round-off: float64, each structure's forces independent of its batch (one
# structure through the two ranks matches ``+`` to 1e-15 eV).
ENERGY_ATOL = 1e-10  # eV
POSITION_ATOL = 1e-8  # Å
MOMENTUM_ATOL = 1e-8  # amu Å / ASE time unit
# What two ranks give today with more than one structure: NOT round-off. A
# structure's final state moves by up to 1.1e-5 eV and 2e-4 Å from the fused
# run's (FIRE2 and FIRE, same hand-over steps), depending on which other
# structures passed through the ranks before it; cause not found (the strict
# xfail below fails as soon as the two agree to round-off).
PIPELINE_ENERGY_ATOL = 1e-4  # eV
PIPELINE_POSITION_ATOL = 1e-3  # Å
PIPELINE_MOMENTUM_ATOL = 1e-2  # amu Å / ASE time unit (the momenta: ~0.1-1)
ORDER = [1, 0, 2]  # three hand-over steps (FIRE2: 26, 1 and 29 steps)


def _fused(optimizer: str, order: list[int]) -> dict[str, np.ndarray]:
    """The single-process ``optimizer + md``, with each structure's hand-over step."""
    calc = NVAlchemiCalculator("lj", device="cpu", dtype="float64")
    structures = images(calc, order)
    fused = getattr(optimize, optimizer)(structures, logfile=None).then(
        md.VelocityVerlet(structures, TIMESTEP), **PIPE
    )
    history = []
    fused.attach(lambda: history.append(fused.stage.copy()))
    assert fused.run(1000)
    stages = np.array(history)  # (steps + 1, B)
    handed_over = [int(np.flatnonzero(column >= 1)[0]) for column in stages.T]
    return state(structures, fused.stage, handed_over)


def _pipelined(optimizer: str, order: list[int], folder) -> list[dict]:
    """What each rank's ``Atoms`` hold after ``optimizer | md`` on two ranks."""
    indices = ",".join(str(index) for index in order)
    torchrun("-m", "tests.pipeline_worker", optimizer, indices, str(folder))
    return [dict(np.load(folder / f"rank{rank}.npz")) for rank in (0, 1)]


def _assert_close(got: dict, expected: dict, energy: float, position: float) -> None:
    np.testing.assert_allclose(got["energies"], expected["energies"], atol=energy)
    np.testing.assert_allclose(got["positions"], expected["positions"], atol=position)


@pytest.mark.slow  # two ranks started by torchrun (~25 s)
@pytest.mark.parametrize("optimizer", ["FIRE2", "FIRE"])
def test_two_ranks_hand_over_where_the_fused_run_does(optimizer, tmp_path):
    """Relaxed on rank 0, sent to rank 1 at the fused run's step, MD, results back."""
    expected = _fused(optimizer, ORDER)
    assert len(set(expected["relax_steps"].tolist())) == 3
    ranks = _pipelined(optimizer, ORDER, tmp_path)
    for got in ranks:  # every rank's Atoms hold every structure's final state
        assert bool(got["done"])
        assert got["stage"].tolist() == [FINISHED] * 3
        assert got["relax_steps"].tolist() == expected["relax_steps"].tolist()
        _assert_close(got, expected, PIPELINE_ENERGY_ATOL, PIPELINE_POSITION_ATOL)
        np.testing.assert_allclose(
            got["momenta"], expected["momenta"], atol=PIPELINE_MOMENTUM_ATOL
        )
    for key in ("positions", "momenta", "forces", "energies"):
        np.testing.assert_array_equal(ranks[0][key], ranks[1][key])


@pytest.mark.slow
def test_one_structure_goes_through_both_ranks_to_round_off(tmp_path):
    expected = _fused("FIRE2", [1])
    got = _pipelined("FIRE2", [1], tmp_path)[0]
    assert got["relax_steps"].tolist() == expected["relax_steps"].tolist() == [26]
    _assert_close(got, expected, ENERGY_ATOL, POSITION_ATOL)
    np.testing.assert_allclose(got["momenta"], expected["momenta"], atol=MOMENTUM_ATOL)


@pytest.mark.slow
@pytest.mark.xfail(
    strict=True,
    reason="open: with several structures, two ranks leave the fused run by up "
    "to 1.1e-5 eV / 2e-4 Å (not round-off; same hand-over steps); see "
    "PIPELINE_ENERGY_ATOL",
)
def test_several_structures_go_through_both_ranks_to_round_off(tmp_path):
    expected = _fused("FIRE2", ORDER)
    got = _pipelined("FIRE2", ORDER, tmp_path)[0]
    _assert_close(got, expected, ENERGY_ATOL, POSITION_ATOL)


# -- one process -------------------------------------------------------------


def _parts(calc):
    structures = images(calc, [0, 1, 2])
    relax = optimize.FIRE2(structures, logfile=None)
    return structures, relax, md.VelocityVerlet(structures, TIMESTEP)


def test_or_builds_the_pipeline_with_the_fused_defaults(lj_calc64):
    _, relax, integrate = _parts(lj_calc64)
    pipeline = relax | integrate
    assert isinstance(pipeline, RelaxThenMDPipeline)
    assert (pipeline.fmax, pipeline.md_steps) == (0.05, None)
    assert pipeline.todict()["type"] == "relax-then-md-pipeline"


def test_run_outside_torchrun_says_how_to_start_it(lj_calc64, monkeypatch):
    for name in ("WORLD_SIZE", "MASTER_ADDR", "RANK"):
        monkeypatch.delenv(name, raising=False)
    _, relax, integrate = _parts(lj_calc64)
    with pytest.raises(RuntimeError, match=r"distributed\.run --nproc_per_node=2"):
        relax.pipe(integrate, md_steps=5).run()


def test_the_pipeline_checks_its_parts(lj_calc64):
    structures, relax, integrate = _parts(lj_calc64)
    with pytest.raises(TypeError, match=r"relax \| md needs an nvalchemi_ase"):
        relax | relax
    with pytest.raises(ValueError, match="md_steps must be >= 1"):
        relax.pipe(integrate, md_steps=0)
    structures[0].set_constraint(FixAtoms([0]))
    with pytest.raises(ValueError, match=r"ASE constraints \(structures \[0\]"):
        optimize.FIRE2(structures, logfile=None) | md.VelocityVerlet(
            structures, TIMESTEP
        )
