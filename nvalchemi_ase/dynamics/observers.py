"""ASE observers on nvalchemi hook stages: the only module that knows both protocols.

ASE calls an observer ``function(*args, **kwargs)`` attached with
``attach(function, interval)`` whenever ``nsteps % interval == 0`` (interval > 0,
including ``nsteps == 0`` before the first step) or exactly when
``nsteps == |interval|`` (interval <= 0). nvalchemi calls a hook ``hook(ctx,
stage)`` at one of its ``DynamicsStage``s whenever ``step_count % frequency ==
0`` — after nvalchemi's steps 0, 2, 4... for ``frequency=2``, where ASE would call
after its steps 0, 2, 4 counted from the initial state. The two counts differ by
one, so observers are gated on ASE's own ``nsteps`` here and nvalchemi hooks keep
their native ``frequency``.

==============================  =========================  ==========================
attached to the ASE-style       where it runs              what it sees
object with
==============================  =========================  ==========================
``attach(f, interval)`` /       where ASE calls observers: the ``Atoms``, updated to
``insert_observer(...)``        after the step (the        that step: positions,
                                ``AFTER_STEP`` point) and  momenta, cell, energy,
                                once at ``nsteps == 0``;   forces, stress (no extra
                                ASE's interval rule        model call)
``attach_at(stage, f,           the given                  the ``Atoms``, updated to
interval)``                     ``DynamicsStage``; ASE's   the batch as it is at that
                                interval rule on the ASE   stage
                                step that stage belongs to
                                (0 for ``ON_ADMISSION``
                                and the initial
                                evaluation)
``attach(hook)`` with an        natively on the engine,    nvalchemi's
nvalchemi ``Hook`` (has         at ``hook.stage`` with     ``DynamicsContext``
``stage`` and ``frequency``)    nvalchemi's frequency      (the live ``Batch``)
==============================  =========================  ==========================

ASE step ``k`` (``nsteps`` becoming ``k``) is nvalchemi's step with
``step_count == k - 1``; its stages run from ``BEFORE_STEP`` to ``AFTER_STEP``
(and ``ON_CONVERGE``/``ON_GRADUATE`` after it). Copies from the batch to the
``Atoms`` happen only on steps where some observer is due.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["ObserverEntry", "StageObserverHook", "is_due", "is_nvalchemi_hook"]


def is_due(interval: int, nsteps: int) -> bool:
    """Return whether an observer with ``interval`` is due at ``nsteps`` (ASE's rule).

    Parameters
    ----------
    interval : int
        Positive: every ``interval`` steps, counting the initial state as 0;
        zero or negative: only when ``nsteps == abs(interval)``.
    nsteps : int
        ASE's step counter.

    Returns
    -------
    bool
        Whether ``ase.optimize.optimize.BaseDynamics.call_observers`` would call it.
    """
    if interval > 0:
        return nsteps % interval == 0
    return nsteps == abs(interval)


def is_nvalchemi_hook(obj: object) -> bool:
    """Whether ``obj`` follows nvalchemi's ``Hook`` protocol (``stage``, ``frequency``).

    Parameters
    ----------
    obj : object
        Anything attached to an ASE-style dynamics object.

    Returns
    -------
    bool
        True for nvalchemi hooks (built-in or user-written); False for plain
        callables and objects with a ``write`` method such as ``Trajectory``.
    """
    return callable(obj) and hasattr(obj, "stage") and hasattr(obj, "frequency")


#: ASE's observer record: ``(function, interval, args, kwargs)``.
ObserverEntry = tuple[Callable[..., Any], int, tuple[Any, ...], dict[str, Any]]


class StageObserverHook:
    """An nvalchemi hook calling ASE-style observers at one stage.

    It fires on every nvalchemi step (``frequency = 1``) and gates each observer on
    the ASE step the stage belongs to, so ``interval`` means what it means in
    ASE. Before calling due observers it asks the owner to copy the batch into
    the ``Atoms``.

    Parameters
    ----------
    stage : DynamicsStage
        Where to run.
    ase_step : callable
        Returns the ASE step number the stage currently belongs to.
    sync_atoms : callable
        Copies the batch state into the user's ``Atoms``.
    """

    frequency = 1

    def __init__(
        self,
        stage: Any,
        ase_step: Callable[[], int],
        sync_atoms: Callable[[], None],
    ) -> None:
        self.stage = stage
        self.observers: list[ObserverEntry] = []
        self._ase_step = ase_step
        self._sync_atoms = sync_atoms

    def __call__(self, ctx: Any, stage: Any) -> None:
        """Call the observers due at the ASE step this stage belongs to."""
        nsteps = self._ase_step()
        due = [entry for entry in self.observers if is_due(entry[1], nsteps)]
        if not due:
            return
        self._sync_atoms()
        for function, _, args, kwargs in due:
            function(*args, **kwargs)
