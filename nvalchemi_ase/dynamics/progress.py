"""Progress bars for batched runs (tqdm, on standard error).

A bar shows steps done out of the ``steps`` asked for, the step rate, and for
optimizers how many structures have converged. ``progress=None`` turns it on
only when standard error is a terminal, so logs and CI output stay clean.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["ProgressBar", "progress_enabled"]

#: Step limits above this are "until converged": the bar shows no total.
_OPEN_ENDED = 10_000_000


def progress_enabled(progress: bool | None) -> bool:
    """Resolve ``progress``: True/False as given, None when stderr is a terminal.

    Parameters
    ----------
    progress : bool or None
        The user's choice.

    Returns
    -------
    bool
        Whether to draw a bar.
    """
    if progress is None:
        return bool(getattr(sys.stderr, "isatty", lambda: False)())
    return bool(progress)


class ProgressBar:
    """One tqdm bar over one ``run``/``irun`` call.

    Parameters
    ----------
    description : str
        Shown before the bar (the dynamics class name).
    steps : int
        Steps requested; very large limits (optimizers' default) show no total.
    unit : str
        What a step is called.
    """

    def __init__(self, description: str, steps: int, unit: str = "step") -> None:
        from tqdm.auto import tqdm

        self._bar = tqdm(
            total=steps if steps < _OPEN_ENDED else None,
            desc=description,
            unit=unit,
            file=sys.stderr,
            dynamic_ncols=True,
            leave=True,
        )

    def step(self, postfix: str | None = None) -> None:
        """Count one step; ``postfix`` (e.g. ``"converged 3/32"``) is shown after it."""
        if postfix is not None:
            self._bar.set_postfix_str(postfix, refresh=False)
        self._bar.update(1)

    def note(self, postfix: str) -> None:
        """Show ``postfix`` without counting a step."""
        self._bar.set_postfix_str(postfix, refresh=True)

    def close(self) -> None:
        """Finish the bar."""
        self._bar.close()

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
