"""Drive an nvalchemi dynamics engine one step at a time.

ASE's ``irun()`` is a generator: it yields after the initial force evaluation and
after every step, and the caller may stop, inspect or change the structures in
between. nvalchemi's public ``run(batch, n_steps)`` re-primes the model on every
call (``BaseDynamics.run`` primes forces before its first step), so the ASE
layer drives ``engine.step(batch)`` instead and performs ``run()``'s set-up
itself. The private engine members that needs (hook opening and closing,
admission, priming) are reached through
:mod:`nvalchemi_ase._compat`, whose contract test names any upstream change.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from nvalchemi_ase._compat import close_hooks, open_hooks, prime_engine
from nvalchemi_ase._quiet import import_quietly

if TYPE_CHECKING:
    from nvalchemi.data import Batch
    from nvalchemi.dynamics.base import BaseDynamics

__all__ = ["EngineDriver", "freeze_hook"]


def freeze_hook(*, zero_velocities: bool) -> Any:
    """Return nvalchemi's ``FreezeAtomsHook`` for atoms with category -1.

    Parameters
    ----------
    zero_velocities : bool
        Clear frozen atoms' velocities (MD and FIRE); False for quasi-Newton
        optimizers, which keep no velocities.

    Returns
    -------
    FreezeAtomsHook
        The hook, zeroing frozen atoms' forces as ASE's ``FixAtoms`` does.
    """
    hooks_module = import_quietly("nvalchemi.dynamics.hooks")
    return hooks_module.FreezeAtomsHook(
        zero_forces=True, zero_velocities=zero_velocities
    )


class EngineDriver:
    """Step an engine over one batch with ``run()``'s semantics, one step at a time.

    Parameters
    ----------
    engine : nvalchemi.dynamics.base.BaseDynamics
        A freshly built engine, used for this batch composition only (engines
        size their state on the first batch and never resize it:
        ``BaseDynamics._ensure_state_initialized`` runs once).
    batch : nvalchemi.data.Batch
        The batch the engine evolves in place.
    """

    def __init__(self, engine: BaseDynamics, batch: Batch) -> None:
        self.engine = engine
        self.batch = batch
        self._open = False

    def open(self) -> bool:
        """Enter the engine's context-manager hooks (as ``run()`` does first).

        Returns
        -------
        bool
            Whether this call entered them (False: they were open already).
        """
        if self._open:
            return False
        open_hooks(self.engine)
        self._open = True
        return True

    def close(self) -> None:
        """Exit the engine's context-manager hooks (as ``run()`` does last)."""
        if self._open:
            self._open = False
            close_hooks(self.engine)

    def prime(self, *, evaluate: bool = True) -> None:
        """Admit the batch and evaluate the model once, before any step.

        ``ON_ADMISSION`` hooks fire, then ``BEFORE_COMPUTE`` → model →
        ``AFTER_COMPUTE`` (with ``step_count`` unchanged), exactly as the first
        ``step()`` of ``run()`` would; the next :meth:`step` then integrates
        without a second evaluation. ``evaluate=False``: every stage but the
        model's, for a batch that already holds its outputs.
        """
        prime_engine(self.engine, self.batch, evaluate=evaluate)

    def step(self) -> None:
        """Advance every active structure by one engine step (all hook stages)."""
        self.engine.step(self.batch)
