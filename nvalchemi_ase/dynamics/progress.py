"""Progress of batched runs: a bar on a terminal or in a notebook, lines elsewhere.

A progress report shows steps done out of the ``steps`` asked for, the step
rate, and for optimizers how many structures have converged. On a terminal it
is a tqdm bar on standard error. In a Jupyter notebook it is tqdm's widget
(``tqdm.notebook``) when ``ipywidgets`` is installed, otherwise a text bar in
the cell's output (no "IProgress not found" warning). When standard error is
neither (a pipe, a log file, CI) a bar would write carriage-return redraws into
the log, so the report is plain lines instead: one every
:data:`LINE_INTERVAL` seconds while the run goes on and one when it ends.
``progress=None`` turns progress on only on a terminal or in a notebook, so
logs and CI output stay clean unless asked for.

Rates are printed with three significant digits, and below one per second as
seconds per step (:func:`format_rate`), so a slow run never reads "0 steps/s".
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import sys
import time
from typing import Any, TextIO

__all__ = [
    "LINE_INTERVAL",
    "ProgressBar",
    "format_rate",
    "format_significant",
    "in_notebook",
    "is_terminal",
    "notebook_widgets_available",
    "progress_enabled",
]

#: Step limits above this are "until converged": the report shows no total.
_OPEN_ENDED = 10_000_000

#: Seconds between two progress lines when standard error is not a terminal.
LINE_INTERVAL = 10.0


def is_terminal(stream: Any) -> bool:
    """Whether ``stream`` is an open terminal (False for pipes, files, captures)."""
    try:
        return bool(getattr(stream, "isatty", lambda: False)())
    except ValueError:  # closed file
        return False


def in_notebook() -> bool:
    """Whether this runs in a Jupyter kernel (IPython's kernel shell).

    IPython is not imported here: outside a notebook or an IPython session it
    is not in ``sys.modules`` and the answer is False.
    """
    ipython = sys.modules.get("IPython")
    shell = getattr(ipython, "get_ipython", lambda: None)() if ipython else None
    return shell is not None and getattr(shell, "kernel", None) is not None


def notebook_widgets_available() -> bool:
    """Whether ``ipywidgets`` is installed (tqdm's notebook bar needs it)."""
    return importlib.util.find_spec("ipywidgets") is not None


def progress_enabled(progress: bool | None) -> bool:
    """Resolve ``progress``: True/False as given, None: on a terminal or in a notebook.

    Parameters
    ----------
    progress : bool or None
        The user's choice.

    Returns
    -------
    bool
        Whether to report progress.
    """
    if progress is None:
        return is_terminal(sys.stderr) or in_notebook()
    return bool(progress)


def format_significant(value: float, digits: int = 3) -> str:
    """``value`` with ``digits`` significant digits, without exponent where sensible.

    Parameters
    ----------
    value : float
        Any number.
    digits : int
        Significant digits.

    Returns
    -------
    str
        E.g. ``0.0123``, ``4.57``, ``123``, ``4570``; an exponent only below
        1e-4 or from 1e6.
    """
    if not math.isfinite(value):
        return str(value)
    if value == 0:
        return "0"
    magnitude = math.floor(math.log10(abs(value)))
    if magnitude < -4 or magnitude >= 6:
        return f"{value:.{digits - 1}e}"
    rounded = float(f"{value:.{digits - 1}e}")  # round first: 9.996 -> 10.0
    magnitude = math.floor(math.log10(abs(rounded)))
    return f"{rounded:.{max(digits - 1 - magnitude, 0)}f}"


def format_rate(count: float, seconds: float, unit: str = "step") -> str:
    """Format a rate that stays readable at any speed.

    Parameters
    ----------
    count : float
        Things done (steps, structure-steps, structures).
    seconds : float
        Wall time they took.
    unit : str
        What one thing is called (singular).

    Returns
    -------
    str
        ``"12.3 steps/s"`` at one per second or more, ``"4.56 s/step"`` below
        (three significant digits either way).
    """
    if count <= 0 or not seconds > 0:
        return f"{format_significant(count)} {unit}s in {format_significant(seconds)} s"
    rate = count / seconds
    if rate >= 1.0:
        return f"{format_significant(rate)} {unit}s/s"
    return f"{format_significant(seconds / count)} s/{unit}"


class ProgressBar:
    """Progress of one ``run``/``irun`` call: a tqdm bar or widget, else lines.

    Parameters
    ----------
    description : str
        Shown first (the dynamics class name).
    steps : int
        Steps requested; very large limits (optimizers' default) show no total.
    unit : str
        What a step is called.
    file : text stream, optional
        Where to write (default: standard error, looked up when created; in a
        notebook, the cell's output: a widget, or a text bar without
        ``ipywidgets``).
    interval : float, optional
        Seconds between progress lines when ``file`` is not a terminal
        (default :data:`LINE_INTERVAL`); a last line is always written at
        :meth:`close`.
    """

    def __init__(
        self,
        description: str,
        steps: int,
        unit: str = "step",
        *,
        file: TextIO | None = None,
        interval: float | None = None,
    ) -> None:
        self._file = sys.stderr if file is None else file
        self._description = description
        self._unit = unit
        self._total = steps if steps < _OPEN_ENDED else None
        self._interval = LINE_INTERVAL if interval is None else float(interval)
        self._count = 0
        self._postfix = ""
        self._closed = False
        self._start = self._last_line = time.perf_counter()
        self._bar: Any = _new_bar(
            self._total, description, unit, self._file, notebook=file is None
        )

    @property
    def kind(self) -> str:
        """How progress is shown: ``"widget"``, ``"bar"`` (text) or ``"lines"``."""
        if self._bar is None:
            return "lines"
        return "widget" if type(self._bar).__module__ == "tqdm.notebook" else "bar"

    def step(self, postfix: str | None = None) -> None:
        """Count one step; ``postfix`` (e.g. ``"converged 3/32"``) is shown after it."""
        if postfix is not None:
            self._postfix = postfix
        self._count += 1
        if self._bar is not None:
            if postfix is not None:
                self._bar.set_postfix_str(postfix, refresh=False)
            self._bar.update(1)
            return
        now = time.perf_counter()
        if now - self._last_line >= self._interval:
            self._write_line(now)

    def note(self, postfix: str) -> None:
        """Show ``postfix`` without counting a step."""
        self._postfix = postfix
        if self._bar is not None:
            self._bar.set_postfix_str(postfix, refresh=True)

    def close(self) -> None:
        """Finish the report (a bar is left on screen; elsewhere a last line)."""
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
        else:
            self._write_line(time.perf_counter())

    def _write_line(self, now: float) -> None:
        self._last_line = now
        elapsed = now - self._start
        done = f"{self._count}/{self._total}" if self._total else f"{self._count}"
        text = f"{self._description}: {done} {self._unit}s, {elapsed:.1f} s"
        if self._count:
            text += f" ({format_rate(self._count, elapsed, self._unit)})"
        if self._postfix:
            text += f"; {self._postfix}"
        with contextlib.suppress(OSError, ValueError):  # closed or broken stream
            print(text, file=self._file, flush=True)

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _new_bar(
    total: int | None, description: str, unit: str, file: Any, *, notebook: bool
) -> Any:
    """Return a tqdm bar for ``file``, tqdm's widget in a notebook, or None."""
    if notebook and in_notebook() and notebook_widgets_available():
        from tqdm.notebook import tqdm as widget

        return widget(total=total, desc=description, unit=unit, leave=True)
    if not (is_terminal(file) or (notebook and in_notebook())):
        return None
    from tqdm.std import tqdm as text_bar

    return text_bar(
        total=total,
        desc=description,
        unit=unit,
        file=file,
        dynamic_ncols=True,
        leave=True,
    )
