"""``nvalchemi-ase demo``: progress on stderr when output is piped, honest rates.

The demo's end-to-end outputs (tables, plots, files) are checked in
``test_cli.py``; here: what a user watching a slow or piped run sees.
"""

from __future__ import annotations

import io
import re

import pytest

from nvalchemi_ase.cli import demo
from nvalchemi_ase.cli.main import main
from nvalchemi_ase.dynamics.progress import (
    ProgressBar,
    format_rate,
    format_significant,
)

LJ_DEMO = ["demo", "--model", "lj", "--device", "cpu", "--md-steps", "5"]
STAGE = re.compile(r"^\[demo +\d+\.\d s\] (.*)$", re.MULTILINE)


def test_progress_reaches_stderr_when_stdout_is_not_a_terminal(tmp_path, capsys):
    # under capsys neither stdout nor stderr is a terminal, as with `make demo > log`
    assert main([*LJ_DEMO, "-o", str(tmp_path / "demo")]) == 0
    captured = capsys.readouterr()
    stages = STAGE.findall(captured.err)
    for expected in (
        "loading model",
        "single points done",
        "relaxation done",
        "MD done",
        "demo done",
    ):
        assert any(line.startswith(expected) for line in stages), (expected, stages)
    # the dynamics report in lines, not a bar's carriage-return redraws
    assert "\r" not in captured.err
    assert re.search(r"^FIRE: \d+/300 steps, [0-9.]+ s", captured.err, re.MULTILINE)
    assert re.search(r"^Langevin: 5/5 steps, [0-9.]+ s", captured.err, re.MULTILINE)
    # progress stays off standard output, the tables stay on it
    assert "[demo" not in captured.out
    assert "single points (one batched call" in captured.out


def test_quiet_demo_writes_no_progress(tmp_path, capsys):
    assert main([*LJ_DEMO, "--quiet", "-o", str(tmp_path / "demo")]) == 0
    captured = capsys.readouterr()
    assert "[demo" not in captured.err
    assert "steps, " not in captured.err
    assert "converged" in captured.out


def test_slow_rates_are_printed_as_seconds_per_step_not_zero(
    tmp_path, capsys, monkeypatch
):
    # a machine so slow that every clock reading is 100 s later than the last
    ticks = iter(range(0, 10**9, 100))
    monkeypatch.setattr(demo, "_clock", lambda: float(next(ticks)))
    assert main([*LJ_DEMO, "--quiet", "-o", str(tmp_path / "demo")]) == 0
    out = capsys.readouterr().out
    md_line = next(line for line in out.splitlines() if "Langevin MD" in line)
    assert re.search(r"\b0 (structure-|batched )?steps/s", md_line) is None, md_line
    # 5 steps of 3 structures in 100 s: 20.0 s per batched step, 6.67 s each
    assert "20.0 s/batched step" in md_line
    assert "6.67 s/structure-step" in md_line
    relax_line = next(line for line in out.splitlines() if "relaxed together" in line)
    assert "s/batched step" in relax_line


@pytest.mark.parametrize(
    ("count", "seconds", "unit", "text"),
    [
        (60, 1275.0, "structure-step", "21.2 s/structure-step"),
        (1, 0.5, "step", "2.00 steps/s"),
        (700, 1.0, "step", "700 steps/s"),
        (12345, 1.0, "step", "12300 steps/s"),
        (3, 7.0, "step", "2.33 s/step"),
        (999, 1000.0, "step", "1.00 s/step"),
    ],
)
def test_format_rate_keeps_three_significant_digits(count, seconds, unit, text):
    assert format_rate(count, seconds, unit) == text


def test_format_significant():
    assert format_significant(0.0) == "0"
    assert format_significant(9.996) == "10.0"
    assert format_significant(0.012345) == "0.0123"
    assert format_significant(-3.14159) == "-3.14"
    assert format_significant(1e-5) == "1.00e-05"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_lines_off_a_terminal_and_a_bar_on_one():
    piped = io.StringIO()
    with ProgressBar("FIRE", 3, file=piped, interval=0.0) as bar:
        for _ in range(3):
            bar.step("converged 1/2")
    lines = piped.getvalue().splitlines()
    assert len(lines) == 4  # one per step (interval 0) and one at the end
    assert lines[-1].startswith("FIRE: 3/3 steps, ")
    assert lines[-1].endswith("; converged 1/2")
    assert "\r" not in piped.getvalue()

    terminal = _Terminal()
    with ProgressBar("FIRE", 3, file=terminal) as bar:
        for _ in range(3):
            bar.step()
    assert "\r" in terminal.getvalue()  # tqdm redraws in place
    assert "3/3" in terminal.getvalue()


def test_thread_choice_leaves_free_cores_and_restores_torch(monkeypatch):
    import torch

    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(demo, "_load_average", lambda: 9.3)
    monkeypatch.setattr(demo, "_cores", lambda: 2)
    with demo.choose_threads("cpu", None) as note:
        assert torch.get_num_threads() == 1
        assert note == "1 torch thread, load 9.3 on 2 cores"
    assert torch.get_num_threads() == before
    with demo.choose_threads("cpu", 1) as note:
        assert note == "1 torch thread, from --threads"
    with demo.choose_threads("cuda:0", None) as note:
        assert note is None


@pytest.mark.parametrize(
    ("widgets", "kind"), [(True, "widget"), (False, "bar")], ids=["widgets", "none"]
)
def test_progress_in_a_notebook_is_a_widget_or_a_clean_text_bar(
    monkeypatch, widgets, kind
):
    """In a kernel: tqdm's widget with ipywidgets, else a text bar, no warning."""
    from nvalchemi_ase.dynamics import progress

    if widgets:
        pytest.importorskip("ipywidgets")
    monkeypatch.setattr(progress, "in_notebook", lambda: True)
    monkeypatch.setattr(progress, "notebook_widgets_available", lambda: widgets)
    assert progress.progress_enabled(None)
    with ProgressBar("FIRE", 3) as bar:  # the suite turns warnings into errors
        for _ in range(3):
            bar.step("converged 1/2")
        assert bar.kind == kind
    # an explicit stream is honoured as outside a notebook
    with ProgressBar("FIRE", 3, file=io.StringIO()) as bar:
        assert bar.kind == "lines"


def test_in_notebook_is_false_outside_a_kernel():
    from nvalchemi_ase.dynamics.progress import in_notebook

    assert in_notebook() is False
