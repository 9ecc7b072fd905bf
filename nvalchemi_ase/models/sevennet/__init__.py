"""SevenNet-0 and the other checkpoints of the ``sevenn`` wheel, batched.

Four checkpoints ship in sevenn 0.13's wheel, all 89 elements, 5 Å, float32:
SevenNet-0 (11 Jul 2024, :func:`sevennet_0`), its 22 May 2024 release
(:func:`sevennet_0_22may2024`), SevenNet-l3i5 (lmax 3, :func:`sevennet_l3i5`)
and the multi-fidelity SevenNet-MF-0 (:func:`sevennet_mf_0`, ``modal="pbe"``
or ``"r2scan"``). They share one architecture and one wrapper; what follows
says "SevenNet-0" for all of them.

SevenNet-0 (``sevenn`` package, MIT licence; "7net-0", 11 Jul 2024) is a
universal interatomic potential (NequIP-style E(3)-equivariant message passing,
5 interaction layers, 89 elements, trained on MPtrj at the PBE/PBE+U level, 5 Å
cutoff). Its weights ship inside the ``sevenn`` wheel, so loading needs no
network. ``sevenn``'s own ASE calculator evaluates one structure per call; the
wrapper built here evaluates a whole nvalchemi ``Batch`` in one forward pass:

* the graph comes from nvalchemi's neighbour list; edges longer than the
  model's cutoff are dropped, so a list built with a Verlet skin gives the same
  results;
* edge vectors ``r_ij = x_j - x_i + S_ij · cell`` feed SevenNet's layers, whose
  per-atom energies are summed per structure;
* forces and the tensile-positive stress (ASE's sign) come from one autograd
  pass with respect to the edge vectors
  (:mod:`nvalchemi_ase.models.edge_vectors`).

Memory grows with the edges of the whole batch: about 250 kB per edge in
float32 (8 GB for 784 atoms, 33 000 edges; :mod:`nvalchemi_ase.models.memory`).

The package's modules, one concern each:

* :mod:`~nvalchemi_ase.models.sevennet.loading`: the checkpoint in the wheel,
  checked to be data before sevenn reads it;
* :mod:`~nvalchemi_ase.models.sevennet.wrapper`: the nvalchemi model;
* :mod:`~nvalchemi_ase.models.sevennet.speed`: tiled convolutions and e3nn's
  slices rewritten, with the sevenn and e3nn versions they were checked on.

``import nvalchemi_ase.models`` does not import ``sevenn`` or ``nvalchemi``:
both are imported (silently) when :func:`sevennet_0` is first called.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from nvalchemi_ase.models import registry
from nvalchemi_ase.models.sevennet.loading import (
    CHECKPOINTS,
    SEVENNET_0_CUTOFF,
    SEVENNET_EXTRA,
    build_network,
)
from nvalchemi_ase.models.sevennet.speed import CONVOLUTION_TILE_BYTES

if TYPE_CHECKING:
    from nvalchemi.models.base import BaseModelMixin

__all__ = [
    "CHECKPOINTS",
    "CONVOLUTION_TILE_BYTES",
    "SEVENNET_0_CUTOFF",
    "SEVENNET_EXTRA",
    "register_models",
    "sevennet_0",
    "sevennet_0_22may2024",
    "sevennet_l3i5",
    "sevennet_mf_0",
    "sevennet_mf_0_pbe",
    "sevennet_mf_0_r2scan",
]


def sevennet_0() -> BaseModelMixin:
    """SevenNet-0 (11 Jul 2024), a universal potential for 89 elements, batched.

    Returns
    -------
    BaseModelMixin
        A ``SevenNetWrapper`` on the CPU in float32 (SevenNet's native
        precision; ``.to(dtype=torch.float64)`` evaluates the same weights in
        float64). Outputs: ``energy`` [B, 1] eV, ``forces`` [V, 3] eV/Å and,
        opt-in, ``stress`` [B, 3, 3] eV/Å³ (tensile positive, as ASE). Active by
        default: energy and forces. Neighbour list: COO, full, cutoff 5 Å.

    Raises
    ------
    ImportError
        If ``sevenn`` (or one of its dependencies) is not installed; the message
        names the extra to install.
    FileNotFoundError
        If the installed ``sevenn`` does not contain the SevenNet-0 checkpoint
        (it is never downloaded).

    Examples
    --------
    >>> from nvalchemi_ase import NVAlchemiCalculator
    >>> calc = NVAlchemiCalculator(sevennet_0(), device="cpu")  # doctest: +SKIP
    """
    return _wrapped("sevennet-0", "SevenNet-0")


def sevennet_0_22may2024() -> BaseModelMixin:
    """SevenNet-0's first release (22 May 2024): 89 elements, MPtrj, 5 Å, batched.

    Returns
    -------
    BaseModelMixin
        As :func:`sevennet_0`, with the 22 May 2024 weights.
    """
    return _wrapped("sevennet-0-22may2024", "SevenNet-0 (22May2024)")


def sevennet_l3i5() -> BaseModelMixin:
    """SevenNet-l3i5 (spherical harmonics up to l = 3, 5 layers): 89 elements, 5 Å.

    Returns
    -------
    BaseModelMixin
        As :func:`sevennet_0`, with the l3i5 weights (slower, more accurate).
    """
    return _wrapped("sevennet-l3i5", "SevenNet-l3i5")


def sevennet_mf_0(modal: str | None = None) -> BaseModelMixin:
    """SevenNet-MF-0, multi-fidelity (PBE and r2SCAN heads): 89 elements, 5 Å.

    Parameters
    ----------
    modal : str
        The fidelity: ``"pbe"`` (MPtrj, PBE/PBE+U) or ``"r2scan"`` (MP r2SCAN);
        any case. Required, as in sevenn's calculator.

    Returns
    -------
    BaseModelMixin
        As :func:`sevennet_0`, evaluating the chosen fidelity for every structure.

    Raises
    ------
    ValueError
        Without ``modal`` or with an unknown one (the choices are named).
    """
    return _wrapped("sevennet-mf-0", "SevenNet-MF-0", modal, ("pbe", "r2scan"))


def sevennet_mf_0_pbe() -> BaseModelMixin:
    """SevenNet-MF-0 on its PBE fidelity (``sevennet_mf_0(modal="pbe")``).

    Returns
    -------
    BaseModelMixin
        See :func:`sevennet_mf_0`.
    """
    return sevennet_mf_0(modal="pbe")


def sevennet_mf_0_r2scan() -> BaseModelMixin:
    """SevenNet-MF-0 on its r2SCAN fidelity (``sevennet_mf_0(modal="r2scan")``).

    Returns
    -------
    BaseModelMixin
        See :func:`sevennet_mf_0`.
    """
    return sevennet_mf_0(modal="r2scan")


def _wrapped(
    name: str, label: str, modal: str | None = None, modals: tuple[str, ...] = ()
) -> BaseModelMixin:
    """Build checkpoint ``name``; ``modal`` is checked against ``modals`` first."""
    from nvalchemi_ase.models.sevennet.wrapper import wrapper_class

    if modals and (not isinstance(modal, str) or modal.lower() not in modals):
        raise ValueError(
            f"{label} is multi-fidelity: choose modal= one of {list(modals)}, "
            f"got {modal!r}"
        )
    if not modals and modal is not None:
        raise ValueError(f"{label} has one fidelity; modal={modal!r} is not taken")
    network = build_network(name)
    return wrapper_class()(network, modal=modal, label=label)  # type: ignore[no-any-return]


def __getattr__(name: str) -> Any:
    """Give ``SevenNetWrapper`` on first access (it subclasses an nvalchemi class).

    Parameters
    ----------
    name : str
        Attribute name.

    Returns
    -------
    type
        The ``SevenNetWrapper`` class.

    Raises
    ------
    AttributeError
        For any other name.
    """
    if name == "SevenNetWrapper":
        from nvalchemi_ase.models.sevennet.wrapper import wrapper_class

        return wrapper_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: What every checkpoint of the ``sevenn`` wheel shares in the model registry.
_SEVENNET_WHEEL = {
    "elements": "89 (H-Pu)",
    "cutoff": "5 Å",
    "dtype": "float32",
    "licence": "MIT (sevenn)",
    "extra": "sevennet",
    "weights": "ship in the sevenn wheel",
}


def register_models() -> None:
    """Add SevenNet-0 and the ``sevenn`` wheel's other checkpoints to the registry."""
    registry.register(
        registry.ModelInfo(
            name="sevennet-0",
            factory=sevennet_0,
            summary="SevenNet-0 (11 Jul 2024): universal potential, MPtrj (PBE/PBE+U)",
            elements="89 (H-Pu)",
            cutoff="5 Å",
            dtype="float32",
            licence="MIT (sevenn)",
            extra="sevennet",
            weights="ship in the sevenn wheel",
            aliases=("7net-0",),
        )
    )
    for name, factory, summary, aliases in (
        (
            "sevennet-0-22may2024",
            sevennet_0_22may2024,
            "SevenNet-0 (22 May 2024 release): MPtrj (PBE/PBE+U)",
            ("7net-0_22may2024",),
        ),
        (
            "sevennet-l3i5",
            sevennet_l3i5,
            "SevenNet-l3i5 (lmax 3, 5 layers): MPtrj (PBE/PBE+U)",
            ("7net-l3i5",),
        ),
        (
            "sevennet-mf-0",
            sevennet_mf_0,
            (
                "SevenNet-MF-0, multi-fidelity: modal='pbe' "
                "(MPtrj) or 'r2scan' (MP r2SCAN)"
            ),
            ("7net-mf-0",),
        ),
        (
            "sevennet-mf-0-pbe",
            sevennet_mf_0_pbe,
            "SevenNet-MF-0 on its PBE/PBE+U fidelity (MPtrj)",
            (),
        ),
        (
            "sevennet-mf-0-r2scan",
            sevennet_mf_0_r2scan,
            "SevenNet-MF-0 on its r2SCAN fidelity (MP r2SCAN)",
            (),
        ),
    ):
        registry.register(
            registry.ModelInfo(
                name=name,
                factory=factory,
                summary=summary,
                aliases=aliases,
                **_SEVENNET_WHEEL,
            )
        )
