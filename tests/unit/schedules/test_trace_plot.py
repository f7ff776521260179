"""``python -m k2.schedules.pipeline TRACE_DIR OUT.png [STEP]`` (docs/pipeline.md): the timeline of the
chosen step of a ``pipeline.trace`` directory, drawn from a synthetic two-rank trace whose step 1 has F,
B and W boxes and whose step 2 has no W: the decoded pixels show W's green only for step 1."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np

from support import REPO

# draw_trace's colours: F blue, B orange, W green (light = chunk 0)
COLOURS = {"F": (0x9E, 0xCA, 0xE1), "B": (0xFD, 0xAE, 0x6B), "W": (0xA1, 0xD9, 0x9B)}


def _trace(directory):
    directory.mkdir()
    for rank in (0, 1):
        events = []
        for step, kinds in ((1, "FBW"), (2, "FB")):
            t = 10.0 * step + 0.5 * rank
            for mb in range(2):
                for kind in kinds:
                    events.append({"rank": rank, "pp_rank": rank, "step": step, "pass": "train", "kind": kind,
                                   "chunk": 0, "microbatch": mb, "start": t, "end": t + 0.2})
                    t += 0.25
        (directory / f"rank{rank}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))


def _pixels_of(img, rgb) -> int:
    return int(np.all(np.abs(img[..., :3] - np.array(rgb) / 255.0) < 0.02, axis=-1).sum())


def test_trace_cli_draws_the_chosen_step(tmp_path):
    import matplotlib.image as mpimg

    _trace(tmp_path / "trace")
    seen = {}
    for step in (1, 2):  # step 1 through the command line, step 2 through draw_trace (one import less)
        out = tmp_path / f"step{step}.png"
        if step == 1:
            p = subprocess.run([sys.executable, "-m", "k2.schedules.pipeline", str(tmp_path / "trace"), str(out),
                                str(step)], cwd=REPO, capture_output=True, text=True, timeout=300)
            assert p.returncode == 0, p.stderr[-2000:]
            assert p.stdout.strip() == str(out)
        else:
            from k2.schedules.pipeline import draw_trace

            assert draw_trace(str(tmp_path / "trace"), str(out), step) == str(out)
        img = mpimg.imread(out)
        seen[step] = {k: _pixels_of(img, rgb) for k, rgb in COLOURS.items()}
    assert min(seen[1].values()) > 100, seen  # F, B and W boxes drawn for step 1
    assert seen[2]["F"] > 100 and seen[2]["B"] > 100 and seen[2]["W"] == 0, seen
