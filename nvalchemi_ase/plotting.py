"""PNG plots of batched runs: one line per structure, or a band for large batches.

Used by :meth:`nvalchemi_ase.dynamics.recorder.Recorder.plot` and the command
line's ``--plot``. matplotlib is imported when a plot is drawn; figures are
``matplotlib.figure.Figure`` objects rendered straight to PNG, so no display is
needed and the caller's pyplot backend and figure list are left alone (a
notebook keeps its inline backend). Without a path, a plot is returned as an
:class:`InlinePlot`, which a notebook shows inline (its ``_repr_png_``).
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, overload

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["MAX_LINES", "InlinePlot", "plot_md", "plot_relaxation"]

#: Batches larger than this are drawn as a mean line and a min-max band.
MAX_LINES = 12

#: Resolution of written and inline PNGs, dots per inch.
DPI = 110


class InlinePlot:
    """A drawn plot not written to a file; a notebook displays it inline.

    Attributes
    ----------
    figure : matplotlib.figure.Figure
        The figure (``figure.savefig(...)`` writes it anywhere).
    """

    def __init__(self, figure: Figure) -> None:
        self.figure = figure

    def _repr_png_(self) -> bytes:
        buffer = io.BytesIO()
        self.figure.savefig(buffer, format="png", dpi=DPI)
        return buffer.getvalue()

    def save(self, path: str | Path) -> Path:
        """Write the plot as a PNG; return its path."""
        return _save(self.figure, path)


@overload
def plot_md(
    series: dict[str, npt.NDArray[np.float64]],
    path: str | Path,
    *,
    title: str | None = ...,
    labels: Sequence[str] | None = ...,
) -> Path: ...


@overload
def plot_md(
    series: dict[str, npt.NDArray[np.float64]],
    path: None = ...,
    *,
    title: str | None = ...,
    labels: Sequence[str] | None = ...,
) -> InlinePlot: ...


def plot_md(
    series: dict[str, npt.NDArray[np.float64]],
    path: str | Path | None = None,
    *,
    title: str | None = None,
    labels: Sequence[str] | None = None,
) -> Path | InlinePlot:
    """Energy, temperature and pressure against time.

    Parameters
    ----------
    series : dict of numpy.ndarray
        ``time_ps`` (T,), ``epot_per_atom`` (T, B) eV, ``temperature`` (T, B) K,
        ``pressure_gpa`` (T, B) GPa (NaN where undefined), as recorded by
        :class:`~nvalchemi_ase.dynamics.recorder.Recorder`.
    path : str or pathlib.Path, optional
        PNG to write; None returns the plot for a notebook instead.
    title : str, optional
        Figure title.
    labels : sequence of str, optional
        One legend entry per structure (default ``#0``, ``#1``, ...); the
        legend is drawn for up to ``MAX_LINES`` structures.

    Returns
    -------
    pathlib.Path or InlinePlot
        The file written, or (``path=None``) the plot.
    """
    panels = [
        ("epot_per_atom", "E_pot / atom [eV]"),
        ("temperature", "T [K]"),
    ]
    if np.isfinite(series.get("pressure_gpa", np.array([np.nan]))).any():
        panels.append(("pressure_gpa", "P [GPa]"))
    return _draw(
        series["time_ps"], "time [ps]", series, panels, path, title, set(), labels
    )


@overload
def plot_relaxation(
    series: dict[str, npt.NDArray[np.float64]],
    path: str | Path,
    *,
    title: str | None = ...,
    labels: Sequence[str] | None = ...,
) -> Path: ...


@overload
def plot_relaxation(
    series: dict[str, npt.NDArray[np.float64]],
    path: None = ...,
    *,
    title: str | None = ...,
    labels: Sequence[str] | None = ...,
) -> InlinePlot: ...


def plot_relaxation(
    series: dict[str, npt.NDArray[np.float64]],
    path: str | Path | None = None,
    *,
    title: str | None = None,
    labels: Sequence[str] | None = None,
) -> Path | InlinePlot:
    """Energy (relative to its final value) and largest force against step.

    Parameters
    ----------
    series : dict of numpy.ndarray
        ``step`` (T,), ``epot_per_atom`` (T, B) eV, ``fmax`` (T, B) eV/Å.
    path : str or pathlib.Path, optional
        PNG to write; None returns the plot for a notebook instead.
    title : str, optional
        Figure title.
    labels : sequence of str, optional
        One legend entry per structure (default ``#0``, ``#1``, ...); the
        legend is drawn for up to ``MAX_LINES`` structures.

    Returns
    -------
    pathlib.Path or InlinePlot
        The file written, or (``path=None``) the plot.
    """
    relative = dict(series)
    energy = series["epot_per_atom"]
    relative["energy_drop"] = energy - energy[-1]
    panels = [("energy_drop", "E/atom - final [eV]"), ("fmax", "fmax [eV/Å]")]
    return _draw(
        series["step"], "step", relative, panels, path, title, {"fmax"}, labels
    )


def _draw(
    x: npt.NDArray[np.float64],
    xlabel: str,
    series: dict[str, npt.NDArray[np.float64]],
    panels: list[tuple[str, str]],
    path: str | Path | None,
    title: str | None,
    log: set[str],
    labels: Sequence[str] | None,
) -> Path | InlinePlot:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 2.4 * len(panels)), layout="constrained")
    axes = figure.subplots(
        len(panels),
        1,
        sharex=True,
        squeeze=False,
    )
    for axis, (key, label) in zip(axes[:, 0], panels, strict=True):
        values = np.asarray(series[key], dtype=np.float64)
        _lines_or_band(axis, x, values.reshape(len(x), -1), labels)
        axis.set_ylabel(label)
        if key in log:
            axis.set_yscale("log")
        axis.grid(alpha=0.3)
    axes[-1, 0].set_xlabel(xlabel)
    handles, names = axes[0, 0].get_legend_handles_labels()
    if len(handles) > 1:
        figure.legend(handles, names, loc="outside right upper", fontsize="small")
    if title:
        figure.suptitle(title)
    if path is None:
        return InlinePlot(figure)
    return _save(figure, path)


def _save(figure: Figure, path: str | Path) -> Path:
    output = Path(path)
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output, dpi=DPI)
    return output


def _lines_or_band(
    axis: Any,
    x: npt.NDArray[np.float64],
    values: npt.NDArray[np.float64],
    labels: Sequence[str] | None,
) -> None:
    count = values.shape[1]
    if count <= MAX_LINES:
        names = list(labels) if labels is not None else []
        names += [f"#{column}" for column in range(len(names), count)]
        for column in range(count):
            axis.plot(x, values[:, column], lw=1.2, label=names[column])
        return
    axis.fill_between(
        x,
        np.nanmin(values, axis=1),
        np.nanmax(values, axis=1),
        alpha=0.3,
        label=f"min-max of {count}",
    )
    axis.plot(x, np.nanmean(values, axis=1), lw=1.5, label="mean")
