"""PNG plots of property results: E(V) with its fit, phonon bands and DOS, bars.

Figures are ``matplotlib.figure.Figure`` objects rendered straight to PNG, so
no display is needed and the caller's pyplot backend and figure list are left
alone (as :mod:`nvalchemi_ase.plotting`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure as FigureType

    from nvalchemi_ase.properties.defects import DefectResult
    from nvalchemi_ase.properties.eos import EOSResult
    from nvalchemi_ase.properties.kappa import ThermalConductivityResult
    from nvalchemi_ase.properties.phonons import PhononResult
    from nvalchemi_ase.properties.qha import QHAResult
    from nvalchemi_ase.properties.surfaces import SurfaceResult

__all__ = [
    "plot_defect_energies",
    "plot_eos",
    "plot_kappa",
    "plot_phonons",
    "plot_qha",
    "plot_surface_energies",
]


def plot_eos(result: EOSResult, path: str | Path, *, title: str | None = None) -> Path:
    """Energy against volume, the fitted curve and V0.

    Parameters
    ----------
    result : EOSResult
        A computed (``ok``) equation of state.
    path : str or pathlib.Path
        PNG to write.
    title : str, optional
        Figure title (default: the formula).

    Returns
    -------
    pathlib.Path
        The file written.

    Raises
    ------
    ValueError
        If the result has no fit (a failed material).
    """
    from matplotlib.figure import Figure

    if result.fit is None or result.v0 is None or result.volumes is None:
        raise ValueError(f"no EOS fit to plot ({result.error or 'not computed'})")
    _, _, _, _, fit_v, fit_e, _, _ = result.fit.getplotdata()
    figure = Figure(figsize=(5.0, 3.8), layout="constrained")
    axes = figure.add_subplot()
    axes.plot(fit_v, fit_e, "-", color="C0", label=f"{result.eos} fit")
    axes.plot(
        result.volumes, np.asarray(result.energies), "o", color="C1", label="computed"
    )
    axes.axvline(result.v0, color="0.6", lw=0.8, ls="--")
    axes.set_xlabel("volume [Å³]")
    axes.set_ylabel("energy [eV]")
    axes.set_title(title or result.formula)
    axes.legend(loc="upper center", frameon=False)
    axes.text(
        0.98,
        0.04,
        f"V0 = {result.v0:.3f} Å³\nE0 = {result.e0:.4f} eV\nB = {result.B:.2f} GPa",
        transform=axes.transAxes,
        ha="right",
        va="bottom",
        fontsize=8,
    )
    return _save(figure, path)


def plot_phonons(
    result: PhononResult, path: str | Path, *, title: str | None = None
) -> Path:
    """Phonon band structure and density of states (either or both).

    Parameters
    ----------
    result : PhononResult
        A computed (``ok``) phonon result with a band path and/or a mesh.
    path : str or pathlib.Path
        PNG to write.
    title : str, optional
        Figure title (default: the formula).

    Returns
    -------
    pathlib.Path
        The file written.

    Raises
    ------
    ValueError
        If there is neither a band structure nor a DOS.
    """
    from matplotlib.figure import Figure

    has_band = result.band_frequencies is not None
    has_dos = result.dos is not None
    if not (has_band or has_dos):
        raise ValueError(
            f"no band structure or DOS to plot ({result.error or 'none computed'})"
        )
    figure = Figure(figsize=(7.0 if has_band else 4.0, 4.0), layout="constrained")
    widths = [3, 1] if has_band and has_dos else [1]
    grid = figure.add_gridspec(1, len(widths), width_ratios=widths, wspace=0.02)
    band_axes = figure.add_subplot(grid[0]) if has_band else None
    if band_axes is not None:
        _draw_band(band_axes, result)
    if has_dos:
        dos_axes = figure.add_subplot(
            grid[-1], sharey=band_axes if band_axes is not None else None
        )
        dos_axes.plot(
            np.asarray(result.dos),
            np.asarray(result.dos_frequencies),
            color="C0",
            lw=1.0,
        )
        dos_axes.set_xlabel("DOS [1/THz]")
        dos_axes.set_xlim(left=0.0)
        if band_axes is not None:
            dos_axes.tick_params(labelleft=False)
        else:
            dos_axes.set_ylabel("frequency [THz]")
    figure.suptitle(title or result.formula)
    return _save(figure, path)


def _draw_band(axes: Axes, result: PhononResult) -> None:
    """Bands against path distance; a jump between segments is not joined."""
    x = np.asarray(result.band_x, dtype=float)
    frequencies = np.asarray(result.band_frequencies, dtype=float)
    breaks = np.flatnonzero(np.diff(x) == 0.0) + 1  # ASE repeats x at a jump
    for segment_x, segment_f in zip(
        np.split(x, breaks), np.split(frequencies, breaks), strict=True
    ):
        axes.plot(segment_x, segment_f, color="C0", lw=1.0)
    ticks: list[float] = []
    labels: list[str] = []
    special = np.asarray(
        [] if result.band_special_x is None else result.band_special_x, dtype=float
    )
    for position, label in zip(special, result.band_labels or [], strict=True):
        name = "Γ" if label == "G" else label
        if ticks and position == ticks[-1]:
            labels[-1] = f"{labels[-1]}|{name}"
            continue
        ticks.append(float(position))
        labels.append(name)
    for position in ticks:
        axes.axvline(position, color="0.7", lw=0.6)
    axes.axhline(0.0, color="0.4", lw=0.6, ls=":")
    axes.set_xticks(ticks, labels)
    axes.set_xlim(x[0], x[-1])
    axes.set_ylabel("frequency [THz]")


def plot_surface_energies(
    result: SurfaceResult, path: str | Path, *, title: str | None = None
) -> Path:
    """Draw the surface energy of each facet, J/m², as bars.

    Parameters
    ----------
    result : SurfaceResult
        A computed (``ok``) result.
    path : str or pathlib.Path
        PNG to write.
    title : str, optional
        Figure title (default: the formula).

    Returns
    -------
    pathlib.Path
        The file written.

    Raises
    ------
    ValueError
        If the result has no surface energies (a failed material).
    """
    if result.surface_energies_si is None or result.miller is None:
        raise ValueError(f"no surface energies to plot ({result.error or 'none'})")
    labels = ["(" + " ".join(str(int(i)) for i in hkl) + ")" for hkl in result.miller]
    return _bars(
        labels,
        np.asarray(result.surface_energies_si),
        "surface energy [J/m²]",
        title or result.formula,
        path,
    )


def plot_defect_energies(
    result: DefectResult, path: str | Path, *, title: str | None = None
) -> Path:
    """Draw the formation energy of each defect, eV, as bars.

    Parameters
    ----------
    result : DefectResult
        A computed (``ok``) result.
    path : str or pathlib.Path
        PNG to write.
    title : str, optional
        Figure title (default: the formula).

    Returns
    -------
    pathlib.Path
        The file written.

    Raises
    ------
    ValueError
        If the result has no formation energies (a failed material).
    """
    if result.formation_energies is None:
        raise ValueError(f"no formation energies to plot ({result.error or 'none'})")
    return _bars(
        list(result.defects),
        np.asarray(result.formation_energies),
        "formation energy [eV]",
        title or result.formula,
        path,
    )


def _bars(
    labels: list[str], values: np.ndarray, ylabel: str, title: str, path: str | Path
) -> Path:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(1.2 + 0.9 * len(labels), 3.6), layout="constrained")
    axes = figure.add_subplot()
    positions = np.arange(len(labels))
    axes.bar(positions, values, color="C0", width=0.6)
    for x, value in zip(positions, values, strict=True):
        axes.annotate(
            f"{value:.3g}",
            (x, value),
            ha="center",
            va="bottom" if value >= 0 else "top",
            fontsize=8,
        )
    axes.axhline(0.0, color="0.4", lw=0.6)
    axes.set_xticks(positions, labels)
    axes.set_ylabel(ylabel)
    axes.set_title(title)
    return _save(figure, path)


def _save(figure: FigureType, path: str | Path) -> Path:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(target, format="png", dpi=120)
    return target


def plot_kappa(
    result: ThermalConductivityResult, path: str | Path, *, title: str | None = None
) -> Path:
    """Lattice thermal conductivity against temperature (diagonal and mean).

    Parameters
    ----------
    result : ThermalConductivityResult
        A computed (``ok``) result.
    path : str or pathlib.Path
        PNG to write.
    title : str, optional
        Figure title (default: the formula).

    Returns
    -------
    pathlib.Path
        The file written.

    Raises
    ------
    ValueError
        If the result has no κ (a failed material).
    """
    from matplotlib.figure import Figure

    if result.kappa is None or result.temperatures is None:
        raise ValueError(f"no thermal conductivity to plot ({result.error})")
    temperatures = np.asarray(result.temperatures)
    kappa = np.asarray(result.kappa)
    figure = Figure(figsize=(5.0, 3.8), layout="constrained")
    axes = figure.add_subplot()
    style = "o-" if len(temperatures) < 30 else "-"
    for k, name in enumerate(("xx", "yy", "zz")):
        axes.plot(temperatures, kappa[:, k, k], style, ms=3, lw=1.0, label=f"κ_{name}")
    axes.plot(temperatures, np.asarray(result.kappa_mean), "k--", lw=1.0, label="mean")
    axes.set_xlabel("temperature [K]")
    axes.set_ylabel("κ [W/(m K)]")
    axes.set_title(title or f"{result.formula} ({result.method.upper()})")
    axes.legend(frameon=False)
    return _save(figure, path)


def plot_qha(result: QHAResult, path: str | Path, *, title: str | None = None) -> Path:
    """V(T), thermal expansion, B(T) and G(T) of a quasi-harmonic result.

    Parameters
    ----------
    result : QHAResult
        A computed (``ok``) result.
    path : str or pathlib.Path
        PNG to write.
    title : str, optional
        Figure title (default: the formula).

    Returns
    -------
    pathlib.Path
        The file written.

    Raises
    ------
    ValueError
        If the result has no fit (a failed material).
    """
    from matplotlib.figure import Figure

    if result.temperatures is None or result.volume_temperature is None:
        raise ValueError(f"no quasi-harmonic fit to plot ({result.error})")
    temperatures = np.asarray(result.temperatures)
    panels = (
        (result.volume_temperature, "volume [Å³]"),
        (np.asarray(result.linear_thermal_expansion) * 1e6, "α = β/3 [10⁻⁶/K]"),
        (result.bulk_modulus_temperature, "B [GPa]"),
        (result.gibbs_temperature, "G [eV]"),
    )
    figure = Figure(figsize=(7.0, 5.0), layout="constrained")
    for k, (values, label) in enumerate(panels):
        axes = figure.add_subplot(2, 2, k + 1)
        axes.plot(temperatures, np.asarray(values), "-", color=f"C{k}", lw=1.2)
        axes.set_xlabel("temperature [K]")
        axes.set_ylabel(label)
    figure.suptitle(title or result.formula)
    return _save(figure, path)
