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

# float64, each structure's forces independent of the batch it is in: the
# pipeline and the fused run agree to round-off.
ENERGY_ATOL = 1e-10  # eV
POSITION_ATOL = 1e-8  # Å
MOMENTUM_ATOL = 1e-8  # amu Å / ASE time unit
FORCE_ATOL = 1e-8  # eV/Å
# Rank 0's sampler batches these as [s1, s2, s0], the fused run as given:
# the same order up to s0, which relaxes in one step; s1 and s2 overlap in MD.
ORDER = [1, 0, 2]


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


def _assert_same(got: dict, expected: dict) -> None:
    np.testing.assert_allclose(got["energies"], expected["energies"], atol=ENERGY_ATOL)
    for key, atol in (
        ("positions", POSITION_ATOL),
        ("momenta", MOMENTUM_ATOL),
        ("forces", FORCE_ATOL),
    ):
        np.testing.assert_allclose(got[key], expected[key], atol=atol, err_msg=key)


@pytest.mark.slow  # two ranks started by torchrun (~25 s)
@pytest.mark.parametrize("optimizer", ["FIRE2", "FIRE"])
def test_two_ranks_give_every_rank_what_the_fused_run_gives(optimizer, tmp_path):
    """Relaxed on rank 0, sent to rank 1 at the fused run's step, MD, results back."""
    expected = _fused(optimizer, ORDER)
    assert len(set(expected["relax_steps"].tolist())) == 3  # three hand-over steps
    for got in _pipelined(optimizer, ORDER, tmp_path):  # rank 0, rank 1
        assert bool(got["done"])
        assert got["stage"].tolist() == [FINISHED] * 3
        assert got["relax_steps"].tolist() == expected["relax_steps"].tolist()
        _assert_same(got, expected)


def _per_structure(result: dict, sizes: list[int]) -> list[dict]:
    """Split a :func:`~tests.pipeline_worker.state` into one dict per structure."""
    ends = np.cumsum(sizes)
    return [
        {
            "energy": result["energies"][index],
            "relax_steps": int(result["relax_steps"][index]),
            **{
                key: result[key][end - size : end]
                for key in ("positions", "momenta", "forces")
            },
        }
        for index, (size, end) in enumerate(zip(sizes, ends, strict=True))
    ]


@pytest.mark.slow
def test_rank_0_relaxes_the_batch_in_the_samplers_order(tmp_path):
    """Given [s0, s1, s2], rank 0's sampler batches [s0, s2, s1] (bins by size).

    nvalchemi's FIRE2 step is not bit-independent of a structure's place in
    the batch, and FIRE's discrete decisions amplify the round-off: ``+`` on
    [s0, s2, s1] moves s1 by ~2e-4 Å from ``+`` on [s0, s1, s2]. The pipeline
    is the fused run of the batch it actually runs.
    """
    order, batched = [0, 1, 2], [0, 2, 1]
    got = _pipelined("FIRE2", order, tmp_path)[0]
    sizes = [len(atoms) for atoms in images(None, order)]
    pipelined = _per_structure(got, sizes)
    fused = _per_structure(_fused("FIRE2", batched), [sizes[i] for i in batched])
    for position, index in enumerate(batched):
        mine, reference = pipelined[index], fused[position]
        assert mine["relax_steps"] == reference["relax_steps"]
        assert mine["energy"] == pytest.approx(reference["energy"], abs=ENERGY_ATOL)
        for key, atol in (
            ("positions", POSITION_ATOL),
            ("momenta", MOMENTUM_ATOL),
            ("forces", FORCE_ATOL),
        ):
            np.testing.assert_allclose(mine[key], reference[key], atol=atol)


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
