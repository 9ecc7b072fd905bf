"""The accelerator code paths, forced on the CPU: the same numbers as the host paths.

On a GPU the dynamics never branch on a value read back from the device (a
host read is a synchronisation there): the skin-aware neighbour hook always
runs nvalchemi's own sync-free call, the failure guard repairs every step
without asking "did anything fail" first, and the optimizers' failure
bookkeeping waits for the end of the run. One switch,
:func:`nvalchemi_ase.devices.host_reads_are_free`, makes that choice; forcing
it to False here runs those branches on the CPU. The reference is the host
path on the same structures: paths, step counts and failures must agree.
"""

from __future__ import annotations

import numpy as np
import pytest
from ase import units
from ase.build import bulk

from nvalchemi_ase import NVAlchemiCalculator, devices
from nvalchemi_ase.dynamics.neighbors import is_neighbor_hook
from nvalchemi_ase.md import VelocityVerlet
from nvalchemi_ase.optimize import FIRE
from nvalchemi_ase.runners import relax

# The two paths run the same float64 kernels on the same data: round-off only.
SAME_PATH_ATOL = 1e-12


@pytest.fixture(scope="module")
def lj64():
    return NVAlchemiCalculator("lj", device="cpu", dtype="float64", switch_width=1.0)


def _argon_cells():
    """Argon cells of 4, 32 and 108 atoms, rattled, with Maxwell-Boltzmann momenta."""
    cells = []
    for seed, repeat in enumerate([(1, 1, 1), (2, 2, 2), (3, 3, 3)]):
        atoms = bulk("Ar", "fcc", a=5.26, cubic=True) * repeat
        atoms.rattle(0.08, seed=seed)
        rng = np.random.default_rng(seed)
        atoms.set_momenta(rng.normal(0.0, 0.6, (len(atoms), 3)))
        cells.append(atoms)
    return cells


def _accelerator_path(monkeypatch) -> None:
    monkeypatch.setattr(devices, "host_reads_are_free", lambda device: False)


def _md(calc, steps):
    images = _argon_cells()
    for atoms in images:
        atoms.calc = calc
    dyn = VelocityVerlet(images, 2 * units.fs)
    (hook,) = [h for h in dyn.engine.hooks if is_neighbor_hook(h)]
    dyn.run(steps)
    return images, hook.builds


def test_md_on_the_accelerator_path_equals_the_host_path(lj64, monkeypatch):
    steps = 40
    host, host_builds = _md(lj64, steps)
    _accelerator_path(monkeypatch)
    accelerator, accelerator_builds = _md(lj64, steps)
    for ours, reference in zip(accelerator, host, strict=True):
        assert np.abs(ours.positions - reference.positions).max() < SAME_PATH_ATOL
        assert np.abs(ours.get_momenta() - reference.get_momenta()).max() < (
            SAME_PATH_ATOL
        )
    # the branch was really taken: the host path skips calls while the skin
    # holds, the accelerator path hands every evaluation to nvalchemi
    assert host_builds < steps
    assert accelerator_builds == steps + 1


def _relaxed(calc):
    images = _argon_cells()
    for atoms in images:
        atoms.calc = calc
    opt = FIRE(images)
    opt.run(fmax=1e-3, steps=300)
    return images, opt


def test_optimizer_on_the_accelerator_path_equals_the_host_path(lj64, monkeypatch):
    host, host_opt = _relaxed(lj64)
    _accelerator_path(monkeypatch)
    accelerator, accelerator_opt = _relaxed(lj64)
    assert np.array_equal(accelerator_opt.converged_mask, host_opt.converged_mask)
    assert host_opt.converged_mask.all()
    assert list(accelerator_opt.converged_at_step) == list(host_opt.converged_at_step)
    for ours, reference in zip(accelerator, host, strict=True):
        assert np.abs(ours.positions - reference.positions).max() < SAME_PATH_ATOL


def test_runner_on_the_accelerator_path_equals_the_host_path(lj64, monkeypatch):
    # at most 120 atoms: the 4- and 32-atom cells first, the 108-atom cell
    # admitted once they finished, so a refill happens on both paths
    host = relax(_argon_cells(), lj64, fmax=1e-3, max_atoms=120)
    _accelerator_path(monkeypatch)
    accelerator = relax(_argon_cells(), lj64, fmax=1e-3, max_atoms=120)
    assert len(accelerator) == len(host) == 3
    for ours, reference in zip(accelerator, host, strict=True):
        assert ours.info["converged"]
        assert reference.info["converged"]
        assert ours.info["steps"] == reference.info["steps"]
        assert np.abs(ours.positions - reference.positions).max() < SAME_PATH_ATOL
