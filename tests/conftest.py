"""Shared fixtures: expensive models and calculators are built once per session."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(
        reason="needs CUDA (torch.cuda.is_available() is False)"
    )
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def lj_calc64():
    from nvalchemi_ase import NVAlchemiCalculator

    return NVAlchemiCalculator("lj", device="cpu", dtype="float64")


@pytest.fixture(scope="session")
def lj_calc32():
    from nvalchemi_ase import NVAlchemiCalculator

    return NVAlchemiCalculator("lj", device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def calc_by_dtype(lj_calc64, lj_calc32):
    return {torch.float64: lj_calc64, torch.float32: lj_calc32}
