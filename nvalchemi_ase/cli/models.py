"""``nvalchemi-ase models``: every model name, what it is, and whether it can run here.

For each name ``load_model`` (and ``--model`` of every command) accepts: the
elements it evaluates, its cutoff, the dtype of its weights, the licence, the
extra to install (and whether its package is installed), where the weights
come from and, for weights read from the weights folder
(``$NVALCHEMI_ASE_WEIGHTS``, default ``~/.cache/nvalchemi_ase/weights``),
whether the file is there. Nothing is imported or loaded to find out: packages
are looked up with ``importlib.util.find_spec`` and files with ``stat``.

``--json`` prints the same as a JSON list, one object per model.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from typing import Any

__all__ = ["EXTRA_PACKAGES", "add_arguments", "model_rows", "run"]

#: The Python package each extra provides, looked up to say "installed".
EXTRA_PACKAGES = {
    "sevennet": "sevenn",
    "mace": "mace",
    "d3": "tad_dftd3",
    "aimnet": "aimnet",
    "uma": "fairchem",
}

_COLUMNS = (
    ("name", "name"),
    ("elements", "elements"),
    ("cutoff", "cutoff"),
    ("dtype", "dtype"),
    ("licence", "licence"),
    ("extra", "extra"),
    ("weights", "weights"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the ``models`` options."""
    parser.add_argument(
        "--json", action="store_true", help="print a JSON list instead of a table"
    )


def model_rows() -> list[dict[str, Any]]:
    """Return one dict per registered model, with what is installed and present.

    Returns
    -------
    list of dict
        ``ModelInfo.as_row()`` plus ``installed`` (the extra's package is
        importable; True without an extra; None for an extra this command does
        not know) and ``weights_present`` (the file is in the weights folder;
        None for models whose weights do not come from it), sorted by name.
    """
    from nvalchemi_ase.models import registry
    from nvalchemi_ase.models.weights import weights_dir

    folder = weights_dir()
    rows = []
    for info in registry.entries():
        row = info.as_row()
        row["installed"] = _installed(info.extra)
        file = None if info.weights_file is None else folder / info.weights_file
        row["weights_present"] = None if file is None else file.is_file()
        rows.append(row)
    return rows


def run(args: argparse.Namespace) -> int:
    """List the models; return 0."""
    from nvalchemi_ase.models.weights import WEIGHTS_ENV, weights_dir

    rows = model_rows()
    if args.json:
        json.dump(rows, sys.stdout, indent=2, ensure_ascii=False)
        sys.stdout.write("\n")
        return 0
    from nvalchemi_ase.cli._table import format_table
    from nvalchemi_ase.cli.common import say

    table = [[_cell(key, row) for _, key in _COLUMNS] for row in rows]
    lines = [format_table([title for title, _ in _COLUMNS], table), ""]
    folder = weights_dir()
    lines.append(f"weights folder: {folder} (${WEIGHTS_ENV}); nothing is downloaded")
    lines.extend(
        f"  missing for {row['name']}: {row['weights']}"
        for row in rows
        if row["weights_present"] is False
    )
    lines.append(
        'extras: pip install "nvalchemi-ase[EXTRA]"; for mace also '
        "pip install --no-deps mace-torch==0.3.15 (README, Models)"
    )
    say(args, "\n".join(lines))
    return 0


def _installed(extra: str | None) -> bool | None:
    if extra is None:
        return True
    package = EXTRA_PACKAGES.get(extra)
    if package is None:
        return None
    return importlib.util.find_spec(package) is not None


def _cell(key: str, row: dict[str, Any]) -> str:
    value = row[key]
    if key == "name":
        aliases = row["aliases"]
        return value if not aliases else f"{value} ({', '.join(aliases)})"
    if key == "extra":
        if value is None:
            return "-"
        status = {True: "installed", False: "not installed", None: "?"}
        return f"{value} ({status[row['installed']]})"
    if key == "weights":
        present = row["weights_present"]
        if present is None:
            return str(value)
        return f"{row['weights_file']} ({'present' if present else 'missing'})"
    return str(value)
