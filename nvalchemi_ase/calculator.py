"""An ASE ``Calculator`` over a batched nvalchemi model.

``NVAlchemiCalculator`` evaluates one ``Atoms`` through ASE's usual
``get_potential_energy()``/``get_forces()``/``get_stress()``, and any number of
structures in one model call through :meth:`NVAlchemiCalculator.calculate_batch`.
Both go through the same code path: Atoms →
:func:`~nvalchemi_ase.convert.atoms_to_batch` → neighbour list from the model's
``NeighborConfig`` (``nvalchemi.neighbors.compute_neighbors``) → ``model(batch)`` →
:func:`~nvalchemi_ase.convert.batch_results` → fresh float64 NumPy arrays.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from ase import Atoms
from ase.calculators.calculator import (
    Calculator,
    PropertyNotImplementedError,
    all_changes,
)

from nvalchemi_ase._quiet import import_quietly
from nvalchemi_ase.convert import (
    as_atoms_list,
    atoms_to_batch,
    batch_results,
    refresh_positions,
)
from nvalchemi_ase.devices import DtypeLike, resolve_device, resolve_dtype
from nvalchemi_ase.models import model_native_dtype, resolve_model

if TYPE_CHECKING:
    from nvalchemi.data import Batch
    from nvalchemi.models.base import BaseModelMixin

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


class NVAlchemiCalculator(Calculator):
    """ASE calculator running an nvalchemi model, one structure or many at once.

    Parameters
    ----------
    model : BaseModelMixin or str
        An nvalchemi model wrapper, or a name for
        :func:`nvalchemi_ase.models.load_model` (``"lj"``, ``"demo"``, ...).
    device : torch.device or str or None
        ``None``: CUDA when available, else CPU. The model is moved there.
    dtype : torch.dtype or str or None
        Precision of positions, cell and the model; ``None`` uses the model's
        own weight dtype (float32 for SevenNet-0 and the demo model) and float64
        for weightless analytic models such as LJ.
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
        model: BaseModelMixin | str = "lj",
        *,
        device: torch.device | str | None = None,
        dtype: DtypeLike = None,
        **model_params: Any,
    ) -> None:
        super().__init__()
        self.model = resolve_model(model, **model_params)
        self.device = resolve_device(device)
        native = model_native_dtype(self.model)
        self.dtype = resolve_dtype(dtype, default=native or torch.float64)
        if isinstance(self.model, torch.nn.Module):
            self.model.to(device=self.device, dtype=self.dtype)
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
        self._stress_wanted = False
        self._per_atoms_cache: dict[int, tuple[Any, Atoms, dict[str, Any]]] = {}
        self._reusable: tuple[tuple[Any, ...], Batch] | None = None

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
        super().calculate(atoms, list(properties), list(system_changes))
        results = self._evaluate([self.atoms], properties)[0]
        missing = [p for p in properties if p not in results]
        if missing:
            raise PropertyNotImplementedError(
                f"{missing} not available for this structure: stress needs a cell of "
                f"rank 3 (cell = {self.atoms.cell.array.tolist()}); give the structure "
                "three lattice vectors, e.g. atoms.center(vacuum=10.0)"
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
        self.atoms = atoms.copy()
        self.results = dict(results)
        self._remember(atoms)

    def get_property(
        self, name: str, atoms: Atoms | None = None, allow_calculation: bool = True
    ) -> Any:
        """ASE's ``get_property``, with one cache entry per structure.

        ASE's calculators cache the results of the last structure only; this one
        remembers the latest results of every live ``Atoms`` it served, so one
        calculator shared by a list of structures (as batched dynamics leave
        them) answers each without a new model call until that structure changes.

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
            return super().get_property(name, atoms, allow_calculation)
        self._recall(atoms)
        value = super().get_property(name, atoms, allow_calculation)
        self._remember(atoms)
        return value

    def reset(self) -> None:
        """Forget every cached result (ASE's ``reset``, for all structures)."""
        super().reset()
        self._per_atoms_cache = {}

    def _remember(self, atoms: Atoms) -> None:
        if self.atoms is None:
            return
        cache = self._per_atoms_cache
        for key in [key for key, entry in cache.items() if entry[0]() is None]:
            del cache[key]
        cache[id(atoms)] = (weakref.ref(atoms), self.atoms, self.results)

    def _recall(self, atoms: Atoms) -> None:
        entry = self._per_atoms_cache.get(id(atoms))
        if entry is not None and entry[0]() is atoms:
            self.atoms, self.results = entry[1], entry[2]

    # -- batched API ----------------------------------------------------------

    def calculate_batch(
        self,
        images: Atoms | Sequence[Atoms],
        properties: Sequence[str] = ("energy", "forces"),
    ) -> list[dict[str, Any]]:
        """Evaluate many structures in one model call.

        Parameters
        ----------
        images : ase.Atoms or sequence of ase.Atoms
            B structures (never modified; their calculators are not touched).
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
        return self._evaluate(as_atoms_list(images), properties)

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
        self._stress_wanted |= "stress" in properties
        batch = self._batch_for(images)
        return batch_results(batch, self._run_model(batch, properties))

    def _batch_for(self, images: list[Atoms]) -> Batch:
        """Build the batch of ``images``, reusing the last one where possible.

        ASE calls a calculator again and again on one ``Atoms`` that moves, so a
        single structure's batch is kept and only its positions and cell are
        refreshed while everything else the model reads is unchanged.
        """
        key = _model_inputs_key(images[0]) if len(images) == 1 else None
        if key is not None and self._reusable is not None and self._reusable[0] == key:
            batch = self._reusable[1]
            refresh_positions(batch, images)
            return batch
        batch = atoms_to_batch(
            images, device=self.device, dtype=self.dtype, warn_dropped=False
        )
        self._reusable = None if key is None else (key, batch)
        return batch

    def _run_model(self, batch: Batch, properties: Sequence[str]) -> dict[str, Any]:
        neighbor_config = self.model.model_config.neighbor_config
        if neighbor_config is not None:
            neighbors = import_quietly("nvalchemi.neighbors")
            neighbors.compute_neighbors(batch, config=neighbor_config)
        wanted = {"energy", "forces"} | {_MODEL_OUTPUT_OF[p] for p in properties}
        if self._stress_wanted:
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
