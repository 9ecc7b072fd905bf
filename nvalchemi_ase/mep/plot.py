"""Band plots: energy along the path for several relaxed bands, as PNG.

Drawn on a ``matplotlib.figure.Figure`` rendered straight to the file, so the
caller's pyplot backend and figure list are left alone. The curve through each
band is ASE's force-consistent fit (``ase.utils.forcecurve.fit_images``, the
one ``NEBTools.plot_band`` draws).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ase.utils.forcecurve import fit_images

if TYPE_CHECKING:
    from nvalchemi_ase.mep.paths import PathResult

__all__ = ["plot_bands"]


def plot_bands(
    results: Sequence[PathResult],
    path: str | Path,
    *,
    labels: Sequence[str] | None = None,
    title: str | None = None,
) -> Path:
    """Energy relative to the initial image against distance along each band.

    Parameters
    ----------
    results : sequence of PathResult
        Relaxed paths (failed ones are left out of the plot).
    path : str or pathlib.Path
        PNG to write.
    labels : sequence of str, optional
        One legend entry per result (default ``path 0``, ``path 1``, ...).
    title : str, optional
        Figure title.

    Returns
    -------
    pathlib.Path
        The file written.
    """
    from matplotlib.figure import Figure

    names = list(labels) if labels is not None else []
    names += [f"path {index}" for index in range(len(names), len(results))]
    figure = Figure(figsize=(7, 4.5), layout="constrained")
    axis = figure.subplots()
    for result, name in zip(results, names, strict=True):
        if result.failed:
            continue
        fit = fit_images(result.images)
        base = fit.energies[0]
        (line,) = axis.plot(
            fit.fit_path,
            fit.fit_energies - base,
            lw=1.3,
            label=f"{name}: {result.barrier_forward:.3f} eV",
        )
        axis.plot(fit.path, fit.energies - base, "o", ms=4, color=line.get_color())
    axis.set_xlabel("distance along the path [Å]")
    axis.set_ylabel("E - E(initial) [eV]")
    axis.grid(alpha=0.3)
    if axis.get_legend_handles_labels()[0]:
        axis.legend(fontsize="small")
    if title:
        axis.set_title(title)
    output = Path(path)
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output, dpi=110)
    return output
