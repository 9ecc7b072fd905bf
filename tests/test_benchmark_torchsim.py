"""The TorchSim side-by-side benchmark skips cleanly where TorchSim is absent.

The measurement itself needs TorchSim's own interpreter (Python >= 3.12) and
minutes; here only the paths every machine takes: no interpreter (one line,
skipped) and an interpreter without ``torch_sim`` (the subprocess's error
reaches the caller).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


@pytest.mark.slow
def test_missing_interpreter_is_one_skipped_line(tmp_path):
    report = tmp_path / "performance.md"
    env = dict(os.environ, NVALCHEMI_ASE_TORCHSIM_PYTHON=str(tmp_path / "none"))
    command = ["-m", "benchmarks", "--quick", "--only", "torchsim"]
    result = subprocess.run(
        [sys.executable, *command, "--output", str(report)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    section = report.read_text().split("## 7. TorchSim side by side")[1]
    assert "No TorchSim interpreter at" in section
    assert "NVALCHEMI_ASE_TORCHSIM_PYTHON" in section
    assert section.strip().endswith("skipped.")


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("torch_sim") is not None,
    reason="torch_sim is importable here, so the side would start",
)
def test_side_without_torch_sim_raises_with_its_error():
    sys.path.insert(0, str(ROOT))
    try:
        from benchmarks.torchsim import TorchSimSide
    finally:
        sys.path.remove(str(ROOT))
    side = TorchSimSide(Path(sys.executable))
    try:
        with pytest.raises(RuntimeError, match="torch_sim"):
            side.request("versions")
    finally:
        side.close()
