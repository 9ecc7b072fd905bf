"""An ASE ``Calculator`` over a batched nvalchemi model.

``NVAlchemiCalculator`` evaluates one ``Atoms`` through ASE's usual
``get_potential_energy()``/``get_forces()``/``get_stress()``, and any number of
structures in one model call through :meth:`NVAlchemiCalculator.calculate_batch`.
Both go through the same code path: Atoms →
:func:`~nvalchemi_ase.convert.atoms_to_batch` → neighbour list from the model's
``NeighborConfig`` (``nvalchemi.neighbors.compute_neighbors``; a composed model's
lists by its own hooks, :func:`~nvalchemi_ase.models.composition.build_neighbors`)
→ ``model(batch)`` →
:func:`~nvalchemi_ase.convert.batch_results` → fresh float64 NumPy arrays.
"""

from __future__ import annotations

import copy
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from ase import Atoms
from ase.calculators.calculator import (
    Calculator,
    PropertyNotImplementedError,
    all_changes,
)

from nvalchemi_ase.convert import (
    as_atoms_list,
    atoms_to_batch,
    batch_results,
    check_images,
    refresh_positions,
)
from nvalchemi_ase.devices import DtypeLike, resolve_device, resolve_dtype
from nvalchemi_ase.models import model_native_dtype, resolve_model
from nvalchemi_ase.models.composition import build_neighbors
from nvalchemi_ase.models.locks import model_lock
from nvalchemi_ase.typing import DeviceLike, ModelLike

if TYPE_CHECKING:
    from nvalchemi.data import Batch

__all__ = ["NVAlchemiCalculator"]

# ASE property -> nvalchemi model output it needs.
_MODEL_OUTPUT_OF = {
    "energy": "energy",
    "free_energy": "energy",
    "forces": "forces",
    "stress": "stress",
    "energies": "atomic_energies",
    "charges": "charges",
}
# ``atoms.info`` keys a model may read; a change to them invalidates results.
_INFO_INPUTS = ("charge", "spin")


@dataclass
class _SharedState:
    """What a calculator and its per-structure views share besides the model."""

    stress_wanted: bool = False
    # Only read or written under the model's lock (``model_lock``).
    reusable: tuple[tuple[Any, ...], Batch] | None = None
    # Guards which structure owns which calculator (``_claim``).
    claims: threading.RLock = field(default_factory=threading.RLock)


class NVAlchemiCalculator(Calculator):
    """ASE calculator running an nvalchemi model, one structure or many at once.

    Parameters
    ----------
    model : BaseModelMixin or str
        An nvalchemi model wrapper, or a name for
        :func:`nvalchemi_ase.models.load_model` (``"lj"``, ``"demo"``, ...).
    device : torch.device or str or None
        ``None``: CUDA when available, else CPU.
    dtype : torch.dtype or str or None
        Precision of positions, cell and the model; ``None`` uses the model's
        own weight dtype (float32 for SevenNet-0 and the demo model) and float64
        for weightless analytic models such as LJ.

        A model object you pass is never changed: if its weights are on
        another device or in another dtype, the calculator works on a copy
        (``calc.model``); pass a model already there to share it.
    **model_params
        Parameters for :func:`~nvalchemi_ase.models.load_model` when ``model`` is
        a name (ASE units: eV, Å).

    Notes
    -----
    Properties (float64 NumPy on the CPU, fresh copies):

    * ``energy``, ``free_energy`` (equal), eV;
    * ``forces``, shape (N, 3), eV/Å (energy and forces are always computed
      together);
    * ``stress``, shape (6,), Voigt xx yy zz yz xz xy, eV/Å³, tensile positive
      (ASE's sign), for structures whose cell has rank 3 (ASE's rule); computed
      only when asked for, and from then on with every evaluation (ASE asks for
      forces and stress separately in cell relaxations);
    * ``energies`` (N,) eV and ``charges`` (N,) e when the model outputs
      ``atomic_energies`` / ``charges``.

    Results are cached as ASE does (``check_state``); a change to
    ``atoms.info["charge"]`` or ``atoms.info["spin"]`` also invalidates them.

    **One calculator, many structures.** An ASE calculator holds the results
    of one structure (``calc.atoms``, ``calc.results``), and ASE's writers read
    ``atoms.calc.results`` directly. When this calculator is attached to several
    ``Atoms`` (``atoms.calc = calc`` for a whole list, as batched dynamics
    leave them), the first structure it serves keeps it, and every other
    structure that asks it for results — or gets results from
    :meth:`calculate_batch` or a batched run — is given its own view:
    ``atoms.calc`` becomes an ``NVAlchemiCalculator`` sharing this one's
    model, device, dtype and buffers, holding that structure's results only.
    So ``atoms.get_*()``, ``atoms.calc.results``, ``ase.io.write`` (extxyz,
    traj) and ``ase.db`` give every structure its own numbers, and moving one
    structure invalidates its results only.

    Examples
    --------
    >>> from ase.build import bulk
    >>> from nvalchemi_ase import NVAlchemiCalculator
    >>> atoms = bulk("Ar", "fcc", a=5.26, cubic=True)
    >>> atoms.calc = NVAlchemiCalculator("lj", device="cpu")
    >>> round(atoms.get_potential_energy(), 4)  # doctest: +SKIP
    -0.3375
    """

    name = "nvalchemi"
    # ASE declares these as instance attributes; ``implemented_properties`` is
    # narrowed per instance to what the model can produce.
    implemented_properties = list(_MODEL_OUTPUT_OF)  # noqa: RUF012
    ignored_changes = set()  # noqa: RUF012

    def __init__(
        self,
        model: ModelLike = "lj",
        *,
        device: DeviceLike = None,
        dtype: DtypeLike = None,
        **model_params: Any,
    ) -> None:
        super().__init__()
        self.model = resolve_model(model, **model_params)
        self.device = resolve_device(device)
        native = model_native_dtype(self.model)
        self.dtype = resolve_dtype(dtype, default=native or torch.float64)
        if isinstance(self.model, torch.nn.Module) and not _is_on(
            self.model, self.device, self.dtype
        ):
            owned = self.model if isinstance(model, str) else copy.deepcopy(self.model)
            self.model = owned.to(device=self.device, dtype=self.dtype)
        outputs = self.model.model_config.outputs
        self.implemented_properties = [
            prop for prop, needed in _MODEL_OUTPUT_OF.items() if needed in outputs
        ]
        self.parameters.update(
            model=model if isinstance(model, str) else type(self.model).__name__,
            device=str(self.device),
            dtype=str(self.dtype).removeprefix("torch."),
            **model_params,
        )
        self._shared = _SharedState()
        self._owner: weakref.ref[Atoms] | None = None
        self._lock = threading.RLock()  # this calculator's atoms and results
        # How to build the model again in another process (pickling).
        self._model_name = model if isinstance(model, str) else None
        self._model_params = dict(model_params)

    # -- threads and processes ---------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        """State for pickling (``concurrent.futures`` process pools).

        A calculator built from a model name is sent as that name and its
        parameters and builds its model again on the other side; one built
        around a model object sends the object (torch pickles modules with
        their weights). Locks, the reusable batch and which ``Atoms`` owns
        the calculator stay behind; ``atoms`` and ``results`` travel.

        Raises
        ------
        TypeError
            If the model object cannot be pickled (the message says to pass a
            model name instead).
        """
        import pickle

        state = dict(self.__dict__)
        for key in ("_lock", "_owner", "_shared"):
            state.pop(key, None)
        state["_stress_wanted"] = self._shared.stress_wanted
        if self._model_name is not None:
            state.pop("model")
            return state
        try:
            pickle.dumps(self.model)
        except Exception as error:
            raise TypeError(
                f"this NVAlchemiCalculator cannot be pickled: its model "
                f"{type(self.model).__name__} cannot be ({error}); build the "
                "calculator from a model name (NVAlchemiCalculator('sevennet-0')) "
                "so that each process loads the model itself, or create the "
                "calculator inside the worker"
            ) from error
        return state

    def __copy__(self) -> NVAlchemiCalculator:
        """Return a calculator over the same model and buffers (shallow copy)."""
        clone = object.__new__(type(self))
        clone.__dict__.update(self.__dict__)
        clone.results = dict(self.results)
        clone._owner = None
        clone._lock = threading.RLock()
        return clone

    def __deepcopy__(self, memo: dict[int, Any]) -> NVAlchemiCalculator:
        """Return a calculator with its own copy of the model (no pickling)."""
        clone = object.__new__(type(self))
        memo[id(self)] = clone
        state = {
            key: value
            for key, value in self.__dict__.items()
            if key not in ("_lock", "_owner", "_shared")
        }
        clone.__dict__.update(copy.deepcopy(state, memo))
        clone._shared = _SharedState(stress_wanted=self._shared.stress_wanted)
        clone._owner = None
        clone._lock = threading.RLock()
        return clone

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Rebuild a pickled calculator (see :meth:`__getstate__`)."""
        stress_wanted = state.pop("_stress_wanted", False)
        self.__dict__.update(state)
        if "model" not in state:
            rebuilt = resolve_model(self._model_name, **self._model_params)
            if isinstance(rebuilt, torch.nn.Module):
                rebuilt = rebuilt.to(device=self.device, dtype=self.dtype)
            self.model = rebuilt
        self._shared = _SharedState(stress_wanted=stress_wanted)
        self._owner = None
        self._lock = threading.RLock()

    # -- ASE protocol ---------------------------------------------------------

    def calculate(
        self,
        atoms: Atoms | None = None,
        properties: Sequence[str] = ("energy",),
        system_changes: Sequence[str] = tuple(all_changes),
    ) -> None:
        """Evaluate the model on one structure (ASE's calculator protocol).

        Parameters
        ----------
        atoms : ase.Atoms, optional
            The structure; copied, never modified.
        properties : sequence of str
            Properties ASE asks for (see the class notes).
        system_changes : sequence of str
            What changed since the last call (from ``check_state``).

        Raises
        ------
        PropertyNotImplementedError
            If a property is not available for this model or structure (e.g.
            stress of a structure whose cell has rank < 3).
        """
        with self._lock:
            previous = self.atoms
            super().calculate(atoms, list(properties), list(system_changes))
            try:
                results = self._evaluate([self.atoms], properties)[0]
            except Exception:
                self.atoms = previous  # a refused structure is not adopted
                raise
            missing = [p for p in properties if p not in results]
            if missing:
                raise PropertyNotImplementedError(
                    f"{missing} not available for this structure: stress needs a "
                    f"cell of rank 3 (cell = {self.atoms.cell.array.tolist()}); give "
                    "the structure three lattice vectors, e.g. "
                    "atoms.center(vacuum=10.0)"
                )
            self.results = results

    def check_state(self, atoms: Atoms, tol: float = 1e-15) -> list[str]:
        """ASE's state check, plus ``info["charge"]``/``info["spin"]`` changes.

        Parameters
        ----------
        atoms : ase.Atoms
            The structure asked about.
        tol : float
            Tolerance for positions/cell comparisons (Å).

        Returns
        -------
        list of str
            Names of what changed (empty when the cached results still hold).
        """
        if self.atoms is not None and _identical_state(self.atoms, atoms):
            changes = []  # exact equality implies ASE's tolerance check passes
        else:
            changes = list(super().check_state(atoms, tol))
        if self.atoms is not None and any(
            self.atoms.info.get(key) != atoms.info.get(key) for key in _INFO_INPUTS
        ):
            changes.append("info")
        return changes

    def store_results(self, atoms: Atoms, results: dict[str, Any]) -> None:
        """Adopt results computed elsewhere (e.g. by a batched dynamics engine).

        Afterwards ``atoms.get_potential_energy()`` etc. return them without a
        model call, until the atoms change.

        Parameters
        ----------
        atoms : ase.Atoms
            The structure the results belong to (its state is copied).
        results : dict
            ASE results as :func:`~nvalchemi_ase.convert.batch_results` makes them.
        """
        target = self._claim(atoms)
        with target._lock:
            target.atoms = atoms.copy()
            target.results = dict(results)

    def get_property(
        self, name: str, atoms: Atoms | None = None, allow_calculation: bool = True
    ) -> Any:
        """ASE's ``get_property``, answered by the calculator holding ``atoms``.

        If this calculator already holds the results of another live ``Atoms``
        that it is attached to, ``atoms`` gets its own view (see the class
        notes) and the view answers, so neither structure's results are lost.

        Parameters
        ----------
        name : str
            Property name.
        atoms : ase.Atoms, optional
            The structure asked about.
        allow_calculation : bool
            Whether a model call may be made if no valid result is cached.

        Returns
        -------
        Any
            The property (arrays are fresh copies).
        """
        if atoms is None:
            with self._lock:
                return super().get_property(name, atoms, allow_calculation)
        while True:
            attached = atoms.calc
            target = self._claim(atoms)
            if target is not self:
                try:
                    return target.get_property(name, atoms, allow_calculation)
                except Exception:
                    if atoms.calc is target and not target.results:
                        atoms.calc = attached  # a refused call leaves atoms as it was
                    raise
            with self._lock:
                if self._holds(atoms):  # still ours once the lock is held
                    return super().get_property(name, atoms, allow_calculation)

    def _holds(self, atoms: Atoms) -> bool:
        """Whether ``atoms`` is the structure this calculator answers for."""
        owner = None if self._owner is None else self._owner()
        return owner is atoms

    def _claim(self, atoms: Atoms) -> NVAlchemiCalculator:
        """Return the calculator holding ``atoms``'s results: this one or a new view.

        This calculator belongs to the first ``Atoms`` it served for as long as
        that structure lives and keeps it attached; any other structure gets a
        view, attached in its place when it had this calculator attached.
        """
        with self._shared.claims:
            owner = None if self._owner is None else self._owner()
            if owner is None or owner is atoms or owner.calc is not self:
                self._owner = weakref.ref(atoms)
                return self
            view = self._view()
            view._owner = weakref.ref(atoms)
            if atoms.calc is self:
                atoms.calc = view
            return view

    def _view(self) -> NVAlchemiCalculator:
        """Return a calculator over the same model and buffers, holding no results."""
        view = copy.copy(self)
        view.atoms = None
        view.results = {}
        view.parameters = copy.deepcopy(self.parameters)
        return view

    # -- batched API ----------------------------------------------------------

    def calculate_batch(
        self,
        images: Atoms | Sequence[Atoms],
        properties: Sequence[str] = ("energy", "forces"),
    ) -> list[dict[str, Any]]:
        """Evaluate many structures in one model call.

        Structures this calculator is attached to (``atoms.calc = calc``, or
        a view it gave them) keep their results: afterwards
        ``atoms.get_potential_energy()`` etc., ``atoms.calc.results``,
        ``ase.io.write`` and ``ase.db`` give each structure its own numbers
        without another model call, until that structure changes (see the
        class notes on views). Other structures' calculators are not touched.

        Parameters
        ----------
        images : ase.Atoms or sequence of ase.Atoms
            B structures (positions, cell, arrays and info are never modified).
        properties : sequence of str
            Properties wanted; ``stress`` is returned only for structures whose
            cell has rank 3.

        Returns
        -------
        list of dict
            One result dict per structure, as ``calc.results`` would hold after a
            single-structure call (same numbers).

        Raises
        ------
        PropertyNotImplementedError
            If the model cannot produce a requested property.
        nvalchemi_ase.convert.StructureError
            For an invalid structure (index, field and fix named), before any
            model call.
        """
        atoms_list = as_atoms_list(images)
        results = self._evaluate(atoms_list, properties)
        self._keep_results(atoms_list, results)
        return results

    def _keep_results(self, images: list[Atoms], results: list[dict[str, Any]]) -> None:
        """Store each result in its structure's calculator if that is this one."""
        for atoms, result in zip(images, results, strict=True):
            calc = atoms.calc
            if isinstance(calc, NVAlchemiCalculator) and calc._shared is self._shared:
                calc.store_results(atoms, _copied(result))

    # -- internals -------------------------------------------------------------

    def _evaluate(
        self, images: list[Atoms], properties: Sequence[str]
    ) -> list[dict[str, Any]]:
        unknown = [p for p in properties if p not in self.implemented_properties]
        if unknown:
            raise PropertyNotImplementedError(
                f"{unknown} cannot be computed by {type(self.model).__name__}; it "
                f"provides {self.implemented_properties}"
            )
        if "stress" in properties:
            self._shared.stress_wanted = True
        check_images(images, model=self.model)
        # The model and the reusable batch are shared: one evaluation at a time
        # per model object; every result leaves the lock as fresh NumPy arrays.
        with model_lock(self.model):
            batch = self._batch_for(images)
            return batch_results(batch, self._run_model(batch, properties))

    def _batch_for(self, images: list[Atoms]) -> Batch:
        """Build the batch of ``images``, reusing the last one where possible.

        ASE calls a calculator again and again on one ``Atoms`` that moves, so a
        single structure's batch is kept and only its positions and cell are
        refreshed while everything else the model reads is unchanged.
        """
        key = _model_inputs_key(images[0]) if len(images) == 1 else None
        reusable = self._shared.reusable
        if key is not None and reusable is not None and reusable[0] == key:
            batch = reusable[1]
            refresh_positions(batch, images)
            return batch
        batch = atoms_to_batch(
            images, device=self.device, dtype=self.dtype, warn_dropped=False
        )
        self._shared.reusable = None if key is None else (key, batch)
        return batch

    def _run_model(self, batch: Batch, properties: Sequence[str]) -> dict[str, Any]:
        build_neighbors(self.model, batch)  # every list a composed model plans
        wanted = {"energy", "forces"} | {_MODEL_OUTPUT_OF[p] for p in properties}
        if self._shared.stress_wanted:
            wanted.add("stress")
        wanted &= set(self.model.model_config.outputs)
        with (
            self.model.narrowed_outputs(wanted),
            torch.set_grad_enabled(self.model.requires_autograd),
        ):
            outputs = self.model(batch)
        return {
            key: value.detach()
            for key, value in outputs.items()
            if isinstance(value, torch.Tensor)
        }


def _copied(results: dict[str, Any]) -> dict[str, Any]:
    """``results`` with fresh arrays (the caller keeps the returned ones)."""
    return {
        key: value.copy() if isinstance(value, np.ndarray) else value
        for key, value in results.items()
    }


def _is_on(module: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether every weight and buffer already has ``device`` and (floats) ``dtype``."""
    for tensor in [*module.parameters(), *module.buffers()]:
        if tensor.device.type != device.type or (
            device.index is not None and tensor.device.index != device.index
        ):
            return False
        if tensor.is_floating_point() and tensor.dtype != dtype:
            return False
    return True


def _identical_state(cached: Atoms, atoms: Atoms) -> bool:
    """Whether everything ASE's ``compare_atoms`` checks is bit-for-bit unchanged.

    A cheap stand-in for ``compare_atoms`` (``numpy.allclose`` on each of
    ``all_changes``) in the common case; anything not identical goes through
    ASE's own check.
    """
    watched = [key for key in all_changes if key not in ("cell", "pbc")]
    if {k for k in watched if k in cached.arrays} != {
        k for k in watched if k in atoms.arrays
    }:
        return False
    return (
        np.array_equal(cached.cell.array, atoms.cell.array)
        and np.array_equal(cached.pbc, atoms.pbc)
        and all(
            np.array_equal(cached.arrays[key], atoms.arrays[key])
            for key in watched
            if key in atoms.arrays
        )
    )


def _model_inputs_key(atoms: Atoms) -> tuple[Any, ...]:
    """Everything of ``atoms`` a model reads, except positions and cell vectors."""
    charges = atoms.arrays.get("initial_charges")
    return (
        atoms.arrays["numbers"].tobytes(),
        atoms.pbc.tobytes(),
        (atoms.cell.array == 0).all(axis=1).tobytes(),
        None if charges is None else charges.tobytes(),
        atoms.info.get("charge"),
        atoms.info.get("spin"),
    )
