"""Device and floating-point precision choices, resolved in one place.

``device=None`` everywhere in :mod:`nvalchemi_ase` means "CUDA when available,
else CPU"; ``dtype`` accepts a ``torch.dtype`` or its name. Also the timeout of
the process groups the package starts itself (:data:`GROUP_TIMEOUT`).
"""

from __future__ import annotations

import datetime

import torch

__all__ = [
    "GROUP_TIMEOUT",
    "DtypeLike",
    "host_reads_are_free",
    "resolve_device",
    "resolve_dtype",
]

#: Timeout of a process group the package starts itself (runners, ``optimizer |
#: md``): the end-of-run barrier waits for the slowest rank.
GROUP_TIMEOUT = datetime.timedelta(days=7)

DtypeLike = torch.dtype | str | None

_DEVICE_CHOICES = "'cpu', 'cuda', 'cuda:N' or None (CUDA when available)"

_DTYPE_NAMES = {
    "float32": torch.float32,
    "float": torch.float32,
    "single": torch.float32,
    "fp32": torch.float32,
    "float64": torch.float64,
    "double": torch.float64,
    "fp64": torch.float64,
}


def resolve_device(device: torch.device | str | None = None) -> torch.device:
    """Return the torch device to run on.

    nvalchemi's kernels (NVIDIA Warp) run on the CPU and on CUDA GPUs only, so
    those are the choices: ``"cpu"``, ``"cuda"``, ``"cuda:N"`` (N below
    ``torch.cuda.device_count()``), a ``torch.device`` of those, or ``None``.

    Parameters
    ----------
    device : torch.device or str or None
        ``None`` picks ``cuda`` when ``torch.cuda.is_available()``, else ``cpu``.

    Returns
    -------
    torch.device
        The resolved device.

    Raises
    ------
    ValueError
        For a device that is not the CPU or a CUDA GPU (``"mps"``, ``"bogus"``),
        or CUDA requested but not available (or a GPU index that does not
        exist); the supported choices are named.
    TypeError
        If ``device`` is neither a ``str``, a ``torch.device`` nor ``None``.
    """
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if isinstance(device, str):
        try:
            resolved = torch.device(device)
        except RuntimeError:
            raise ValueError(
                f"device={device!r} is not a device; use {_DEVICE_CHOICES}"
            ) from None
    elif isinstance(device, torch.device):
        resolved = device
    else:
        raise TypeError(
            f"device must be a str, a torch.device or None, got "
            f"{type(device).__name__} ({device!r}); use {_DEVICE_CHOICES}"
        )
    if resolved.type not in ("cpu", "cuda"):
        raise ValueError(
            f"device={str(device)!r} is not supported: nvalchemi's kernels (NVIDIA "
            f"Warp) run on the CPU and CUDA GPUs only; use {_DEVICE_CHOICES}"
        )
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"device={str(device)!r} was requested but CUDA is not available on "
            "this machine; use device='cpu' or device=None (CUDA when available)"
        )
    if resolved.type == "cuda" and resolved.index is not None:
        count = torch.cuda.device_count()
        if resolved.index >= count:
            raise ValueError(
                f"device={str(device)!r}: this machine has {count} CUDA device(s) "
                f"(cuda:0 to cuda:{count - 1}); use one of them or device='cuda'"
            )
    return resolved


def resolve_dtype(
    dtype: DtypeLike, default: torch.dtype = torch.float64
) -> torch.dtype:
    """Return a floating torch dtype from a dtype, its name, or ``None``.

    Parameters
    ----------
    dtype : torch.dtype or str or None
        ``torch.float32``/``torch.float64`` or a name such as ``"float32"``;
        ``None`` returns ``default``.
    default : torch.dtype
        Returned when ``dtype`` is ``None``.

    Returns
    -------
    torch.dtype
        ``torch.float32`` or ``torch.float64``.

    Raises
    ------
    ValueError
        If ``dtype`` is not a supported floating dtype.
    """
    if dtype is None:
        return default
    if isinstance(dtype, str):
        resolved = _DTYPE_NAMES.get(dtype.lower().removeprefix("torch."))
    else:
        resolved = dtype if dtype in (torch.float32, torch.float64) else None
    if resolved is None:
        raise ValueError(
            f"dtype={dtype!r} is not supported; use torch.float32, torch.float64, "
            "'float32' or 'float64'"
        )
    return resolved


def host_reads_are_free(device: torch.device) -> bool:
    """Whether reading a value of ``device`` back on the host costs no synchronisation.

    True on the CPU, where the dynamics branch on the host (skip a neighbour
    list whose skin still holds, answer "did anything fail" with one read);
    False on an accelerator, where they take nvalchemi's sync-free paths
    instead. The one place this choice is made, so that tests can force the
    accelerator paths on a CPU.

    Parameters
    ----------
    device : torch.device
        The device a batch lives on.

    Returns
    -------
    bool
        ``device.type == "cpu"``.
    """
    return device.type == "cpu"
