"""Loading SevenNet checkpoints from inside the installed ``sevenn`` wheel.

Nothing is downloaded. The checkpoint is first shown to unpickle with
``torch.load(weights_only=True)`` (tensors, numpy arrays and plain containers
only) before sevenn's own loader, which unpickles without restrictions, reads
it; sevenn's prints and torch's ``torch.jit.script`` notice are kept off the
terminal. Checked against sevenn 0.13.0 with the four checkpoints its wheel
ships (:data:`CHECKPOINTS`; SevenNet-0 11Jul2024 written by sevenn 0.9.1).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch

from nvalchemi_ase._quiet import import_quietly

__all__ = [
    "CHECKPOINTS",
    "SEVENNET_0_CUTOFF",
    "SEVENNET_EXTRA",
    "build_network",
    "check_checkpoint_is_data",
    "checkpoint_path",
    "import_sevenn",
    "quiet_sevenn",
]

#: Interaction cutoff of SevenNet-0, Å.
SEVENNET_0_CUTOFF = 5.0
#: How to install the optional dependency.
SEVENNET_EXTRA = 'pip install "nvalchemi-ase[sevennet]"'
#: Checkpoints in the sevenn wheel: model name -> the ``sevenn._const`` path name.
CHECKPOINTS = {
    "sevennet-0": "SEVENNET_0_11Jul2024",
    "sevennet-0-22may2024": "SEVENNET_0_22May2024",
    "sevennet-l3i5": "SEVENNET_l3i5",
    "sevennet-mf-0": "SEVENNET_MF_0",
}


def import_sevenn(module_name: str) -> Any:
    """Import a ``sevenn`` module silently, or explain which extra is missing."""
    try:
        with quiet_sevenn():  # sevenn scripts modules at import time
            return import_quietly(module_name)
    except ImportError as exc:
        raise ImportError(
            f"SevenNet needs the 'sevenn' package ({exc}); install it with "
            f"{SEVENNET_EXTRA}"
        ) from exc


def checkpoint_path(name: str = "sevennet-0") -> str:
    """Path of a checkpoint (a key of :data:`CHECKPOINTS`) inside the sevenn wheel."""
    constants = import_sevenn("sevenn._const")
    path = str(getattr(constants, CHECKPOINTS[name]))
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"the installed sevenn has no {name} checkpoint at {path}; "
            f"reinstall it ({SEVENNET_EXTRA}); nvalchemi_ase never downloads weights"
        )
    return path


def numpy_array_globals() -> list[Any]:
    """List the globals numpy arrays need, for ``torch.serialization.safe_globals``.

    A SevenNet checkpoint's config holds numpy arrays (per-species energy shifts
    and scales); pickles written with numpy 1.x name the array constructor
    ``numpy.core.multiarray._reconstruct``.
    """
    reconstruct = importlib.import_module("numpy._core.multiarray")._reconstruct
    dtype_classes = {type(np.dtype(code)) for code in "?bhilqBHILQefdgFDG"}
    return [
        (reconstruct, "numpy.core.multiarray._reconstruct"),
        (reconstruct, "numpy._core.multiarray._reconstruct"),
        np.ndarray,
        np.dtype,
        *sorted(dtype_classes, key=lambda cls: cls.__name__),
    ]


def check_checkpoint_is_data(path: str) -> Mapping[str, Any]:
    """Unpickle the checkpoint with ``weights_only=True`` (numpy arrays allowed).

    Proves the file holds only tensors, numpy arrays and plain containers
    before sevenn unpickles it without restrictions (see :func:`build_network`).

    Returns
    -------
    Mapping
        The checkpoint's content (``config``, ``model_state_dict``, ...).
    """
    with torch.serialization.safe_globals(numpy_array_globals()):
        content = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(content, Mapping) or "model_state_dict" not in content:
        raise ValueError(f"{path} is not a SevenNet checkpoint")
    return content


def build_network(name: str = "sevennet-0") -> torch.nn.Module:
    """Build a wheel checkpoint's ``AtomGraphSequential``: eval, frozen, on the CPU.

    ``name`` is a key of :data:`CHECKPOINTS`.
    """
    checkpoint_module = import_sevenn("sevenn.checkpoint")
    path = checkpoint_path(name)
    content = check_checkpoint_is_data(path)
    cutoff = float(content["config"]["cutoff"])
    if cutoff != SEVENNET_0_CUTOFF:
        raise ValueError(f"{path}: cutoff {cutoff} Å, expected {SEVENNET_0_CUTOFF}")
    # The weights need sevenn's migration from the checkpoint's format (e.g. sevenn
    # 0.9.1: old module layout and convolution weight order) to the installed
    # model code. ``SevenNetCheckpoint`` is the only entry point to it; it takes
    # a path and unpickles with ``weights_only=False`` itself. The file is the
    # one shipped in the wheel (never a name that could trigger a download) and
    # was just shown to unpickle under ``weights_only=True``.
    with quiet_sevenn():
        network = checkpoint_module.SevenNetCheckpoint(path).build_model()
    network.set_is_batch_data(True)
    network.eval()
    for parameter in network.parameters():
        parameter.requires_grad_(False)
    return network


@contextlib.contextmanager
def quiet_sevenn() -> Iterator[None]:
    """Keep sevenn's prints off stdout and torch's jit notice off stderr.

    sevenn builds its model with ``torch.jit.script``, which torch 2.14 answers
    with a FutureWarning the user cannot act on.
    """
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r".*torch\.jit\.script.*", category=FutureWarning
        )
        yield
