"""MACE models through nvalchemi's ``MACEWrapper``: foundation models by name, any file.

``load_model("mace-mp-0-medium")`` reads a MACE foundation checkpoint from the
weights folder (:func:`nvalchemi_ase.models.weights.weights_dir`; nothing is
downloaded: a missing file is a
:class:`~nvalchemi_ase.models.weights.MissingWeightsError` naming the file, its
download address and where to put it, raised before anything is imported);
``load_model("mace", path="my.model")`` reads any MACE model file. Both return
``nvalchemi.models.mace.MACEWrapper`` around the unpickled model, with
``supported_elements`` set from the model's z table and the neighbour cutoff
from its ``r_max``.

The names, files and addresses are mace-torch 0.3.15's
(``mace.calculators.foundations_models``: ``mace_mp`` and ``mace_off``); the
default dtype of each family is mace-torch's own (``mace_mp``: float32,
``mace_off``: float64), and ``dtype=`` chooses another.

**Installing.** mace-torch pins ``e3nn==0.4.4`` while sevenn needs
``e3nn>=0.5``; MACE runs on e3nn 0.6 (checked against ``MACECalculator`` on
identical weights, ``tests/test_mace.py``), so the ``mace`` extra installs
mace-torch's other dependencies and mace-torch itself goes in without its pin::

    pip install "nvalchemi-ase[mace]"
    pip install --no-deps mace-torch==0.3.15

**Files written under e3nn 0.4.4.** MACE model files are whole pickled
modules; e3nn 0.4.4 stores a tensor product's generated code as bare TorchScript
bytes, which e3nn >= 0.5 cannot unpickle. Such a file is read with e3nn's
``CodeGenMixin.__setstate__`` taught the old layout for the duration of the
load (restored afterwards), then rebuilt with the installed e3nn from its own
configuration and weights (mace-torch's ``extract_config_mace_model``), so
nothing runs on e3nn 0.4.4's generated code.

Unpickling runs code from the file (as ``MACECalculator`` and
``torch.load(weights_only=False)`` do): load only files you trust.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from nvalchemi_ase._quiet import import_quietly
from nvalchemi_ase.devices import resolve_dtype
from nvalchemi_ase.models import registry
from nvalchemi_ase.models.weights import find_weights

if TYPE_CHECKING:
    from nvalchemi.models.base import BaseModelMixin

__all__ = [
    "FOUNDATIONS",
    "MACE_EXTRA",
    "MACE_TORCH_VERSION",
    "Foundation",
    "load_foundation",
    "mace_file",
    "mace_from_file",
    "register_models",
]

#: The mace-torch version nvalchemi 0.3's ``mace`` extra pins (checked here).
MACE_TORCH_VERSION = "0.3.15"
#: How to install MACE beside sevenn (see the module docstring).
MACE_EXTRA = (
    f'pip install "nvalchemi-ase[mace]" && '
    f"pip install --no-deps mace-torch=={MACE_TORCH_VERSION}"
)

_MP = "https://github.com/ACEsuit/mace-mp/releases/download"
_OFF = "https://github.com/ACEsuit/mace-off/raw/main/mace_off23"
_MP_ELEMENTS = "89 (H-Pu)"
_OFF_ELEMENTS = "10 (H, C, N, O, F, P, S, Cl, Br, I)"
_ASL = "ASL (academic, no commercial use)"


@dataclass(frozen=True)
class Foundation:
    """One MACE foundation checkpoint.

    Attributes
    ----------
    name : str
        Name for :func:`nvalchemi_ase.models.load_model`.
    url : str
        Where mace-torch downloads it; the file name in the weights folder is
        the last part of this address.
    summary, elements, cutoff, licence : str
        What ``nvalchemi-ase models`` lists (cutoff with its unit).
    dtype : str
        The dtype it runs in by default (mace-torch's default for its family).
    """

    name: str
    url: str
    summary: str
    elements: str
    cutoff: str
    licence: str
    dtype: str

    @property
    def filename(self) -> str:
        """File name in the weights folder (the address's last part)."""
        return self.url.rsplit("/", 1)[-1]


#: The foundation checkpoints known by name (mace-torch 0.3.15's names).
FOUNDATIONS: dict[str, Foundation] = {
    entry.name: entry
    for entry in (
        Foundation(
            "mace-mp-0-small",
            f"{_MP}/mace_mp_0/2023-12-10-mace-128-L0_energy_epoch-249.model",
            "MACE-MP-0 small (mace_mp 'small'): MPtrj, PBE/PBE+U",
            _MP_ELEMENTS,
            "6 Å",
            "MIT",
            "float32",
        ),
        Foundation(
            "mace-mp-0-medium",
            f"{_MP}/mace_mp_0/2023-12-03-mace-128-L1_epoch-199.model",
            "MACE-MP-0 medium (mace_mp 'medium'): MPtrj, PBE/PBE+U",
            _MP_ELEMENTS,
            "6 Å",
            "MIT",
            "float32",
        ),
        Foundation(
            "mace-mp-0-large",
            f"{_MP}/mace_mp_0/MACE_MPtrj_2022.9.model",
            "MACE-MP-0 large (mace_mp 'large'): MPtrj, PBE/PBE+U",
            _MP_ELEMENTS,
            "6 Å",
            "MIT",
            "float32",
        ),
        Foundation(
            "mace-mpa-0-medium",
            f"{_MP}/mace_mpa_0/mace-mpa-0-medium.model",
            "MACE-MPA-0 medium (mace_mp 'medium-mpa-0'): MPtrj + sAlex, PBE/PBE+U",
            _MP_ELEMENTS,
            "6 Å",
            "MIT",
            "float32",
        ),
        Foundation(
            "mace-omat-0-small",
            f"{_MP}/mace_omat_0/mace-omat-0-small.model",
            "MACE-OMAT-0 small (mace_mp 'small-omat-0'): OMat24, PBE/PBE+U",
            _MP_ELEMENTS,
            "6 Å",
            _ASL,
            "float32",
        ),
        Foundation(
            "mace-omat-0-medium",
            f"{_MP}/mace_omat_0/mace-omat-0-medium.model",
            "MACE-OMAT-0 medium (mace_mp 'medium-omat-0'): OMat24, PBE/PBE+U",
            _MP_ELEMENTS,
            "6 Å",
            _ASL,
            "float32",
        ),
        Foundation(
            "mace-off23-small",
            f"{_OFF}/MACE-OFF23_small.model",
            "MACE-OFF23 small (mace_off 'small'): organic molecules, ωB97M-D3(BJ)",
            _OFF_ELEMENTS,
            "4.5 Å",
            _ASL,
            "float64",
        ),
        Foundation(
            "mace-off23-medium",
            f"{_OFF}/MACE-OFF23_medium.model",
            "MACE-OFF23 medium (mace_off 'medium'): organic molecules, ωB97M-D3(BJ)",
            _OFF_ELEMENTS,
            "5 Å",
            _ASL,
            "float64",
        ),
        Foundation(
            "mace-off23-large",
            f"{_OFF}/MACE-OFF23_large.model",
            "MACE-OFF23 large (mace_off 'large'): organic molecules, ωB97M-D3(BJ)",
            _OFF_ELEMENTS,
            "5 Å",
            _ASL,
            "float64",
        ),
    )
}


def load_foundation(
    name: str, dtype: torch.dtype | str | None = None, head: str | None = None
) -> BaseModelMixin:
    """Load a MACE foundation model from the weights folder, wrapped for nvalchemi.

    Parameters
    ----------
    name : str
        A key of :data:`FOUNDATIONS` (e.g. ``"mace-mp-0-medium"``).
    dtype : torch.dtype or str or None
        Dtype of the weights; None is the family's default (``Foundation.dtype``).
    head : str or None
        Readout head of a multi-head model (see :func:`mace_from_file`).

    Returns
    -------
    BaseModelMixin
        See :func:`mace_from_file`.

    Raises
    ------
    MissingWeightsError
        If the file is not in the weights folder (before mace is imported).
    """
    entry = FOUNDATIONS[name]
    resolved = resolve_dtype(dtype, default=resolve_dtype(entry.dtype))
    path = find_weights(entry.name, entry.filename, entry.url)
    return mace_from_file(path, dtype=resolved, head=head, label=entry.name)


def mace_from_file(
    path: str | Path,
    dtype: torch.dtype | str | None = None,
    head: str | None = None,
    *,
    label: str | None = None,
) -> BaseModelMixin:
    """Any MACE model file (a pickled ``mace.modules`` model), wrapped for nvalchemi.

    Parameters
    ----------
    path : str or pathlib.Path
        The ``.model`` file (as ``MACECalculator(model_paths=...)`` reads it).
        It is unpickled: load only files you trust.
    dtype : torch.dtype or str or None
        ``"float32"`` or ``"float64"`` (or the torch dtype); None keeps the
        file's own dtype.
    head : str or None
        For a multi-head model, the readout head; None picks the head named
        "default" (any case), as ``MACECalculator`` does. Must be None or the
        only head for a single-head model.
    label : str or None
        Name used in messages (defaults to the file's path).

    Returns
    -------
    BaseModelMixin
        ``nvalchemi.models.mace.MACEWrapper`` on the CPU (eval mode, weights
        frozen): ``energy`` [B, 1] eV, ``forces`` [V, 3] eV/Å and, opt-in,
        ``stress`` [B, 3, 3] eV/Å³ (tensile positive, as ASE). Neighbour list:
        COO, full, cutoff ``r_max`` Å. ``supported_elements`` is the model's
        z table.

    Raises
    ------
    FileNotFoundError
        If ``path`` is not a file (before mace is imported).
    ImportError
        If mace-torch is missing; the message says how to install it.
    ValueError
        If the file holds no MACE model, or ``head`` is not one of its heads.
    """
    label = label or str(path)
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"{label}: MACE model file {str(file)!r} not found")
    resolved = None if dtype is None else resolve_dtype(dtype)
    _import_mace()
    model = _read_model(file, label)
    if resolved is not None and next(model.parameters()).dtype != resolved:
        model = model.to(dtype=resolved)
    head_index = _head_index(model, head, label)
    mace_wrappers = import_quietly("nvalchemi.models.mace")
    wrapper_type = (
        mace_wrappers.MACEWrapper if head_index == 0 else _head_wrapper_class()
    )
    wrapper = wrapper_type(model)
    if head_index:
        wrapper.head_index = head_index
    #: Atomic numbers of the model's z table, read by
    #: :func:`nvalchemi_ase.models.supported_elements`.
    z_table: torch.Tensor = model.atomic_numbers  # type: ignore[assignment]
    wrapper.supported_elements = frozenset(int(z) for z in z_table.tolist())
    return wrapper  # type: ignore[no-any-return]


def _import_mace() -> None:
    """Import ``mace.modules`` quietly, or say how to install mace-torch."""
    try:
        import_quietly("mace.modules")
    except ImportError as exc:
        raise ImportError(
            f"MACE needs mace-torch ({exc}); install it with {MACE_EXTRA}"
        ) from exc


def _read_model(file: Path, label: str) -> torch.nn.Module:
    """Unpickle a MACE model, rebuilding one written under e3nn 0.4.4."""
    with _legacy_e3nn_codegen() as legacy, _known_load_warnings():
        model = torch.load(file, map_location="cpu", weights_only=False)
    if not (
        isinstance(model, torch.nn.Module)
        and hasattr(model, "atomic_numbers")
        and hasattr(model, "r_max")
    ):
        raise ValueError(
            f"{label}: {file} holds a {type(model).__name__}, not a MACE model "
            "(a torch.nn.Module with atomic_numbers and r_max)"
        )
    if legacy:
        with _known_load_warnings():
            model = _rebuild(model, label)
    return model.eval()


@contextlib.contextmanager
def _known_load_warnings() -> Iterator[None]:
    """Silence two warnings users cannot act on while a file is read.

    torch's deprecation of ``torch.jit.load`` (e3nn stores generated code as
    TorchScript) and mace's copy-constructed ``atomic_numbers`` buffer.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r".*torch\.jit\.load.*", category=FutureWarning
        )
        warnings.filterwarnings(
            "ignore", message=r"To copy construct from a tensor", category=UserWarning
        )
        yield


@contextlib.contextmanager
def _legacy_e3nn_codegen() -> Iterator[list[bool]]:
    """Let e3nn >= 0.5 unpickle modules pickled by e3nn 0.4.4, while in the block.

    e3nn 0.4.4 pickles generated code as ``{name: bytes}`` (TorchScript);
    later versions as ``{name: (kind, bytes)}``. The yielded list becomes
    non-empty when an old-layout module was read.
    """
    mixin = import_quietly("e3nn.util.codegen._mixin").CodeGenMixin
    original = mixin.__setstate__
    seen: list[bool] = []

    def setstate(self: Any, state: dict[str, Any]) -> None:
        codegen = state.get("__codegen__")
        if codegen and all(isinstance(code, bytes) for code in codegen.values()):
            seen.append(True)
            state = {
                **state,
                "__codegen__": {
                    name: ("torchscript", code) for name, code in codegen.items()
                },
            }
        original(self, state)

    mixin.__setstate__ = setstate
    try:
        yield seen
    finally:
        mixin.__setstate__ = original


def _rebuild(model: torch.nn.Module, label: str) -> torch.nn.Module:
    """Build the same model with the installed e3nn; give it the file's weights."""
    scripts = import_quietly("mace.tools.scripts_utils")
    config = scripts.extract_config_mace_model(model)
    if "error" in config:
        raise ValueError(
            f"{label}: written by e3nn 0.4.4 and not a ScaleShiftMACE "
            f"({config['error']}); re-save it with a current e3nn"
        )
    dtype = next(model.parameters()).dtype
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # MACE builds its buffers in the default dtype
    try:
        rebuilt = type(model)(**config)
    finally:
        torch.set_default_dtype(previous)
    rebuilt.load_state_dict(model.state_dict())
    return rebuilt


def _head_index(model: torch.nn.Module, head: str | None, label: str) -> int:
    """Index of the readout head to use (0 for single-head models)."""
    heads = [str(name) for name in getattr(model, "heads", None) or ["Default"]]
    if head is None:
        if len(heads) == 1:
            return 0
        defaults = [i for i, name in enumerate(heads) if name.lower() == "default"]
        if not defaults:
            raise ValueError(
                f"{label}: the model has heads {heads} and none is 'default'; "
                "choose one with head=NAME"
            )
        return defaults[0]
    if not isinstance(head, str):
        raise TypeError(f"{label}: head must be a str, got {type(head).__name__}")
    if head not in heads:
        raise ValueError(f"{label}: no head {head!r}; the model has heads {heads}")
    return heads.index(head)


@functools.cache
def _head_wrapper_class() -> type:
    """``MACEWrapper`` that evaluates one chosen head of a multi-head model."""
    base = import_quietly("nvalchemi.models.mace").MACEWrapper

    def adapt_input(self: Any, data: Any, **kwargs: Any) -> dict[str, Any]:
        inputs: dict[str, Any] = base.adapt_input(self, data, **kwargs)
        inputs["head"] = torch.full(
            (int(inputs["ptr"].numel()) - 1,),
            self.head_index,
            dtype=torch.long,
            device=inputs["positions"].device,
        )
        return inputs

    return type(
        "MACEHeadWrapper",
        (base,),
        {
            "__module__": __name__,
            "__doc__": "nvalchemi's ``MACEWrapper`` reading head ``head_index``.",
            "adapt_input": adapt_input,
            "head_index": 0,
        },
    )


def mace_file(
    path: str | Path, dtype: torch.dtype | str | None = None, head: str | None = None
) -> BaseModelMixin:
    """``load_model("mace", path=...)``: :func:`mace_from_file` of any MACE file.

    Parameters
    ----------
    path : str or pathlib.Path
        The ``.model`` file (unpickled: load only files you trust).
    dtype : torch.dtype or str or None
        ``"float32"`` or ``"float64"``; None keeps the file's dtype.
    head : str or None
        Readout head of a multi-head model.

    Returns
    -------
    BaseModelMixin
        See :func:`mace_from_file`.
    """
    if not isinstance(path, str | Path):
        raise TypeError(
            f"mace: path must be the model file's path, got {type(path).__name__}"
        )
    return mace_from_file(path, dtype=dtype, head=head)


def register_models() -> None:
    """Add ``"mace"`` and every :data:`FOUNDATIONS` name to the model registry."""
    registry.register(
        registry.ModelInfo(
            name="mace",
            factory=mace_file,
            summary="any MACE model file: load_model('mace', path='my.model')",
            elements="the file's z table",
            cutoff="the file's r_max",
            dtype="the file's (dtype=)",
            licence="the file's",
            extra="mace",
            weights="path= (a file you have)",
        )
    )
    for entry in FOUNDATIONS.values():
        registry.register(
            registry.ModelInfo(
                name=entry.name,
                factory=functools.partial(load_foundation, entry.name),
                summary=entry.summary,
                elements=entry.elements,
                cutoff=entry.cutoff,
                dtype=f"{entry.dtype} (dtype=)",
                licence=entry.licence,
                extra="mace",
                weights=f"weights folder: {entry.filename} from {entry.url}",
                weights_file=entry.filename,
            )
        )
