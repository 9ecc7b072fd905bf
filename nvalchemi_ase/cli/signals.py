"""SIGTERM and SIGINT during ``calc``, ``relax`` and ``md``: stop cleanly, then requeue.

A batch scheduler ends a job with SIGTERM (Slurm: then SIGKILL after
``KillWait``, 30 s by default); a user with Ctrl-C (SIGINT). While one of
these commands runs, both are caught (the previous handlers are put back when
it returns, so nothing changes for library users) and the command ends with
one line on standard error and exit status :data:`REQUEUE_STATUS`, every
output file flushed and closed, so a job script can requeue the same command:

* ``md`` and ``relax`` act on the signal at the next step boundary: the
  batch in flight writes its checkpoint (``<output-dir>/checkpoint.npz``,
  ``STEM.checkpoint.npz`` next to the relaxed output) and ``--restart``
  continues it from there;
* ``calc`` stops at once (the structures in flight are lost and computed
  again by ``--restart``/``--resume``; what was written is kept);
* a second signal while ``md`` or ``relax`` is writing its checkpoint stops at once too
  (the previous checkpoint stays whole: checkpoints are written atomically).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

__all__ = ["REQUEUE_STATUS", "SIGNALS", "SignalInterrupt", "StopSignals"]

#: Exit status of a run stopped by SIGTERM or SIGINT: ``EX_TEMPFAIL`` of
#: sysexits.h ("try again later"), the status job scripts requeue on.
REQUEUE_STATUS = 75

#: The signals a run stops on.
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class SignalInterrupt(KeyboardInterrupt):
    """A run stopped at once by a signal (a ``KeyboardInterrupt``, as Ctrl-C is).

    Attributes
    ----------
    signal_name : str
        ``"SIGTERM"`` or ``"SIGINT"``.
    """

    def __init__(self, signal_name: str) -> None:
        super().__init__(signal_name)
        self.signal_name = signal_name


class StopSignals:
    """SIGTERM/SIGINT handlers for one command; the ``stop=`` of a runner.

    Outside :meth:`deferring` a signal raises :class:`SignalInterrupt` where
    the program is; inside it the first one only sets :attr:`received` (the
    runner polls the object at every step) and a second one raises.

    Attributes
    ----------
    received : str or None
        Name of the signal being acted on, once one has arrived.
    """

    def __init__(self) -> None:
        self.received: str | None = None
        self._deferring = False

    def __call__(self) -> bool:
        """Whether a stop was asked for (the runners' ``stop=``)."""
        return self.received is not None

    @contextlib.contextmanager
    def installed(self) -> Iterator[StopSignals]:
        """Install the handlers for the block, then put the previous ones back.

        Outside the main thread (where Python delivers signals) nothing is
        installed.
        """
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {number: signal.getsignal(number) for number in SIGNALS}
        for number in SIGNALS:
            signal.signal(number, self._handle)
        try:
            yield self
        finally:
            for number, handler in previous.items():
                signal.signal(number, handler)

    @contextlib.contextmanager
    def deferring(self) -> Iterator[None]:
        """Within the block, a first signal asks the run to stop at a step boundary."""
        self._deferring = True
        try:
            yield
        finally:
            self._deferring = False

    def _handle(self, number: int, frame: FrameType | None) -> Any:
        name = signal.Signals(number).name
        if self._deferring and self.received is None:
            self.received = name
            return
        self.received = self.received or name
        raise SignalInterrupt(self.received)
