"""``python -m k2.schedules.pipeline_trace TRACE_DIR OUT.png [STEP]`` (docs/pipeline.md): the timeline of the
chosen step of a ``pipeline.trace`` directory, drawn from a synthetic two-rank trace whose step 1 has F,
B and W boxes, whose step 2 has no W and whose step 3 has the all-to-alls of ``pipeline.ep_overlap`` on the
communication thread: the decoded pixels show W's green only for step 1, and the dispatch / combine
colours only for step 3."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np

from support import REPO

# draw_trace's colours: F blue, B orange, W green (light = chunk 0)
COLOURS = {
    "F": (0x9E, 0xCA, 0xE1),
    "B": (0xFD, 0xAE, 0x6B),
    "W": (0xA1, 0xD9, 0x9B),
    "dispatch": (0xBC, 0xBD, 0xDC),
    "combine": (0xFC, 0xBB, 0xA1),
}


def _trace(directory):
    directory.mkdir()
    for rank in (0, 1):
        events = []
        for step, kinds in ((1, "FBW"), (2, "FB"), (3, "FB")):
            t = 10.0 * step + 0.5 * rank
            for mb in range(2):
                for kind in kinds:
                    events.append(
                        {
                            "rank": rank,
                            "pp_rank": rank,
                            "step": step,
                            "pass": "train",
                            "kind": kind,
                            "chunk": 0,
                            "microbatch": mb,
                            "start": t,
                            "end": t + 0.2,
                        }
                    )
                    if step == 3:  # this microbatch's all-to-alls, on the communication thread meanwhile
                        events.append(
                            {
                                "rank": rank,
                                "pp_rank": rank,
                                "step": step,
                                "pass": "train",
                                "kind": "a2a",
                                "what": "dispatch" if kind == "F" else "combine",
                                "thread": "k2-comm-stream",
                                "chunk": 0,
                                "microbatch": mb,
                                "start": t,
                                "end": t + 0.15,
                            }
                        )
                    t += 0.25
        (directory / f"rank{rank}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))


def _pixels_of(img, rgb) -> int:
    return int(np.all(np.abs(img[..., :3] - np.array(rgb) / 255.0) < 0.02, axis=-1).sum())


def test_trace_cli_draws_the_chosen_step(tmp_path):
    import matplotlib.image as mpimg

    _trace(tmp_path / "trace")
    seen = {}
    for step in (1, 2, 3):  # step 1 through the command line, the others through draw_trace
        out = tmp_path / f"step{step}.png"
        if step == 1:
            p = subprocess.run(
                [sys.executable, "-m", "k2.schedules.pipeline_trace", str(tmp_path / "trace"), str(out), str(step)],
                cwd=REPO,
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert p.returncode == 0, p.stderr[-2000:]
            assert p.stdout.strip() == str(out)
        else:
            from k2.schedules.pipeline_trace import draw_trace

            assert draw_trace(str(tmp_path / "trace"), str(out), step) == str(out)
        img = mpimg.imread(out)
        seen[step] = {k: _pixels_of(img, rgb) for k, rgb in COLOURS.items()}
    assert min(seen[1][k] for k in "FBW") > 100 and seen[1]["dispatch"] == seen[1]["combine"] == 0, seen
    assert seen[2]["F"] > 100 and seen[2]["B"] > 100 and seen[2]["W"] == 0, seen
    assert seen[3]["dispatch"] > 100 and seen[3]["combine"] > 100, seen
