"""AIMNet2 (``aimnet`` package) as named, batched nvalchemi models.

AIMNet2 (Anstine, Zubatyuk and Isayev; ``aimnet`` package, MIT licence) is a
message-passing potential for molecules and molecular crystals that predicts,
with the energy, one partial charge per atom, conserving each structure's total
charge. It runs through nvalchemi's own ``AIMNet2Wrapper``:

* the total charge of a structure is ``atoms.info["charge"]`` (e; 0 when
  absent), per structure in a batch;
* the predicted per-atom charges are ASE's ``charges`` property
  (``atoms.get_charges()``, e);
* for the spin-polarised ``aimnet2-nse`` variant, ``atoms.info["spin"]`` is the
  spin multiplicity 2S+1 (aimnet's convention; 1 when absent);
* weights are float32 (the AEV kernel takes nothing else); the per-element
  energy shifts stay float64, as in aimnet's own calculator. A float64
  calculator is refused with a clear error.

**What the energy contains.** nvalchemi's wrapper evaluates the network with
its embedded *short-range* Coulomb subtraction and leaves out the two terms
aimnet's own calculator adds outside the network: the full (long-range)
Coulomb energy of the predicted charges, and DFT-D3(BJ) dispersion. The
published variants need both (``model.aimnet2_metadata["needs_coulomb"]``,
``["needs_dispersion"]``, ``["d3_params"]``), so the energy of
``load_model("aimnet2")`` alone equals aimnet's
``AIMNet2Calculator(..., needs_coulomb=False, needs_dispersion=False)``, not the
published total; compose it with an electrostatics model on the predicted
charges (``"ewald"``/``"pme"`` for periodic cells,
:mod:`nvalchemi_ase.models.electrostatics`) and D3.

**Weights.** Nothing is downloaded. The published files are read from
:func:`nvalchemi_ase.models.weights.weights_dir` under the file names of
aimnet's model registry, and checked against the registry's SHA-256 digest;
``member=`` picks one of the four ensemble members. Any other AIMNet2 file in
aimnet's v2 format (``aimnet export``) loads with ``path=``. Both are read with
aimnet's restricted loader (``torch.load(weights_only=True)`` and an allow-list
of constructors). Legacy TorchScript ``.jpt`` files are refused (convert them
with aimnet's ``convert_legacy_jpt``).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from nvalchemi_ase._quiet import import_quietly
from nvalchemi_ase.convert import MAX_ATOMIC_NUMBER
from nvalchemi_ase.models import registry
from nvalchemi_ase.models.weights import find_weights

if TYPE_CHECKING:
    from nvalchemi.models.base import BaseModelMixin

__all__ = [
    "AIMNET_EXTRA",
    "VARIANTS",
    "AIMNet2Variant",
    "aimnet2_factory",
    "load_aimnet2",
    "register_models",
]

#: How to install the optional dependency.
AIMNET_EXTRA = 'pip install "nvalchemi-ase[aimnet]"'
#: aimnet's download location for the published files (read, never fetched).
_BUCKET = "https://storage.googleapis.com/aimnetcentral/aimnet2v2"


@dataclass(frozen=True)
class AIMNet2Variant:
    """One published AIMNet2 family, as aimnet 0.2.6's model registry names it.

    Attributes
    ----------
    name : str
        Our model name (aimnet's short alias).
    folder : str
        Folder of the files in aimnet's bucket.
    files : tuple of str
        File name of each ensemble member (0-3).
    sha256 : tuple of str
        aimnet's registry digest of each file.
    summary : str
        One line: the level of theory and what it is for.
    elements : str
        Elements in words.
    charged : bool
        Whether the family supports charged structures (aimnet2-rxn does not).
    aliases : tuple of str
        Other names.
    """

    name: str
    folder: str
    files: tuple[str, ...]
    sha256: tuple[str, ...]
    summary: str
    elements: str
    charged: bool = True
    aliases: tuple[str, ...] = ()

    def source(self, member: int) -> str:
        """Return the address of one member's file."""
        return f"{_BUCKET}/{self.folder}/{self.files[member]}"


_ORGANIC = "H B C N O F Si P S Cl As Se Br I (14)"

#: The published families (aimnet 0.2.6 ``calculators/model_registry.yaml``).
VARIANTS: tuple[AIMNet2Variant, ...] = (
    AIMNet2Variant(
        name="aimnet2",
        folder="AIMNet2",
        files=tuple(f"aimnet2_wb97m_d3_{i}.pt" for i in range(4)),
        sha256=(
            "f0f7c054539ad3261bd36f9b11c56d12f87cb723e25bea7521755bbd3ec24e28",
            "0505ec73a1759bd1d9885fa5f396c79f2a0cc93d20c62ea388e92b30e9351432",
            "a8c1ea27bd07e1bb1a5942f93cb7285cc7308c2a26fa4e1f82b7b5302feb7bfa",
            "0c5f26b9de15c72a9ccb1d411b3b7814816bb06cca46f784dccd1f5efb2c334b",
        ),
        summary="AIMNet2 ωB97M-D3: molecules, neutral and charged, with charges",
        elements=_ORGANIC,
        aliases=("aimnet2-wb97m",),
    ),
    AIMNet2Variant(
        name="aimnet2-b973c",
        folder="AIMNet2",
        files=tuple(f"aimnet2_b973c_d3_{i}.pt" for i in range(4)),
        sha256=(
            "7ec7a3db67bd3a393ad59647d4020398deeb041c07dba1c9cf212d226268e549",
            "01f29377a7a768d88fbee676702aae927336310f05c25ce11bf5f69345394283",
            "1b7f2194c119deb35fa957fada50f43e47dac1c44e93ed4b7865de96823a2270",
            "836f1c259914486ccda61850e9765fc3ce1e233c5ea86985e129735244427c89",
        ),
        summary="AIMNet2 B97-3c: molecules, neutral and charged, with charges",
        elements=_ORGANIC,
    ),
    AIMNet2Variant(
        name="aimnet2-2025",
        folder="AIMNet2",
        files=tuple(f"aimnet2_2025_b973c_d3_{i}.pt" for i in range(4)),
        sha256=(
            "043ed5418a104e31f79462f8e5ebeca64a2d24422174f5d29f894d32271981b5",
            "912ae4f0923803cb38da3fe2bfccc1a47414fd1f9de32ad5a48465be9fe9d0a7",
            "37c00223b32b8d614c8a9a68c3ccde0b424f5e3795d816c2b4e9d6295afe441c",
            "92ee4d1c252042b42622b96b6e0de05eb9c2630af84261780c5c1e558cf8f91d",
        ),
        summary="AIMNet2 B97-3c, 2025 retraining: molecules, with charges",
        elements=_ORGANIC,
    ),
    AIMNet2Variant(
        name="aimnet2-nse",
        folder="AIMNet2NSE",
        files=tuple(f"aimnet2nse_wb97m_{i}.pt" for i in range(4)),
        sha256=(
            "b98b3449b2a3765de6a188edff9344a38cc72df75f9d9bf68f4b898a253c5864",
            "69b50bf9938a10a16b70de49985ccf44f127c0bf4f9f736c87e862710f5259b8",
            "da2da46e4c01e685083dbd4db0187b5a1615e1f2471752e84fc78ba8aeeef590",
            "c56103cb3bd747a2a5e8d37c7a134c2662ea3c8209aee7abe0f64b9ebce6cf71",
        ),
        summary="AIMNet2-NSE ωB97M: open-shell molecules (info['spin'] = 2S+1)",
        elements=_ORGANIC,
    ),
    AIMNet2Variant(
        name="aimnet2-pd",
        folder="AIMNet2Pd",
        files=tuple(f"aimnet2-pd_{i}.pt" for i in range(4)),
        sha256=(
            "93f10dd5522e187d7d6aaf3b18d54c07746f5452c2e8063cf77fd0420dc39ebd",
            "15a1a38078aa38bc4c8d0ceb1ee2aa3539efa50456238a85b54ffe5cecf9f73a",
            "e8154bda79964da2b61c020efd602ead19a0310a9d7c8d7825771afb4da4dcbb",
            "ccee19e33e894558da10f6e21de51bef4b0aeb92d11a799761f74b0e3a48cc91",
        ),
        summary="AIMNet2-Pd: palladium organometallic chemistry, with charges",
        elements="organic elements and Pd (see the file's implemented species)",
    ),
    AIMNet2Variant(
        name="aimnet2-rxn",
        folder="AIMNet2rxn",
        files=tuple(f"aimnet2_rxn_{i}.pt" for i in range(4)),
        sha256=(
            "ce8bc2a4cc6fcb5ebaa1bc8897fcd75104e5a00fe86e9d5fc6a020d572174894",
            "bfb3ecee90f82400469db39ac5fc97a206c9aae29efcd57bd6aad3d0676a5bd8",
            "3fa85574702300350050bfbeb326ffccb7a6dc5d549e98560da117063b409bc3",
            "ee29df5ac76ab337913c41223bdc5c0fcd765aea84e34ccaa9ac22a53b018473",
        ),
        summary="AIMNet2-rxn ωB97M: reactions of neutral closed-shell molecules",
        elements="H C N O (see the file's implemented species)",
        charged=False,
    ),
)


def aimnet2_factory(variant: AIMNet2Variant) -> Callable[..., BaseModelMixin]:
    """Return the ``load_model`` factory of one variant.

    Parameters
    ----------
    variant : AIMNet2Variant
        The family.

    Returns
    -------
    callable
        ``factory(path=None, member=0)``, see :func:`load_aimnet2`.
    """

    def factory(path: str | Path | None = None, member: int = 0) -> BaseModelMixin:
        return load_aimnet2(variant, path=path, member=member)

    factory.__name__ = variant.name.replace("-", "_")
    factory.__doc__ = (
        f"{variant.summary}; ``path=`` any AIMNet2 v2 file, ``member=`` 0-3."
    )
    return factory


def load_aimnet2(
    variant: AIMNet2Variant, path: str | Path | None = None, member: int = 0
) -> BaseModelMixin:
    """Build a batched AIMNet2 model from a published file or any v2 file.

    Parameters
    ----------
    variant : AIMNet2Variant
        The family whose published file is read when ``path`` is None.
    path : str or pathlib.Path, optional
        An AIMNet2 file in aimnet's v2 format; overrides the published file.
    member : int
        Ensemble member 0-3 of the published family (ignored with ``path``).

    Returns
    -------
    BaseModelMixin
        An nvalchemi ``AIMNet2Wrapper`` on the CPU, float32. Outputs: ``energy``
        [B, 1] eV, ``forces`` [V, 3] eV/Å, ``charges`` [V] e and, opt-in,
        ``stress`` [B, 3, 3] eV/Å³ (tensile positive). Neighbour list: matrix,
        full, at the model's cutoff (5 Å for the published files). Attributes
        ``supported_elements`` (the file's implemented species; 1-118 when it
        names none, never 0, aimnet's padding atom) and
        ``aimnet2_metadata`` (aimnet's metadata: ``cutoff``, ``needs_coulomb``,
        ``needs_dispersion``, ``d3_params``, ...).

    Raises
    ------
    ImportError
        If ``aimnet`` is not installed (the extra is named).
    MissingWeightsError
        If the published file is not in the weights folder (its address and
        destination are named).
    FileNotFoundError
        If ``path`` does not exist.
    ValueError
        For a ``member`` outside 0-3, a published file whose SHA-256 digest
        differs from aimnet's registry, or a legacy ``.jpt`` file.
    """
    if path is None:
        if isinstance(member, bool) or member not in range(len(variant.files)):
            raise ValueError(
                f"{variant.name}: member must be one of 0-{len(variant.files) - 1}, "
                f"got {member!r}"
            )
        file = find_weights(variant.name, variant.files[member], variant.source(member))
        _check_digest(variant.name, file, variant.sha256[member])
        registry = True
    else:
        file = Path(path).expanduser()
        if not file.is_file():
            raise FileNotFoundError(f"{variant.name}: no AIMNet2 file at {file}")
        if file.suffix.lower() == ".jpt":
            raise ValueError(
                f"{variant.name}: {file} is a legacy TorchScript file; convert it "
                "to aimnet's v2 format (aimnet.models.convert.convert_legacy_jpt)"
            )
        registry = False
    base = _import_aimnet("aimnet.models.base")
    loader = base.load_registry_model if registry else base.load_model
    raw, metadata = loader(str(file), device="cpu")
    return _wrap(raw, dict(metadata), charged=variant.charged)


def _check_digest(name: str, file: Path, expected: str) -> None:
    digest = hashlib.sha256()
    with file.open("rb") as stream:
        for chunk in iter(lambda: stream.read(1 << 20), b""):
            digest.update(chunk)
    if digest.hexdigest() != expected:
        raise ValueError(
            f"{name}: {file} is not the published file (SHA-256 "
            f"{digest.hexdigest()}, aimnet's registry says {expected}); download "
            "it again, or load your own file with path="
        )


def _wrap(raw: torch.nn.Module, metadata: dict[str, Any], charged: bool) -> Any:
    wrapper_class = _wrapper_class()
    with _quiet_aimnet():
        model = wrapper_class(raw.eval()).eval()
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    # A file that does not name its species still indexes embeddings by atomic
    # number, with 0 as aimnet's padding atom: every real element, no ghosts.
    species = metadata.get("implemented_species") or range(1, MAX_ATOMIC_NUMBER + 1)
    model.supported_elements = frozenset(int(z) for z in species)
    model.aimnet2_metadata = metadata
    model.supports_charged_systems = charged and (
        metadata.get("supports_charged_systems") is not False
    )
    return model


@cache
def _wrapper_class() -> type:
    """``AIMNet2Wrapper`` with float32 kept, spin as multiplicity, charge checked."""
    wrapper = _import_aimnet("nvalchemi.models.aimnet2").AIMNet2Wrapper

    class BatchedAIMNet2(wrapper):  # type: ignore[misc, valid-type]
        """nvalchemi's ``AIMNet2Wrapper`` with the ASE-facing details of this module.

        * ``.to(dtype=float32)`` keeps aimnet's float64 per-element energy
          shifts; any other floating dtype is refused (AIMNet2 is float32 only).
        * ``spin`` (from ``atoms.info["spin"]``) is the NSE multiplicity.
        * a charged structure is refused by a family that does not support
          charge (aimnet2-rxn), naming the structure.
        """

        supported_elements: frozenset[int] | None = None
        aimnet2_metadata: dict[str, Any]
        supports_charged_systems: bool = True

        def _apply(self, fn: Any, recurse: bool = True) -> Any:
            probe = fn(torch.zeros((), dtype=torch.float32))
            if probe.dtype != torch.float32:
                raise TypeError(
                    f"AIMNet2 runs in float32 only (asked for {probe.dtype}); use "
                    "dtype='float32' (the default for this model)"
                )
            shift = _energy_shifts(self)
            saved = None if shift is None else shift.state_dict()
            saved = None if saved is None else {k: v.clone() for k, v in saved.items()}
            super()._apply(fn, recurse)
            if shift is not None and saved is not None:
                # restore the float64 shifts exactly (no round trip via float32)
                device = probe.device
                shift.to(device=device, dtype=torch.float64)
                shift.load_state_dict({k: v.to(device) for k, v in saved.items()})
            return self

        def adapt_input(self, data: Any, **kwargs: Any) -> dict[str, Any]:
            if not self.supports_charged_systems:
                _refuse_charged(data)
            result: dict[str, Any] = super().adapt_input(data, **kwargs)
            if self._is_nse and "mult" not in result:
                spin = getattr(data, "spin", None)
                n = data.num_graphs
                result["mult"] = (
                    torch.ones(n, dtype=torch.float32, device=data.positions.device)
                    if spin is None
                    else spin.reshape(n).to(torch.float32)
                )
            return result

    return BatchedAIMNet2


def _energy_shifts(wrapper: torch.nn.Module) -> torch.nn.Module | None:
    """Return aimnet's per-element energy shifts (float64 in aimnet's calculator)."""
    outputs = getattr(getattr(wrapper, "model", None), "outputs", None)
    shift = getattr(outputs, "atomic_shift", None)
    return shift if isinstance(shift, torch.nn.Module) else None


def _refuse_charged(data: Any) -> None:
    charge = getattr(data, "charge", None)
    if charge is None:
        return
    charged = torch.nonzero(charge.reshape(-1) != 0)
    if charged.numel():
        index = int(charged[0, 0])
        raise ValueError(
            f"structure {index}: info['charge'] = {float(charge.reshape(-1)[index])} "
            "but this AIMNet2 family supports neutral structures only; use "
            "aimnet2 or aimnet2-b973c for ions"
        )


def _import_aimnet(module_name: str) -> Any:
    try:
        with _quiet_aimnet():
            return import_quietly(module_name)
    except ImportError as error:
        raise ImportError(
            f"AIMNet2 needs the aimnet package ({error}); install it with "
            f"{AIMNET_EXTRA}"
        ) from error


@contextlib.contextmanager
def _quiet_aimnet() -> Iterator[None]:
    """Undo aimnet's ``logging.basicConfig(level=INFO)`` on the root logger."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield
    finally:
        for handler in root.handlers[:]:
            if handler not in handlers:
                root.removeHandler(handler)
        root.setLevel(level)


def register_models() -> None:
    """Add every :data:`VARIANTS` name to the model registry."""
    for variant in VARIANTS:
        registry.register(
            registry.ModelInfo(
                name=variant.name,
                factory=aimnet2_factory(variant),
                summary=variant.summary
                + " (short-range part: add long-range Coulomb and D3)",
                elements=variant.elements,
                cutoff="5 Å",
                dtype="float32",
                licence="MIT (aimnet)",
                extra="aimnet",
                weights=(
                    f"{variant.files[0]} (members 0-3: {variant.files[0][:-4]}"
                    f"[0-3].pt) from {variant.source(0).rsplit('/', 1)[0]}/"
                ),
                aliases=variant.aliases,
            )
        )
