"""The replay of a traced step with the overlap on (launcher/benchmarks/ep_overlap_replay.py) against a
two-node step worked out by hand."""

from __future__ import annotations

import pytest


def _e(rank, kind, start, end, seq, **kw):
    return {
        "step": 2,
        "pass": "train",
        "rank": rank,
        "kind": kind,
        "start": start,
        "end": end,
        "seq": seq,
        "microbatch": kw.pop("mb", 0),
        "layer": 2,
        "what": "dispatch",
        "direction": "forward",
        **kw,
    }


def _traces():
    """Rank 0 posts dispatch A at 1 (rank 1 calls its all-to-all at 3: a wait of 2 for the other rank's call;
    both end at 6) and waits for it 4-6; posts B (microbatch 1) at 7, its all-to-all 7-8 on both ranks, and
    finds it done at 8. The pass runs 0-10."""
    r0 = [
        _e(0, "end", 0.0, 10.0, 0),
        _e(0, "post", 1.0, 1.0, 1, req=1),
        _e(0, "a2a", 1.0, 6.0, 2),
        _e(0, "wait", 4.0, 6.0, 3, req=1),
        _e(0, "post", 7.0, 7.0, 4, req=2, mb=1),
        _e(0, "a2a", 7.0, 8.0, 5, mb=1),
        _e(0, "wait", 8.0, 8.0, 6, req=2, mb=1),
    ]
    r1 = [_e(1, "end", 0.0, 10.0, 0), _e(1, "a2a", 3.0, 6.0, 1), _e(1, "a2a", 7.0, 8.0, 2, mb=1)]
    return {0: r0, 1: r1}


def test_a_replayed_step_by_hand():
    """As traced: A takes 5 on the communication thread (1-6), the wait 4-6 exposes 2, B nothing. Without the
    wait for the other rank's call A takes 3 and ends at 4: nothing exposed. With the means (each node 3, the
    post-to-wait stretches (3 and 1) 2 each): A 1-4 exposes 1 (the main thread at 3), B 5-8 exposes 1 (the
    main thread at 7): 2; without the wait for the other rank (nodes 2 each) nothing."""
    from k2.launcher.benchmarks.ep_overlap_replay import replay_exposure, step_streams

    seq, nodes = step_streams(_traces(), 0, 2)
    assert [n["seconds"] for n in nodes] == pytest.approx([5.0, 1.0])
    assert [n["peer_wait"] for n in nodes] == pytest.approx([2.0, 0.0])
    assert [op for op, _ in seq] == [
        "compute",
        "post",
        "compute",
        "wait",
        "compute",
        "post",
        "compute",
        "wait",
        "compute",
    ]
    assert replay_exposure(_traces(), 0, 2) == pytest.approx(
        {"as_traced": 2.0, "no_peer_wait": 0.0, "means": 2.0, "means_no_peer_wait": 0.0}
    )


def test_the_command_prints_each_step_and_rank_or_says_what_it_needs(tmp_path, capsys):
    """``python -m k2.launcher.benchmarks.ep_overlap_replay DIR``: one JSON line per timed step and rank; no
    directory, or one without traces, is one line saying so."""
    import json

    from k2.launcher.benchmarks.ep_overlap_replay import main

    assert main([]) == 2 and "usage" in capsys.readouterr().err
    assert main([str(tmp_path)]) == 2 and "no rank<R>.jsonl" in capsys.readouterr().err
    for rank, events in _traces().items():
        first = [{**e, "step": 1} for e in events]  # (step 1 is not timed)
        (tmp_path / f"rank{rank}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in first + events))
    assert main([str(tmp_path)]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [(x["step"], x["rank"]) for x in lines] == [(2, 0), (2, 1)] and lines[0]["as_traced"] == 2.0
