"""The CPU stand-in for megatron's communication CUDA stream (parallel/comm_stream.py): work runs on its
own thread in the order it was queued, issuing returns at once, a consumer waits on the future (and the
observer sees the wait), an error reaches the consumer, and the overlap is real: a blocking call on the
stream runs while the issuing thread computes."""

from __future__ import annotations

import threading
import time

import pytest

from k2.parallel.comm_stream import CommStream, resolve


@pytest.fixture
def stream():
    s = CommStream()
    yield s
    s.close()


def test_fifo_on_its_own_thread(stream):
    seen = []
    futs = [
        stream.submit(lambda i=i: (time.sleep(0.01 * (3 - i)), seen.append((i, threading.current_thread().name)))[1])
        for i in range(3)
    ]
    resolve(futs)
    assert [i for i, _ in seen] == [0, 1, 2]  # submission order, although the first is the slowest
    assert {name for _, name in seen} == {"k2-comm-stream"} != {threading.current_thread().name}


def test_issue_returns_at_once_and_the_wait_overlaps_compute(stream):
    t0 = time.perf_counter()
    fut = stream.submit(time.sleep, 0.3)  # a collective waiting on the wire: the GIL is free meanwhile
    issued = time.perf_counter() - t0
    time.sleep(0.3)  # the issuing thread's own work
    resolve(fut)
    total = time.perf_counter() - t0
    assert issued < 0.05 and total < 0.5  # 0.6 s if the two ran one after the other


def test_resolve_nested_and_observer_sees_the_wait(stream):
    class Obs:
        def __init__(self):
            self.log = []

        def posted(self, node, direction):
            return (node, direction)

        def running(self, token, fn):
            return fn()

        def waited(self, token, start, end):
            self.log.append((token, end >= start))

    obs = Obs()
    stream.observer = obs
    from k2.parallel.comm_stream import _submit_node

    class Node:
        name = "moe_dispatch"

    fut = _submit_node(stream, Node, "forward", lambda: (1, stream.submit(lambda: 2)))
    assert resolve((fut, [3]), stream) == ((1, 2), [3])
    assert obs.log == [((Node, "forward"), True)]  # reported once, by the first consumer
    resolve(fut, stream)
    assert len(obs.log) == 1


def test_an_error_on_the_stream_reaches_the_consumer_and_the_stream_goes_on(stream):
    def boom():
        raise RuntimeError("all-to-all failed")

    bad = stream.submit(boom)
    good = stream.submit(lambda: 7)
    with pytest.raises(RuntimeError, match="all-to-all failed"):
        resolve(bad)
    assert resolve(good) == 7
    stream.synchronize()
