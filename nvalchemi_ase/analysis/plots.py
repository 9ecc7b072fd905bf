"""PNG plots of analysis results, drawn on ``matplotlib.figure.Figure``.

No pyplot and no backend switch (as :mod:`nvalchemi_ase.plotting`): a notebook's
backend and figure list are left alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nvalchemi_ase.analysis.diffusion import DiffusionResult
    from nvalchemi_ase.analysis.rdf import RDFResult
    from nvalchemi_ase.analysis.viscosity import ViscosityResult

__all__ = ["plot_rdf", "plot_transport"]


def plot_rdf(result: RDFResult, path: str | Path, *, title: str | None = None) -> Path:
    """Total and partial g(r) of one structure.

    Parameters
    ----------
    result : RDFResult
        One structure's RDFs.
    path : str or pathlib.Path
        PNG to write.
    title : str, optional
        Figure title (default: the structure's label).

    Returns
    -------
    pathlib.Path
        The file written.
    """
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6, 3.6), layout="constrained")
    axis = figure.subplots()
    axis.plot(result.r, result.g, color="black", label="total")
    if len(result.partial) > 1:
        for (a, b), values in result.partial.items():
            axis.plot(result.r, values, label=f"{a}-{b}", alpha=0.8)
    axis.axhline(1.0, color="grey", lw=0.5)
    axis.set_xlabel("r [Å]")
    axis.set_ylabel("g(r)")
    axis.legend(fontsize="small")
    axis.grid(alpha=0.3)
    figure.suptitle(title or f"{result.label} ({result.n_frames} frames)")
    return _save(figure, path)


def plot_transport(
    msd: DiffusionResult | None,
    vacf: DiffusionResult | None,
    viscosity: ViscosityResult | None,
    path: str | Path,
    *,
    title: str | None = None,
) -> Path:
    """MSD with its fit window, VACF with its running D, running viscosity.

    Parameters
    ----------
    msd, vacf : DiffusionResult or None
        One structure's Einstein and Green–Kubo results (either may be None).
    viscosity : ViscosityResult or None
        Its Green–Kubo viscosity.
    path : str or pathlib.Path
        PNG to write.
    title : str, optional
        Figure title.

    Returns
    -------
    pathlib.Path
        The file written.
    """
    from matplotlib.figure import Figure

    panels = [item for item in (msd, vacf, viscosity) if item is not None]
    if not panels:
        raise ValueError("plot_transport: nothing to draw")
    figure = Figure(figsize=(6.5, 2.6 * len(panels)), layout="constrained")
    axes = figure.subplots(len(panels), 1, squeeze=False)[:, 0]
    row = 0
    if msd is not None:
        axis = axes[row]
        axis.plot(msd.lag_fs / 1000, msd.curve, color="black", label="all")
        for symbol, values in msd.curve_by_element.items():
            if len(msd.curve_by_element) > 1:
                axis.plot(msd.lag_fs / 1000, values, label=symbol, alpha=0.8)
        axis.axvspan(*(t / 1000 for t in msd.window_fs), color="C0", alpha=0.1)
        axis.set_ylabel("MSD [Å²]")
        axis.set_title(
            f"Einstein D = {msd.diffusion_cm2_s:.3g} ± "
            f"{msd.diffusion_error_cm2_s:.2g} cm²/s",
            fontsize="small",
        )
        axis.legend(fontsize="small")
        row += 1
    if vacf is not None and vacf.running_diffusion is not None:
        axis = axes[row]
        axis.plot(vacf.lag_fs / 1000, vacf.curve / vacf.curve[0], color="black")
        axis.set_ylabel("VACF / VACF(0)")
        twin = axis.twinx()
        twin.plot(vacf.lag_fs / 1000, vacf.running_diffusion * 0.1, color="C1")
        twin.set_ylabel("running D [cm²/s]", color="C1")
        axis.set_title(
            f"Green–Kubo D = {vacf.diffusion_cm2_s:.3g} ± "
            f"{vacf.diffusion_error_cm2_s:.2g} cm²/s",
            fontsize="small",
        )
        row += 1
    if viscosity is not None:
        axis = axes[row]
        axis.plot(viscosity.lag_fs / 1000, viscosity.running_viscosity, color="C2")
        axis.set_ylabel("running η [mPa·s]")
        axis.set_title(
            f"η = {viscosity.viscosity:.3g} ± {viscosity.viscosity_error:.2g} mPa·s",
            fontsize="small",
        )
    for axis in axes:
        axis.grid(alpha=0.3)
    axes[-1].set_xlabel("lag [ps]")
    if title:
        figure.suptitle(title)
    return _save(figure, path)


def _save(figure: object, path: str | Path) -> Path:
    output = Path(path)
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output, dpi=110)  # type: ignore[attr-defined]
    return output
