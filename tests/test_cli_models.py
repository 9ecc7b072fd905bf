"""``nvalchemi-ase models``: every registered name, what it needs, what is here."""

from __future__ import annotations

import importlib.util
import json

from nvalchemi_ase.cli.main import main
from nvalchemi_ase.cli.models import EXTRA_PACKAGES
from nvalchemi_ase.models import available_models, registry
from nvalchemi_ase.models.mace import FOUNDATIONS
from nvalchemi_ase.models.weights import WEIGHTS_ENV


def _json(capsys) -> list[dict]:
    assert main(["models", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_lists_every_registered_model_with_its_facts(capsys):
    rows = _json(capsys)
    names = [row["name"] for row in rows]
    assert names == [info.name for info in registry.entries()]
    listed = set(names) | {alias for row in rows for alias in row["aliases"]}
    assert listed == set(available_models())  # every accepted name, aliases too
    for row in rows:
        info = registry.lookup(row["name"])
        assert info is not None
        status = {"installed", "weights_present"}
        assert {k: v for k, v in row.items() if k not in status} == info.as_row()
        for key in ("elements", "cutoff", "dtype", "licence", "weights"):
            assert row[key], (row["name"], key)


def test_installed_follows_the_extras_package(capsys):
    for row in _json(capsys):
        extra = row["extra"]
        if extra is None:
            assert row["installed"] is True
        elif extra in EXTRA_PACKAGES:
            found = importlib.util.find_spec(EXTRA_PACKAGES[extra]) is not None
            assert row["installed"] is found, row["name"]


def test_weights_present_follows_the_weights_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(WEIGHTS_ENV, str(tmp_path))
    entry = FOUNDATIONS["mace-mpa-0-medium"]
    (tmp_path / entry.filename).write_bytes(b"not read by the listing")
    rows = {row["name"]: row for row in _json(capsys)}
    assert rows["mace-mpa-0-medium"]["weights_present"] is True
    assert rows["mace-mp-0-medium"]["weights_present"] is False
    assert rows["sevennet-0"]["weights_present"] is None  # ships in the wheel
    assert rows["lj"]["weights_present"] is None


def test_the_table_names_each_model_and_how_to_get_missing_weights(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv(WEIGHTS_ENV, str(tmp_path))
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    for info in registry.entries():
        assert f" {info.name} " in out or f" {info.name} (" in out, info.name
    entry = FOUNDATIONS["mace-off23-small"]
    assert f"{entry.filename} (missing)" in out
    assert entry.url in out  # where to get it
    assert str(tmp_path) in out
