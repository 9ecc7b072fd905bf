"""Recorded series, plots and progress bars."""

from __future__ import annotations

import numpy as np
import pytest
from ase import units

from nvalchemi_ase.dynamics.recorder import Recorder
from nvalchemi_ase.md import VelocityVerlet
from nvalchemi_ase.optimize import FIRE
from tests.structures import rattled_bulk, slab, thermalize

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_md_series_match_ases_own_numbers(tmp_path, lj_calc64):
    images = [
        thermalize(rattled_bulk(repeat=2), 60.0, seed=1),
        thermalize(slab(), 40.0, seed=2),
    ]
    for atoms in images:
        atoms.calc = lj_calc64
    dyn = VelocityVerlet(images, 2 * units.fs)
    record = Recorder(dyn, interval=5)
    dyn.run(10)
    series = record.as_arrays()
    assert series["step"].tolist() == [0, 5, 10]
    assert series["temperature"].shape == (3, 2)
    np.testing.assert_allclose(
        series["temperature"][-1], [a.get_temperature() for a in images], rtol=1e-12
    )
    np.testing.assert_allclose(
        series["epot_per_atom"][-1],
        [a.get_potential_energy() / len(a) for a in images],
        rtol=1e-12,
    )
    stress = images[0].get_stress(include_ideal_gas=True)
    expected = -stress[:3].mean() / units.GPa
    assert series["pressure_gpa"][-1, 0] == pytest.approx(expected, rel=1e-9)
    assert np.isnan(series["pressure_gpa"][:, 1]).all()  # the slab has no volume
    path = record.plot(tmp_path / "md.png", title="test")
    assert path.read_bytes()[:8] == PNG_MAGIC


def test_relaxation_series_and_plot_bands_for_large_batches(tmp_path, lj_calc64):
    images = [rattled_bulk(repeat=2, seed=s, stdev=0.1) for s in range(14)]
    for atoms in images:
        atoms.calc = lj_calc64
    opt = FIRE(images, logfile=None)
    record = Recorder(opt)
    opt.run(fmax=0.05)
    series = record.as_arrays()
    assert series["fmax"].shape == (opt.nsteps + 1, 14)
    np.testing.assert_allclose(series["fmax"][-1], opt.fmax_per_structure)
    assert (series["fmax"][-1] < 0.05).all()
    path = record.plot(tmp_path / "relax.png")
    assert path.read_bytes()[:8] == PNG_MAGIC
    # without a path: a plot a notebook shows inline, the same picture
    inline = record.plot()
    assert inline._repr_png_()[:8] == PNG_MAGIC
    assert inline.save(tmp_path / "again.png").read_bytes() == path.read_bytes()


def test_progress_bar_goes_to_stderr_only(capfd, lj_calc64):
    atoms = rattled_bulk(repeat=2)
    atoms.calc = lj_calc64
    VelocityVerlet(atoms, units.fs, progress=True).run(5)
    FIRE(atoms, logfile=None, progress=True).run(fmax=0.05, steps=20)
    out, err = capfd.readouterr()
    assert out == ""
    assert "VelocityVerlet" in err
    assert "5/5" in err
    assert "converged 1/1" in err


def test_plotting_leaves_the_callers_backend_and_figures_alone(tmp_path):
    import matplotlib
    import matplotlib.pyplot as plt

    from nvalchemi_ase.plotting import plot_relaxation

    original = matplotlib.get_backend()
    matplotlib.use("svg")  # a user's choice, e.g. a notebook's inline backend
    try:
        figures = plt.get_fignums()
        series = {
            "step": np.arange(5.0),
            "epot_per_atom": np.linspace(0.0, -1.0, 5)[:, None],
            "fmax": np.geomspace(1.0, 0.01, 5)[:, None],
        }
        path = plot_relaxation(series, tmp_path / "relax.png")
        assert path.read_bytes()[:8] == PNG_MAGIC
        assert matplotlib.get_backend() == "svg"
        assert plt.get_fignums() == figures
    finally:
        matplotlib.use(original)
