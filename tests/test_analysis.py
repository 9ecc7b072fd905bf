"""Per-structure MD analysis: RDF, MSD, VACF, stress ACF, from files and streamed."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ase import Atoms, units
from ase.build import bulk
from ase.geometry.rdf import get_rdf
from ase.io import write

from nvalchemi_ase.analysis import (
    RDFObserver,
    TransportObserver,
    mean_squared_displacement,
    radial_distribution,
    shear_viscosity,
    velocity_autocorrelation,
)
from nvalchemi_ase.analysis.correlation import WindowedLagSums, lag_sums

# Two computations of the same sums in another order (FFT vs direct, files vs
# streamed, ours vs ASE's histogram): float64 round-off only.
ROUND_OFF = 1e-10
# Agreement of two independent estimates within their combined error bars.
SIGMAS = 3.0


def rattled_frames(atoms: Atoms, count: int, seed: int) -> list[Atoms]:
    rng = np.random.default_rng(seed)
    frames = []
    for _ in range(count):
        frame = atoms.copy()
        frame.positions += rng.normal(scale=0.15, size=frame.positions.shape)
        frames.append(frame)
    return frames


def mixed_structures() -> list[list[Atoms]]:
    """Three structures of different sizes, elements and cell shapes, 3 frames each."""
    nacl = bulk("NaCl", "rocksalt", a=5.64, cubic=True).repeat(2)  # 64 atoms
    skewed = bulk("Ar", "fcc", a=5.3, cubic=True).repeat((2, 2, 2))  # 32 atoms
    skewed.set_cell(
        skewed.cell.array + np.array([[0, 0, 0], [1.5, 0, 0], [0.8, 0.6, 0]])
    )
    skewed.symbols[::4] = "Kr"
    triple = bulk("MgO", "rocksalt", a=4.2, cubic=True).repeat((3, 3, 2))
    triple.symbols[::5] = "Ca"  # Mg, O, Ca
    return [
        rattled_frames(nacl, 3, 0),
        rattled_frames(skewed, 3, 1),
        rattled_frames(triple, 3, 2),
    ]


# -- RDF ----------------------------------------------------------------------------


def test_rdf_equals_ase_for_every_structure_and_element_pair():
    structures = mixed_structures()
    results = radial_distribution(structures, rmax=4.0, nbins=40)
    assert len(results) == 3
    for frames, result in zip(structures, results, strict=True):
        reference, r = get_rdf(frames, 4.0, 40)
        np.testing.assert_allclose(result.r, r, rtol=0, atol=ROUND_OFF)
        np.testing.assert_allclose(result.g, reference, rtol=0, atol=ROUND_OFF)
        symbols = sorted(set(frames[0].get_chemical_symbols()))
        expected_pairs = len(symbols) * (len(symbols) + 1) // 2
        assert len(result.partial) == expected_pairs
        for (a, b), g_ab in result.partial.items():
            for pair in ((a, b), (b, a)):  # ASE's g_ab = g_ba
                partial, _ = get_rdf(frames, 4.0, 40, elements=pair)
                np.testing.assert_allclose(g_ab, partial, rtol=0, atol=ROUND_OFF)
        assert result.g.max() > 1.0  # a structured solid, not an empty histogram


def test_rdf_of_a_strongly_skewed_cell_up_to_half_its_width_equals_ase():
    """Only the wrapped image is counted: exact up to rmax = half the width."""
    atoms = bulk("Ar", "fcc", a=5.3, cubic=True).repeat((2, 2, 2))
    atoms.set_cell(
        atoms.cell.array + np.array([[0, 0, 0], [6.0, 0, 0], [4.5, 5.0, 0]]),
        scale_atoms=True,
    )
    frames = rattled_frames(atoms, 4, 3)
    rmax = (
        0.999
        * float(
            np.min(
                atoms.cell.volume
                / np.linalg.norm(
                    np.cross(
                        np.roll(atoms.cell.array, -1, 0),
                        np.roll(atoms.cell.array, -2, 0),
                    ),
                    axis=1,
                )
            )
        )
        / 2
    )
    result = radial_distribution([frames], rmax=rmax, nbins=60)[0]
    reference, _ = get_rdf(frames, rmax, 60)
    np.testing.assert_allclose(result.g, reference, rtol=0, atol=ROUND_OFF)
    assert result.g[-10:].sum() > 0  # pairs near rmax were counted


def test_rdf_refuses_rmax_beyond_half_the_cell_naming_the_structure():
    structures = mixed_structures()
    with pytest.raises(ValueError, match=r"trajectories\[2\].*rmax=5 Å .* axis 2"):
        radial_distribution(structures, rmax=5.0, nbins=10)


# -- the lag-sum kernel ---------------------------------------------------------


@pytest.mark.parametrize("kind", ["product", "msd"])
def test_fft_and_streamed_lag_sums_equal_direct_sums(kind):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(37, 5, 3, generator=generator, dtype=torch.float64)
    groups = torch.tensor([0, 1, 1, 2, 0])
    window, block = 6, 9
    direct = np.zeros((window, 3))
    values = x.numpy()
    for lag in range(window):
        for origin in range(37 - lag):
            a, b = values[origin], values[origin + lag]
            term = (a * b).sum(1) if kind == "product" else ((b - a) ** 2).sum(1)
            np.add.at(direct[lag], groups.numpy(), term)
    by_fft = lag_sums(x, groups, 3, window, block, kind)
    streamed = WindowedLagSums(groups, 3, window, block, kind)
    for sample in x:
        streamed.update(sample)
    by_stream = streamed.result()
    scale = np.abs(direct).max()
    np.testing.assert_allclose(by_fft.total.numpy(), direct, atol=ROUND_OFF * scale)
    np.testing.assert_allclose(by_stream.total.numpy(), direct, atol=ROUND_OFF * scale)
    assert by_fft.blocks.shape == (37 // block, window, 3)
    np.testing.assert_allclose(
        by_stream.blocks.numpy(), by_fft.blocks.numpy(), atol=ROUND_OFF * scale
    )
    np.testing.assert_array_equal(by_fft.counts.numpy(), 37 - np.arange(window))


# -- MSD, VACF: analytic references ---------------------------------------------------


def ballistic(symbols: str, box: np.ndarray, count: int, seed: int, step_fs: float):
    """Atoms moving at constant velocity (zero total momentum), wrapped each frame."""
    atoms = Atoms(symbols, cell=box, pbc=True)
    rng = np.random.default_rng(seed)
    velocities = rng.normal(scale=0.05, size=(len(atoms), 3))  # Å/fs
    masses = atoms.get_masses()
    velocities -= (masses @ velocities) / masses.sum()
    start = rng.uniform(0, 1, size=(len(atoms), 3)) @ np.asarray(box)
    frames = []
    for frame in range(count):
        moved = atoms.copy()
        moved.positions = start + velocities * frame * step_fs
        moved.set_velocities(velocities / units.fs)  # ASE units
        moved.wrap()
        frames.append(moved)
    return frames, velocities


def test_msd_of_ballistic_motion_is_v2_t2_per_structure_and_element_across_wraps():
    step_fs = 10.0
    skewed = np.array([[8.0, 0, 0], [3.0, 7.0, 0], [1.0, 2.0, 9.0]])
    one, v_one = ballistic("Ar6Kr2", skewed, 40, 0, step_fs)
    two, v_two = ballistic("Ne3", np.diag([6.0, 7.0, 8.0]), 30, 1, step_fs)
    # an atom crosses the boundary many times: 40 frames × up to ~0.15 Å/fs × 10 fs
    results = mean_squared_displacement(
        [one, two], frame_interval=step_fs * units.fs, window=20, block_length=20
    )
    for frames, velocities, result in zip(
        [one, two], [v_one, v_two], results, strict=True
    ):
        lag = np.arange(20) * step_fs
        np.testing.assert_allclose(result.lag_fs, lag, rtol=0, atol=ROUND_OFF)
        speed2 = (velocities**2).sum(1)
        np.testing.assert_allclose(
            result.curve, speed2.mean() * lag**2, rtol=ROUND_OFF, atol=ROUND_OFF
        )
        symbols = np.array(frames[0].get_chemical_symbols())
        for symbol, curve in result.curve_by_element.items():
            expected = speed2[symbols == symbol].mean() * lag**2
            np.testing.assert_allclose(curve, expected, rtol=ROUND_OFF, atol=ROUND_OFF)
    assert set(results[0].curve_by_element) == {"Ar", "Kr"}


def test_drift_removal_keeps_relative_motion_only():
    frames, velocities = ballistic("Ar4", np.diag([9.0, 9.0, 9.0]), 20, 3, 5.0)
    drift = np.array([0.02, -0.01, 0.03])  # Å/fs, added to every atom
    for index, frame in enumerate(frames):
        frame.positions += drift * index * 5.0
        frame.set_velocities((velocities + drift) / units.fs)
    kept = mean_squared_displacement(
        [frames], 5.0 * units.fs, window=10, block_length=10
    )[0]
    raw = mean_squared_displacement(
        [frames], 5.0 * units.fs, window=10, block_length=10, remove_drift=False
    )[0]
    lag = np.arange(10) * 5.0
    np.testing.assert_allclose(
        kept.curve, (velocities**2).sum(1).mean() * lag**2, atol=ROUND_OFF
    )
    np.testing.assert_allclose(
        raw.curve, ((velocities + drift) ** 2).sum(1).mean() * lag**2, atol=ROUND_OFF
    )


def test_vacf_of_constant_velocities_and_its_green_kubo_integral():
    step_fs = 2.0
    frames, velocities = ballistic(
        "Ar3Xe2", np.diag([10.0, 10.0, 10.0]), 25, 4, step_fs
    )
    result = velocity_autocorrelation(
        [frames], step_fs * units.fs, window=12, block_length=12
    )[0]
    mean_v2 = (velocities**2).sum(1).mean()  # Å²/fs²
    np.testing.assert_allclose(result.curve, np.full(12, mean_v2), rtol=ROUND_OFF)
    lag = np.arange(12) * step_fs
    np.testing.assert_allclose(result.running_diffusion, mean_v2 * lag / 3, rtol=1e-9)
    assert result.diffusion == pytest.approx(mean_v2 * lag[-1] / 3, rel=ROUND_OFF)
    assert result.window_fs == (0.0, lag[-1])
    assert result.n_blocks == 2
    assert result.diffusion_error == pytest.approx(0.0, abs=ROUND_OFF * mean_v2)


def test_random_walk_gives_its_diffusion_coefficient_within_the_block_error():
    rng = np.random.default_rng(7)
    n_atoms, n_frames, sigma, step_fs = 400, 600, 0.05, 4.0  # σ Å per axis per frame
    walk = np.cumsum(rng.normal(scale=sigma, size=(n_frames, n_atoms, 3)), axis=0)
    box = 20.0
    frames = [
        Atoms(f"Ar{n_atoms}", positions=position, cell=[box] * 3, pbc=True)
        for position in walk
    ]
    for frame in frames:
        frame.wrap()
    expected = sigma**2 / (2 * step_fs)  # D = σ² / (2 Δt), Å²/fs
    result = mean_squared_displacement(
        [frames], step_fs * units.fs, window=60, block_length=120, remove_drift=False
    )[0]
    assert result.n_blocks == 5
    assert 0 < result.diffusion_error < 0.1 * expected
    assert abs(result.diffusion - expected) < SIGMAS * result.diffusion_error
    lag = result.lag_fs
    np.testing.assert_allclose(result.curve[1:], 6 * expected * lag[1:], rtol=0.05)
    assert result.diffusion_cm2_s == pytest.approx(result.diffusion * 0.1)


# -- viscosity: the formula against SI by hand ---------------------------------------


def test_viscosity_equals_the_green_kubo_formula_in_si_units():
    rng = np.random.default_rng(3)
    atoms = bulk("Ar", "fcc", a=5.3, cubic=True)
    atoms.set_momenta(np.zeros((4, 3)))
    n_frames, window, step_fs, temperature = 64, 16, 5.0, 90.0
    raw = rng.normal(scale=1e-3, size=(n_frames, 3, 3))
    stress = 0.5 * (raw + raw.transpose(0, 2, 1))  # eV/Å³
    frames = []
    from ase.calculators.singlepoint import SinglePointCalculator

    for value in stress:
        frame = atoms.copy()
        frame.calc = SinglePointCalculator(
            frame, energy=0.0, forces=np.zeros((4, 3)), stress=value
        )
        frames.append(frame)
    result = shear_viscosity(
        [frames],
        step_fs * units.fs,
        window=window,
        block_length=32,
        temperature_K=temperature,
    )[0]
    # by hand: P = -σ (no kinetic part), Q its traceless part, C = Σ_ab <QQ> / 10
    q = -stress - np.trace(-stress, axis1=1, axis2=2)[:, None, None] / 3 * np.eye(3)
    acf = np.array(
        [
            np.mean([(q[t] * q[t + k]).sum() for t in range(n_frames - k)]) / 10
            for k in range(window)
        ]
    )
    np.testing.assert_allclose(result.acf, acf, rtol=1e-9)
    e, angstrom, k_b = 1.602176634e-19, 1e-10, 1.380649e-23  # SI (CODATA 2018)
    pascal_per_ev_a3 = e / angstrom**3
    integral = np.sum(0.5 * (acf[1:] + acf[:-1])) * step_fs * 1e-15  # (eV/Å³)² s
    volume = atoms.get_volume() * angstrom**3
    eta_si = volume / (k_b * temperature) * integral * pascal_per_ev_a3**2
    assert result.viscosity == pytest.approx(eta_si * 1e3, rel=1e-6)  # mPa·s


# -- streamed = from files, on the package's own batched MD -------------------


@pytest.fixture(scope="module")
def streamed_run(tmp_path_factory, lj_calc64):
    from nvalchemi_ase.md import VelocityVerlet

    directory = tmp_path_factory.mktemp("md")
    cell = bulk("Ar", "fcc", a=5.74, cubic=True)
    images = [cell.repeat(2), cell.repeat((3, 2, 2))]
    images[1].symbols[::3] = "Kr"
    for index, atoms in enumerate(images):
        atoms.rattle(0.15, seed=index)
        rng = np.random.default_rng(index)
        masses = atoms.get_masses()[:, None]
        atoms.set_momenta(rng.normal(size=(len(atoms), 3)) * np.sqrt(masses * 0.02))
        atoms.calc = lj_calc64
    dyn = VelocityVerlet(
        images,
        5 * units.fs,
        trajectory=str(directory / "md_{i}.traj"),
        loginterval=2,
    )
    transport = TransportObserver(dyn, window=6, block_length=7)
    rdf = RDFObserver(dyn, rmax=5.5, nbins=30)
    dyn.attach(transport, interval=2)
    dyn.attach(rdf, interval=2)
    dyn.run(40)
    paths = [directory / f"md_{i}.traj" for i in range(2)]
    return transport, rdf, paths


def test_streamed_msd_and_vacf_equal_the_trajectory_analysis(streamed_run):
    transport, _, paths = streamed_run
    options = {"window": 6, "block_length": 7}
    for streamed, from_file in (
        (transport.msd(), mean_squared_displacement(paths, **options)),
        (transport.vacf(), velocity_autocorrelation(paths, **options)),
    ):
        for a, b in zip(streamed, from_file, strict=True):
            scale = np.abs(b.curve).max()
            np.testing.assert_allclose(a.lag_fs, b.lag_fs, rtol=ROUND_OFF)
            np.testing.assert_allclose(a.curve, b.curve, atol=ROUND_OFF * scale)
            for symbol, curve in b.curve_by_element.items():
                np.testing.assert_allclose(
                    a.curve_by_element[symbol], curve, atol=ROUND_OFF * scale
                )
            assert a.diffusion == pytest.approx(b.diffusion, rel=1e-8)
            assert a.diffusion_error == pytest.approx(b.diffusion_error, rel=1e-6)
            assert a.n_blocks == b.n_blocks == 3
    assert set(transport.msd()[1].curve_by_element) == {"Ar", "Kr"}


def test_streamed_viscosity_and_rdf_equal_the_trajectory_analysis(streamed_run):
    transport, rdf, paths = streamed_run
    for a, b in zip(
        transport.viscosity(),
        shear_viscosity(paths, window=6, block_length=7),
        strict=True,
    ):
        np.testing.assert_allclose(a.acf, b.acf, atol=ROUND_OFF * np.abs(b.acf).max())
        assert a.viscosity == pytest.approx(b.viscosity, rel=1e-8)
        assert a.temperature_K == pytest.approx(b.temperature_K, rel=1e-10)
        assert a.volume == pytest.approx(b.volume, rel=1e-12)
    for a, b in zip(rdf.result(), radial_distribution(paths, 5.5, 30), strict=True):
        np.testing.assert_allclose(a.g, b.g, atol=ROUND_OFF)
        assert a.partial.keys() == b.partial.keys()
        for key, value in b.partial.items():
            np.testing.assert_allclose(a.partial[key], value, atol=ROUND_OFF)
        assert a.n_frames == b.n_frames == 21


# -- physics: liquid argon -----------------------------------------------------------


#: Self-diffusion of liquid argon (LJ ε/kB = 120 K, σ = 3.4 Å) at 94.4 K and
#: 1.374 g/cm³: 2.43e-5 cm²/s (A. Rahman, Phys. Rev. 136, A405 (1964), 864
#: atoms), matching experiment near the triple point (2.43e-5 at 90 K, quoted
#: there). Our cell (108 atoms, L = 17.2 Å) lowers D by the Yeh–Hummer
#: finite-size term kB T ξ / (6 π η L) ≈ 0.4e-5 cm²/s (η ≈ 0.27 mPa·s; J. Phys.
#: Chem. B 108, 15873 (2004)), and 10 ps per structure leaves ~10 % statistical
#: error: the test accepts 1.5–3.0e-5.
ARGON_D_RANGE_CM2_S = (1.5e-5, 3.0e-5)


@pytest.mark.slow  # ~1-4 min on 2 CPU cores: melt, equilibrate, 10 ps of NVE
def test_einstein_and_green_kubo_diffusion_agree_for_liquid_argon():
    from nvalchemi_ase import NVAlchemiCalculator
    from nvalchemi_ase.md import Langevin, VelocityVerlet

    calc = NVAlchemiCalculator("lj", device="cpu", switch_width=1.5)
    cell = bulk("Ar", "fcc", a=5.74, cubic=True)  # 1.40 g/cm³
    images = [cell.repeat(3) for _ in range(2)]
    for index, atoms in enumerate(images):
        atoms.rattle(0.3, seed=index)
        atoms.calc = calc
    Langevin(images, 10 * units.fs, temperature_K=400, friction=0.02, seed=1).run(150)
    Langevin(images, 10 * units.fs, temperature_K=94, friction=0.02, seed=2).run(250)
    dyn = VelocityVerlet(images, 10 * units.fs)
    transport = TransportObserver(dyn, window=75, block_length=100)
    dyn.attach(transport, interval=2)
    dyn.run(1000)
    einstein, green_kubo = transport.msd(), transport.vacf()
    for msd, vacf in zip(einstein, green_kubo, strict=True):
        assert msd.n_blocks == vacf.n_blocks == 5
        combined = np.hypot(msd.diffusion_error, vacf.diffusion_error)
        assert abs(msd.diffusion - vacf.diffusion) < SIGMAS * combined
        low, high = ARGON_D_RANGE_CM2_S
        assert low < msd.diffusion_cm2_s < high
        assert low < vacf.diffusion_cm2_s < high
    viscosity = transport.viscosity()
    for eta in viscosity:  # experiment ≈ 0.27 mPa·s near the triple point
        assert 0.05 < eta.viscosity < 1.0
        assert 70 < eta.temperature_K < 120


# -- bad input -------------------------------------------------------------------------


def test_bad_inputs_name_the_structure_and_the_fix(tmp_path):
    good = [bulk("Ar", "fcc", a=5.3, cubic=True)] * 4
    changed = [good[0], bulk("Kr", "fcc", a=5.3, cubic=True)]
    with pytest.raises(ValueError, match=r"trajectories\[1\].*frame 1: atoms differ"):
        mean_squared_displacement([good, changed], units.fs)
    path = tmp_path / "run.extxyz"
    write(path, good)
    with pytest.raises(ValueError, match=r"trajectories\[0\].*frame_interval="):
        mean_squared_displacement([path])
    with pytest.raises(ValueError, match=r"trajectories\[0\].*momenta"):
        velocity_autocorrelation([good], units.fs, window=2)
    with pytest.raises(TypeError, match="wrap a single one in a list"):
        mean_squared_displacement(good, units.fs)  # type: ignore[arg-type]


# -- command line ----------------------------------------------------------------


def read_csv(path):
    import csv

    with open(path, newline="", encoding="utf-8") as handle:
        rows = list(csv.reader(handle))
    return rows[0], rows[1:]


def test_cli_rdf_writes_each_structure_as_the_api_computes_it(streamed_run, tmp_path):
    import json

    from nvalchemi_ase.cli.main import main

    _, _, paths = streamed_run
    prefix = tmp_path / "out" / ""
    argv = ["rdf", *map(str, paths), "--rmax", "5.5", "--nbins", "30", "--quiet"]
    assert main([*argv, "--file-prefix", f"{prefix}/"]) == 0
    expected = radial_distribution(paths, 5.5, 30)
    for path, result in zip(paths, expected, strict=True):
        header, rows = read_csv(prefix / f"{path.stem}-rdf.csv")
        table = np.array(rows, dtype=float)
        assert header[:2] == ["r_A", "g"]
        np.testing.assert_allclose(table[:, 1], result.g, rtol=1e-9, atol=1e-9)
        for (a, b), values in result.partial.items():
            column = table[:, header.index(f"g_{a}-{b}")]
            np.testing.assert_allclose(column, values, rtol=1e-9, atol=1e-9)
        assert (prefix / f"{path.stem}-rdf.png").stat().st_size > 0
    summary = json.loads((prefix / "rdf-summary.json").read_text())
    assert [entry["n_frames"] for entry in summary["results"]] == [21, 21]
    # existing outputs are kept without --overwrite; too large rmax names the file
    assert main([*argv, "--file-prefix", f"{prefix}/"]) == 2
    bad = ["rdf", str(paths[0]), "--rmax", "6.5", "--file-prefix", f"{tmp_path}/b/"]
    assert main(bad) == 2


def test_cli_diffusion_matches_the_api_and_reads_the_frame_interval(
    streamed_run, tmp_path, capsys
):
    import json

    from nvalchemi_ase.cli.main import main

    _, _, paths = streamed_run
    options = ["--window", "6", "--block-length", "7", "--viscosity", "--quiet"]
    first, second = tmp_path / "header", tmp_path / "given"
    assert (
        main(["diffusion", *map(str, paths), *options, "--file-prefix", f"{first}/"])
        == 0
    )
    # the run: timestep 5 fs, a frame every 2 steps (what the .traj header says)
    given = ["--timestep", "5", "--traj-every", "2", "--no-plot"]
    assert (
        main(
            [
                "diffusion",
                *map(str, paths),
                *options,
                *given,
                "--file-prefix",
                f"{second}/",
            ]
        )
        == 0
    )
    header, rows = read_csv(first / "diffusion-results.csv")
    assert read_csv(second / "diffusion-results.csv") == (header, rows)
    msd = mean_squared_displacement(paths, window=6, block_length=7)
    vacf = velocity_autocorrelation(paths, window=6, block_length=7)
    eta = shear_viscosity(paths, window=6, block_length=7)
    for index, row in enumerate(rows):
        values = dict(zip(header, row, strict=True))
        assert float(values["D_msd_cm2_s"]) == pytest.approx(
            msd[index].diffusion_cm2_s, rel=1e-3
        )
        assert float(values["D_vacf_cm2_s"]) == pytest.approx(
            vacf[index].diffusion_cm2_s, rel=1e-3
        )
        assert float(values["viscosity_mPa_s"]) == pytest.approx(
            eta[index].viscosity, rel=1e-3
        )
        stem = paths[index].stem
        curve_header, curve = read_csv(first / f"{stem}-msd.csv")
        assert curve_header[:2] == ["lag_fs", "msd_A2"]
        np.testing.assert_allclose(
            np.array(curve, dtype=float)[:, 1], msd[index].curve, rtol=1e-9, atol=1e-12
        )
        assert (first / f"{stem}-diffusion.png").stat().st_size > 0
        assert not (second / f"{stem}-diffusion.png").exists()
    summary = json.loads((first / "diffusion-summary.json").read_text())
    assert set(summary["results"][1]) == {"name", "msd", "vacf", "viscosity"}
    assert summary["results"][1]["msd"]["diffusion_by_element_A2_per_fs"].keys() == {
        "Ar",
        "Kr",
    }


def test_cli_diffusion_needs_a_frame_interval_for_extxyz(tmp_path, capsys):
    from nvalchemi_ase.cli.main import main

    frames, _ = ballistic("Ar4", np.diag([9.0, 9.0, 9.0]), 30, 0, 5.0)
    path = tmp_path / "run.extxyz"
    write(path, frames)
    out = f"{tmp_path}/out/"
    assert main(["diffusion", str(path), "--file-prefix", out, "--quiet"]) == 2
    assert "--timestep FS and --traj-every" in capsys.readouterr().err
    assert (
        main(
            ["diffusion", str(path), "--timestep", "5", "--file-prefix", out, "--quiet"]
        )
        == 0
    )
    header, rows = read_csv(tmp_path / "out" / "diffusion-results.csv")
    assert header[0] == "trajectory"
    assert len(rows) == 1
