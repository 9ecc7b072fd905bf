"""Long-range Coulomb energy of fixed point charges: Ewald and particle-mesh Ewald.

``load_model("ewald")`` and ``load_model("pme")`` build nvalchemi's
``EwaldModelWrapper`` and ``PMEModelWrapper`` (nvalchemiops' Warp kernels) for
periodic cells. Standalone, the charges are each atom's
``atoms.get_initial_charges()`` (e; ``atoms.set_initial_charges``); in a
composition after a charge-predicting model (AIMNet2) they are that model's
``charges`` output. The energy is

    E = (k_e / 2) Σ_i Σ_(j, n)' q_i q_j / |r_i - r_j + n·cell|

summed over all periodic images (the prime drops i = j in the home cell), with
``k_e = ase.units.Hartree * ase.units.Bohr`` = 14.399645 eV·Å/e² (ASE's
constant; nvalchemi's own default is 14.3996). Cells must be charge-neutral
for the lattice sum to converge to the physical value (a net charge gets
nvalchemiops' uniform neutralising background). Forces (eV/Å) and the
tensile-positive stress (eV/Å³, ASE's sign) come from autograd of the energy.

Parameters, all in ASE units:

* ``cutoff`` (Å): real-space cutoff of the erfc-screened sum;
* ``accuracy``: relative accuracy the splitting parameter α and the
  reciprocal-space cutoff are chosen for (nvalchemiops' estimate, per cell;
  α is in 1/Å). PME also takes ``mesh_spacing`` (Å), ``spline_order`` and an
  explicit ``alpha`` (1/Å; None = estimated from ``accuracy``).

Both models need periodic cells (all three axes); a molecule has no Ewald sum.
"""

from __future__ import annotations

import numbers
from typing import TYPE_CHECKING, Any

from ase import units

from nvalchemi_ase._quiet import import_quietly
from nvalchemi_ase.models import registry

if TYPE_CHECKING:
    from nvalchemi.models.base import BaseModelMixin

__all__ = [
    "COULOMB_CONSTANT",
    "ewald",
    "pme",
    "register_models",
]

#: Coulomb's constant in ASE units, eV·Å/e² (= Hartree · Bohr).
COULOMB_CONSTANT = units.Hartree * units.Bohr


def ewald(cutoff: float = 10.0, accuracy: float = 1e-6) -> BaseModelMixin:
    """Ewald summation of the Coulomb energy of fixed charges, batched.

    Parameters
    ----------
    cutoff : float
        Real-space cutoff, Å.
    accuracy : float
        Target relative accuracy of the sum (0 < accuracy < 1); sets α (1/Å)
        and the reciprocal-space cutoff for each cell.

    Returns
    -------
    BaseModelMixin
        nvalchemi's ``EwaldModelWrapper`` with ASE's Coulomb constant. Reads
        ``charges`` [V] e (``atoms.set_initial_charges``). Outputs: ``energy``
        [B, 1] eV, ``forces`` [V, 3] eV/Å, opt-in ``stress`` [B, 3, 3] eV/Å³.

    Raises
    ------
    TypeError, ValueError
        For a non-numeric, non-positive or non-finite parameter (named).
    """
    cutoff = _positive("ewald", "cutoff", cutoff, "Å")
    accuracy = _accuracy("ewald", accuracy)
    module = import_quietly("nvalchemi.models.ewald")
    cls = _charged_class(module.EwaldModelWrapper)
    return cls(  # type: ignore[no-any-return]
        cutoff=cutoff,
        accuracy=accuracy,
        coulomb_constant=COULOMB_CONSTANT,
        **_EXACT_CELL_CACHE,
    )


def pme(
    cutoff: float = 10.0,
    accuracy: float = 1e-6,
    mesh_spacing: float = 1.0,
    spline_order: int = 4,
    alpha: float | None = None,
) -> BaseModelMixin:
    """Particle-mesh Ewald (B-spline charge mesh and FFT), batched.

    Parameters
    ----------
    cutoff : float
        Real-space cutoff, Å.
    accuracy : float
        Target relative accuracy (0 < accuracy < 1) for the estimate of α.
    mesh_spacing : float
        Target spacing of the charge mesh, Å (smaller is more accurate).
    spline_order : int
        B-spline order (4 = cubic), 3 to 8.
    alpha : float, optional
        Ewald splitting parameter, 1/Å; None estimates it from ``accuracy``.

    Returns
    -------
    BaseModelMixin
        nvalchemi's ``PMEModelWrapper`` with ASE's Coulomb constant; inputs and
        outputs as :func:`ewald`.

    Raises
    ------
    TypeError, ValueError
        For a parameter of the wrong type or range (named).
    """
    cutoff = _positive("pme", "cutoff", cutoff, "Å")
    accuracy = _accuracy("pme", accuracy)
    mesh_spacing = _positive("pme", "mesh_spacing", mesh_spacing, "Å")
    if isinstance(spline_order, bool) or not isinstance(spline_order, numbers.Integral):
        raise TypeError(f"pme: spline_order must be an int, got {spline_order!r}")
    if not 3 <= spline_order <= 8:
        raise ValueError(f"pme: spline_order must be 3 to 8, got {spline_order}")
    if alpha is not None:
        alpha = _positive("pme", "alpha", alpha, "1/Å")
    module = import_quietly("nvalchemi.models.pme")
    cls = _charged_class(module.PMEModelWrapper)
    return cls(  # type: ignore[no-any-return]
        cutoff=cutoff,
        accuracy=accuracy,
        mesh_spacing=mesh_spacing,
        spline_order=int(spline_order),
        alpha=alpha,
        coulomb_constant=COULOMB_CONSTANT,
        **_EXACT_CELL_CACHE,
    )


#: Any change of a cell refreshes α, the k-vectors and the mesh. nvalchemi's
#: default reuses them while the cell stays within rtol 1e-5 (+1e-6 Å), which
#: gives stale energies for small strains (a 1e-5 strain: PME stress 25 % off).
_EXACT_CELL_CACHE = {"rtol": 0.0, "atol": 0.0}

_CLASSES: dict[Any, Any] = {}


def _charged_class(wrapper: Any) -> Any:
    """Subclass ``wrapper``: missing charges or cells are clear errors."""
    if wrapper not in _CLASSES:

        class Charged(wrapper):  # type: ignore[misc, valid-type]
            supported_elements = None

            def adapt_input(self, data: Any, **kwargs: Any) -> Any:
                _require_charges_and_cells(data, type(self).__name__)
                return super().adapt_input(data, **kwargs)

        Charged.__name__ = Charged.__qualname__ = wrapper.__name__
        Charged.__doc__ = wrapper.__doc__
        _CLASSES[wrapper] = Charged
    return _CLASSES[wrapper]


def _require_charges_and_cells(data: Any, name: str) -> None:
    if getattr(data, "charges", None) is None:
        raise ValueError(
            f"{name} needs per-atom charges: set them with "
            "atoms.set_initial_charges(q) (e) on every structure, or compose "
            "it after a charge-predicting model"
        )
    pbc = getattr(data, "pbc", None)
    if pbc is not None and not bool(pbc.all()):
        index = int((~pbc.reshape(-1, 3).all(dim=1)).nonzero()[0, 0])
        raise ValueError(
            f"structure {index}: {name} needs a periodic cell on all three axes "
            "(pbc=True); an isolated or slab structure has no Ewald sum"
        )


def _positive(model: str, name: str, value: Any, unit: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{model}: {name} must be a number ({unit}), got {value!r}")
    value = float(value)
    if not 0 < value < float("inf"):
        raise ValueError(
            f"{model}: {name} must be positive and finite ({unit}), got {value}"
        )
    return value


def _accuracy(model: str, value: Any) -> float:
    value = _positive(model, "accuracy", value, "relative")
    if not value < 1:
        raise ValueError(f"{model}: accuracy must be below 1, got {value}")
    return value


def register_models() -> None:
    """Add ``"ewald"`` and ``"pme"`` to the model registry."""
    registry.register(
        registry.ModelInfo(
            name="ewald",
            factory=ewald,
            summary="Ewald sum of fixed charges (initial_charges, e; periodic cells)",
            elements="any",
            cutoff="10 Å real space (parameter); reciprocal from accuracy",
            dtype="any",
            licence="Apache-2.0 (nvalchemi, nvalchemiops)",
        )
    )
    registry.register(
        registry.ModelInfo(
            name="pme",
            factory=pme,
            summary="particle-mesh Ewald of fixed charges (initial_charges, e)",
            elements="any",
            cutoff="10 Å real space (parameter); 1 Å mesh (parameter)",
            dtype="any",
            licence="Apache-2.0 (nvalchemi, nvalchemiops)",
        )
    )
