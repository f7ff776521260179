"""``k2-sweep-report`` end to end on fake grids: the five outputs and the summary, the same bytes on a second
run, a half-finished grid reported with its incomplete cells named by file (exit 0, provisional), bad
arguments refused in one line (exit 2), an output directory that cannot take the report (read-only, full, a
directory in the way) in one line with no report left behind (exit 1), and the parameter count of the real
model."""

from __future__ import annotations

import csv
import errno
import json
import os
import shutil
import warnings

import numpy as np
import pytest

from k2.launcher.sweep_report import main as report_main
from k2.launcher.tools import sweep_records
from support.fake_sweep import fake_params, write_grid

OUTPUTS = ("sweep_cells.csv", "sweep.md", "sweep.json", "sweep_loss_vs_flops.png", "sweep_multiplier.png")


def _law(arm, seed, budget, flops):
    """Sparsity 4 below dense by 2% of the loss, seeds 0.002 nats apart."""
    return (0.98 if arm == "sparsity_4" else 1.0) * 5.0 * (flops / 1e10) ** -0.06 + 0.002 * seed


@pytest.fixture
def grid_dir(tmp_path):
    write_grid(tmp_path, [1, 4], [1, 2], [4, 8, 16], _law)
    return tmp_path


def run(argv, capsys):
    rc = report_main([str(a) for a in argv], params_of=fake_params)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_outputs_summary_and_same_numbers_twice(grid_dir, tmp_path_factory, capsys):
    rc, out, err = run([grid_dir, "--bootstrap", "50"], capsys)
    assert rc == 0 and err == ""
    assert all((grid_dir / f).stat().st_size > 0 for f in OUTPUTS)
    assert not list(grid_dir.glob(".*.tmp"))  # written under a temporary name, then renamed
    lines = out.splitlines()
    assert lines[0] == "sweep fake_sweep: 12 of 12 cells finished, seeds [1, 2]"
    assert any(ln.startswith("  dense (sparsity 1): alpha 0.0600 [") for ln in lines)
    assert "  sign: sparsity_4 vs dense (sparsity 1): fewer FLOPs at every target, every interval above 1" in lines
    # sparsity 4 is 2% lower at every FLOPs with the same alpha: C_dense / C_4 = 0.98^(-1/0.06) at every loss
    rep = json.loads((grid_dir / "sweep.json").read_text())
    for r in rep["multipliers"]["sparsity_1"]:
        assert r["multiplier"] == pytest.approx(0.98 ** (-1 / 0.06), rel=1e-4)
    assert rep["provisional"] == {"overall": False, "reasons": []}
    assert "C = sum over a cell's training steps" in rep["flop_formula"]
    rows = list(csv.DictReader(open(grid_dir / "sweep_cells.csv")))
    assert len(rows) == 12 and {r["in_fit"] for r in rows} == {"True"}
    assert rows[0]["params_total"] == str(fake_params_of(rows[0]))
    # a second run (into another dir) writes the same bytes
    other = tmp_path_factory.mktemp("again")
    assert run([grid_dir, "--bootstrap", "50", "--out", other], capsys)[0] == 0
    for f in ("sweep_cells.csv", "sweep.md", "sweep.json"):
        assert (other / f).read_bytes() == (grid_dir / f).read_bytes(), f


def fake_params_of(row) -> int:
    return 1_000_000 + 50_000 * int(row["experts"])


def test_the_loss_figure_has_every_arm_in_its_colour(grid_dir, capsys):
    import matplotlib.image as mpimg

    assert run([grid_dir, "--bootstrap", "0"], capsys)[0] == 0
    img = mpimg.imread(grid_dir / "sweep_loss_vs_flops.png")[..., :3]  # decoded pixels, not only the header
    for rgb in ((0x1F, 0x77, 0xB4), (0xFF, 0x7F, 0x0E)):  # matplotlib's C0, C1: dense, sparsity 4
        assert np.all(np.abs(img - np.array(rgb) / 255.0) < 0.03, axis=-1).sum() > 200, rgb


def test_half_finished_grid_is_reported_with_its_incomplete_cells_named(grid_dir, capsys):
    torn = grid_dir / "sparsity_4/seed_1/budget_8192/metrics.jsonl"  # torn mid-file
    lines = torn.read_text().splitlines()
    torn.write_text("\n".join(lines[:3] + [lines[3][:25]] + lines[4:]) + "\n")
    running = grid_dir / "sparsity_4/seed_2/budget_16384"  # still running: no cell.json, short of its budget
    (running / "cell.json").unlink()
    (running / "metrics.jsonl").write_text(
        "".join(x + "\n" for x in (running / "metrics.jsonl").read_text().splitlines()[:-1])
    )
    shutil.rmtree(grid_dir / "sparsity_1/seed_2/budget_4096")  # never started
    rc, out, err = run([grid_dir, "--bootstrap", "20"], capsys)
    assert rc == 0 and err == ""
    named = [
        "sparsity_4/seed_1/budget_8192/metrics.jsonl:4: not a valid metrics record",
        "sparsity_4/seed_2/budget_16384/cell.json: absent (not finished)",
        "sparsity_1/seed_2/budget_4096/: no such directory",
    ]
    md = (grid_dir / "sweep.md").read_text()
    for text in named:
        assert text in out and text in md
    assert "9 of 12 cells finished" in out and "provisional: yes" in out
    rep = json.loads((grid_dir / "sweep.json").read_text())
    assert rep["provisional"]["overall"] is True
    assert "sparsity_4: 2 cell(s) missing, unfinished or unreadable" in rep["provisional"]["reasons"]
    assert {c["status"] for c in rep["incomplete_cells"]} == {"unreadable", "unfinished", "missing"}
    assert rep["fits"]["sparsity_4"]["fit"]["alpha"] == pytest.approx(0.06, abs=1e-3)  # fitted on the rest


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "the following arguments are required: SWEEP_DIR"),
        (["{d}", "--bogus"], "unrecognized arguments: --bogus"),
        (["{d}", "--targets", "abc"], "argument --targets: 'abc': expected comma-separated losses"),
        (["{d}", "--targets", "3.0,-1"], "every target loss must be a finite number > 0"),
        (["{d}", "--level", "1.5"], "argument --level: '1.5': expected a number in (0, 1)"),
        (["{d}", "--bootstrap", "-3"], "argument --bootstrap: '-3': expected an integer >= 0"),
        (["{d}", "--reference", "sparse"], "--reference=sparse; allowed: sparsity_1, sparsity_4, dense (= sparsity_1)"),
        (["{d}", "--targets", "100,200"], "--targets: 100, 200 outside the measured final losses [4."),
        (["{d}/nowhere"], "grid.json: no such file"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(grid_dir, capsys, argv, message):
    rc, out, err = run([a.format(d=grid_dir) for a in argv], capsys)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("k2-sweep-report: error: ") and message in err, err


def test_no_readable_cell_exits_2(grid_dir, capsys):
    for d in grid_dir.glob("sparsity_*"):
        shutil.rmtree(d)
    rc, _, err = run([grid_dir], capsys)
    assert rc == 2 and err.count("\n") == 1 and "no readable cell among the 12 of grid.json" in err


def test_help_and_the_real_parameter_count(tmp_path, capsys):
    """The default parameter count is k2.model.params.count_params: k2_tiny at 8 experts, top-2."""
    assert report_main(["SWEEP_DIR", "--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: k2-sweep-report")
    write_grid(tmp_path, [4], [1], [4, 8], _law, reference="sparsity_4")
    assert report_main([str(tmp_path), "--bootstrap", "0"]) == 0
    row = next(csv.DictReader(open(tmp_path / "sweep_cells.csv")))
    assert (row["params_total"], row["params_active"]) == ("2068992", "1626624")


def _one_error_line(err: str, *parts: str) -> None:
    assert err.count("\n") == 1 and err.startswith("k2-sweep-report: error: "), err
    assert "Traceback" not in err and all(p in err for p in parts), err


def test_an_output_that_cannot_be_renamed_into_place_leaves_no_report(grid_dir, tmp_path_factory, capsys):
    """A directory where the last figure goes: the files renamed before it are removed again, so the
    directory holds no report that looks complete (no sweep.md linking a figure that is not there)."""
    out = tmp_path_factory.mktemp("out")
    (out / "sweep_multiplier.png").mkdir()
    (out / "sweep_multiplier.png" / "keep").write_text("x")
    rc, stdout, err = run([grid_dir, "--bootstrap", "0", "--out", out], capsys)
    assert rc == 1 and stdout == ""
    _one_error_line(
        err,
        f"{out}/sweep_multiplier.png: cannot write it (Is a directory); the report was not written "
        "(removed again: sweep_cells.csv, sweep.json, sweep_loss_vs_flops.png)",
    )
    assert sorted(p.name for p in out.iterdir()) == ["sweep_multiplier.png"]  # no output, no temporary


@pytest.mark.parametrize(
    "errno_, cause, failing",
    [
        (errno.ENOSPC, "No space left on device", "sweep_loss_vs_flops.png"),
        (errno.EROFS, "Read-only file system", "sweep_cells.csv"),
    ],
)
def test_a_full_disk_or_read_only_dir_is_one_line_and_leaves_the_old_report(
    grid_dir, capsys, monkeypatch, errno_, cause, failing
):
    """A write that fails (as on a full disk or a read-only mount) part-way through: one line naming the
    file and the cause, exit 1; the report there before is untouched and no temporary is left."""
    assert run([grid_dir, "--bootstrap", "0"], capsys)[0] == 0
    before = {f: (grid_dir / f).read_bytes() for f in OUTPUTS}
    real = sweep_records._write_temporary

    def write(path, data):
        if path.name == f".{failing}.tmp":
            path.write_bytes(data[:10])  # a partial temporary, as a full disk leaves it
            raise OSError(errno_, os.strerror(errno_), str(path))
        real(path, data)

    monkeypatch.setattr(sweep_records, "_write_temporary", write)
    rc, stdout, err = run([grid_dir, "--bootstrap", "7"], capsys)
    assert rc == 1 and stdout == ""
    _one_error_line(err, f"{grid_dir}/{failing}: cannot write it ({cause}); the report was not written")
    assert {f: (grid_dir / f).read_bytes() for f in OUTPUTS} == before
    assert not list(grid_dir.glob(".*.tmp"))


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a directory without write permission")
def test_a_read_only_sweep_dir_is_one_line(grid_dir, capsys):
    grid_dir.chmod(0o555)
    try:
        rc, stdout, err = run([grid_dir, "--bootstrap", "0"], capsys)
    finally:
        grid_dir.chmod(0o755)
    assert rc == 1 and stdout == ""
    _one_error_line(err, f"{grid_dir}/sweep_cells.csv: cannot write it (Permission denied)")
    assert not any((grid_dir / f).exists() for f in OUTPUTS)


def test_one_seed_two_arms_no_fit_says_what_it_has(tmp_path, capsys):
    """One seed and one budget per arm: no fit; the finished seed is still named, the figure drawn without a
    legend warning."""
    write_grid(tmp_path, [1, 4], [1], [4], _law)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rc, out, err = run([tmp_path, "--bootstrap", "10"], capsys)
    assert rc == 0 and err == ""
    assert out.splitlines()[0] == "sweep fake_sweep: 2 of 2 cells finished, seeds [1]"
    assert "seeds [1]; reference arm" in (tmp_path / "sweep.md").read_text()


def test_one_seed_sign_and_two_arms_compared_once(tmp_path, capsys):
    """With one seed there are no intervals, and the sign line says so (not "an interval reaches 1"); with two
    arms there is no second comparison against the lowest sparsity (it has no arm above it)."""
    write_grid(tmp_path, [1, 4], [1], [4, 8, 16], _law)
    rc, out, err = run([tmp_path, "--bootstrap", "10"], capsys)
    assert rc == 0 and err == ""
    assert "  sign: sparsity_4 vs dense (sparsity 1): fewer FLOPs at every target (no intervals: one seed)" in out
    assert "against sparsity_4" not in out
    md = (tmp_path / "sweep.md").read_text()
    assert "- sparsity_4: fewer FLOPs at every target (no intervals: one seed)" in md
    assert "### Against sparsity_4" not in md and md.count("### Against") == 1
    assert list(json.loads((tmp_path / "sweep.json").read_text())["multipliers"]) == ["sparsity_1"]


def test_reference_dense_and_a_target_outside_one_arm(grid_dir, capsys):
    """``--reference dense`` names the sparsity-1 arm; a target inside the measured losses but outside one
    arm's is reported, its multiplier marked extrapolated."""
    assert run([grid_dir, "--bootstrap", "0"], capsys)[0] == 0
    ranges = {a: f["loss_range"] for a, f in json.loads((grid_dir / "sweep.json").read_text())["fits"].items()}
    below_dense = (ranges["sparsity_4"][0] + ranges["sparsity_1"][0]) / 2  # sparsity 4 reaches it, dense not
    rc, out, err = run([grid_dir, "--bootstrap", "0", "--reference", "dense", "--targets", f"{below_dense}"], capsys)
    assert rc == 0 and err == ""
    assert "multipliers C_base(L*) / C_arm(L*) against dense (sparsity 1)" in out
    assert "(extrapolated: outside an arm's losses)" in out
