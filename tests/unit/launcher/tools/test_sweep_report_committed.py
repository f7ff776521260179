"""``k2-sweep-report`` on the committed CPU sweep (``benchmarks/results/sparsity_sweep_cpu``, its metrics as
trained) writes the committed report files byte for byte: a change to the report's numbers or text shows
here, and the committed files are then regenerated with the tool (never edited by hand)."""

from __future__ import annotations

import pytest

from k2.launcher.sweep_report import main as report_main
from support import REPO

COMMITTED = REPO / "benchmarks/results/sparsity_sweep_cpu"


@pytest.mark.skipif(not (COMMITTED / "grid.json").is_file(), reason="the committed CPU sweep is not in this checkout")
def test_the_committed_report_is_reproduced(tmp_path, capsys):
    assert report_main([str(COMMITTED), "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("sweep sparsity_sweep: 32 of 32 cells finished")
    for name in ("sweep_cells.csv", "sweep.md", "sweep.json"):
        assert (tmp_path / name).read_text() == (COMMITTED / name).read_text(), name
