"""k2-train's rank launcher (k2.launcher.training.fork_ranks), driven with tiny ``-c`` ranks: the
environment contract torchrun gives a rank, the first failed rank's status as the launch's, the other
ranks stopped, signals passed on. (The ranks here import nothing: :func:`launch` forks whatever this
launcher process has imported; the trainer's own launches are tested in tests/integration.)"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

from support import REPO

# (each rank writes a line with one os.write: print's two writes could interleave between ranks)
LAUNCH = "import sys; from k2.launcher.training.fork_ranks import launch; sys.exit(launch({n}, {target!r}{port}))"


def _python(src: str, **kw) -> subprocess.Popen:
    """``python -c src`` (a launcher process) in the repository, its stdout and stderr piped as text."""
    return subprocess.Popen(
        [sys.executable, "-c", src], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw
    )


def _launch(n: int, code: str, port: int | None = None, **kw) -> subprocess.Popen:
    target = ["-c", code, "arg1"]
    return _python(LAUNCH.format(n=n, target=target, port=f", port={port}" if port else ""), **kw)


def test_a_call_runs_in_every_rank_with_the_arguments_made_before_the_fork():
    """A :class:`Call` target (what k2-train hands its ranks: ``rank_main`` with its composed config and
    plan): each rank calls the function with the launcher's own argument object, under torchrun's
    environment, and the function's return value is the rank's exit status."""
    src = (
        "import os, sys; from k2.launcher.training.fork_ranks import Call, launch\n"
        "made = {'by': os.getpid()}\n"
        "def rank(a):\n"
        "    os.write(1, f\"{os.environ['RANK']} {a['by']} {os.getpid()}\\n\".encode())\n"
        "    return 0\n"
        "sys.exit(launch(2, Call(rank, (made,))) + launch(1, Call(int, ('3',)), rank_env=False))"
    )
    p = _python(src)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 3, err  # the second launch's one rank returned 3
    lines = sorted(x.split() for x in out.splitlines())
    assert [x[0] for x in lines] == ["0", "1"], out
    assert {x[1] for x in lines} == {str(p.pid)} and str(p.pid) not in {x[2] for x in lines}, out


def test_each_rank_gets_torchruns_environment_and_its_arguments():
    code = (
        "import json, os, sys; os.write(1, (json.dumps({k: os.environ[k] for k in ('RANK', 'LOCAL_RANK', "
        "'WORLD_SIZE', 'LOCAL_WORLD_SIZE', 'GROUP_RANK', 'MASTER_ADDR', 'MASTER_PORT')} | "
        "{'argv': sys.argv, 'ppid': os.getppid()}) + '\\n').encode())"
    )
    p = _launch(3, code, port=34567)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    recs = sorted((json.loads(x) for x in out.splitlines()), key=lambda r: r["RANK"])
    assert [r["RANK"] for r in recs] == ["0", "1", "2"] and [r["LOCAL_RANK"] for r in recs] == ["0", "1", "2"]
    assert {
        (r["WORLD_SIZE"], r["LOCAL_WORLD_SIZE"], r["GROUP_RANK"], r["MASTER_ADDR"], r["MASTER_PORT"]) for r in recs
    } == {("3", "3", "0", "127.0.0.1", "34567")}
    assert all(r["argv"] == ["-c", "arg1"] for r in recs)
    assert {r["ppid"] for r in recs} == {p.pid}  # forked by the launcher itself


def test_first_failed_rank_sets_the_status_and_stops_the_others():
    """Rank 1 exits 3 (k2-train's divergence status); rank 0 would sleep for 120 s: it gets SIGTERM, and
    the launch ends at once with 3, not with rank 0's signal."""
    code = "import os, sys, time; r = int(os.environ['RANK'])\nif r == 1: time.sleep(0.5); sys.exit(3)\ntime.sleep(120)"
    t0 = time.time()
    p = _launch(2, code)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 3, err
    assert time.time() - t0 < 30  # rank 0 was stopped, not waited for


def test_a_rank_killed_by_a_signal_gives_128_plus_the_signal():
    """...and one line names the rank and the signal (the rank itself could print nothing), so that the
    other ranks' SIGTERM line does not read as a preemption."""
    code = (
        "import os, signal, time; from k2.launcher.training.preemption import Preemption\n"
        "if os.environ['RANK'] == '0': time.sleep(1); os.kill(os.getpid(), signal.SIGKILL)\n"
        "signal.signal(signal.SIGTERM, lambda *a: (os.write(1, (Preemption().notice('SIGTERM', 'step 3') "
        "+ '\\n').encode()), os._exit(0)))\n"
        "time.sleep(120)"
    )
    p = _launch(2, code)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 128 + signal.SIGKILL
    lines = [x for x in err.splitlines() if x.startswith("k2-train: rank 0 was killed by signal 9 (SIGKILL)")]
    assert len(lines) == 1 and "the step in progress is not saved" in lines[0], err
    # rank 1's SIGTERM line names rank 0's failure instead of announcing a preemption's checkpoint
    assert out.splitlines() == [
        "k2-train: SIGTERM from the rank launcher during step 3: rank 0 was killed by "
        "signal 9 (SIGKILL), so every rank stops; the step in progress is not saved; "
        "the next start resumes from the run's last checkpoint, if it has one"
    ], out


def test_sigterm_to_the_launcher_reaches_every_rank():
    """SIGTERM sent to the launcher is passed on: each rank says so and exits 0, and so does the launch."""
    code = (
        "import os, signal, sys, time; r = int(os.environ['RANK'])\n"
        "from k2.launcher.training.preemption import Preemption\n"
        "signal.signal(signal.SIGTERM, lambda *a: (os.write(1, f'rank {r} got SIGTERM: '.encode() + "
        "Preemption().notice('SIGTERM', 'step 3').encode() + b'\\n'), os._exit(0)))\n"
        "os.write(1, f'rank {r} ready\\n'.encode()); time.sleep(120)"
    )
    p = _launch(2, code)
    ready = [p.stdout.readline(), p.stdout.readline()]
    assert sorted(ready) == ["rank 0 ready\n", "rank 1 ready\n"], ready
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    # a preemption: each rank announces the checkpoint (no rank failed)
    notice = (
        "k2-train: SIGTERM received during step 3; saving a checkpoint at the end of step 3, then exiting "
        "with 42 (requeue)"
    )
    assert sorted(out.splitlines()) == [f"rank 0 got SIGTERM: {notice}", f"rank 1 got SIGTERM: {notice}"]


def test_a_preimported_module_runs_as_main_without_runpy_warning():
    """``-m MODULE`` after the launcher imported MODULE (as a sweep's preimport does) runs it as ``__main__``
    with no RuntimeWarning from runpy (one per sweep point before)."""
    src = (
        "import sys, warnings; warnings.simplefilter('default'); import k2.parallel.hostlist; "
        "from k2.launcher.training.fork_ranks import launch; "
        "sys.exit(launch(1, ['-m', 'k2.parallel.hostlist', 'master-port', '7'], rank_env=False))"
    )
    p = subprocess.run(
        [sys.executable, "-W", "default", "-c", src], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 0 and p.stdout == "20007\n", p.stderr
    assert "RuntimeWarning" not in p.stderr, p.stderr


def test_no_cuda_driver_call_before_the_ranks_are_forked():
    """The launcher's imports (torch, megatron-core, the trainer) ask whether CUDA is there; on a GPU node
    ``cudaGetDeviceCount`` runs ``cuInit``, after which a forked rank's CUDA fails ("initialization
    error"). Seam: ``torch._C._cuda_getDeviceCount`` (what ``torch.cuda.is_available`` calls) counted
    until the fork: none may happen. The ranks themselves may call it (they own their CUDA)."""
    src = (
        "import os, sys, torch\n"
        "calls = []\n"
        "real = torch._C._cuda_getDeviceCount\n"
        "torch._C._cuda_getDeviceCount = lambda: (calls.append(1), real())[1]\n"
        "fork = os.fork\n"
        "def counted_fork():\n"
        "    os.write(2, f'driver calls before the fork: {len(calls)}\\n'.encode())\n"
        "    return fork()\n"
        "os.fork = counted_fork\n"
        "from k2.launcher.training import fork_ranks\n"
        "fork_ranks.preimport()\n"
        "assert torch._C._cuda_getDeviceCount is not real  # the counter is back in place for the ranks\n"
        "sys.exit(fork_ranks.launch(1, ['-c', 'import torch; torch.cuda.is_available()'], rank_env=False))\n"
    )
    p = subprocess.run([sys.executable, "-c", src], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "driver calls before the fork: 0\n" in p.stderr, p.stderr[-3000:]


def test_the_trainers_rank_0_serves_its_store_on_a_port_no_one_can_take_meanwhile():
    """For the trainer's ranks (a :class:`Call`) the launcher binds the store's port itself and rank 0
    inherits the listening socket (k2.parallel.rendezvous): while the ranks start, another process cannot
    bind ``MASTER_PORT`` (with a port chosen free and released it could, and the ranks then met a stranger's
    socket); the ranks meet through it; the other ranks close their copy; no rank's environment keeps the
    descriptor. A ``-c`` target (it may bind ``MASTER_PORT`` itself, as ``env://`` does) gets no socket."""
    src = (
        "import os, socket, sys, time\n"
        "from k2.launcher.training.fork_ranks import Call, launch\n"
        "def rank():\n"
        "    port = int(os.environ['MASTER_PORT'])\n"
        "    held = 'K2_MASTER_LISTEN_FD' in os.environ\n"
        "    try:\n"
        "        socket.create_server(('127.0.0.1', port)).close(); taken = 'no'\n"
        "    except OSError:\n"
        "        taken = 'yes'\n"
        "    time.sleep(0.5)  # (both ranks tried to bind before rank 0's store exists)\n"
        "    from k2.parallel.rendezvous import rendezvous\n"
        "    store = rendezvous(int(os.environ['RANK']), 2, 30, 30)\n"
        "    store.set('r' + os.environ['RANK'], 'x'); store.wait(['r0', 'r1'])\n"
        "    left = 'K2_MASTER_LISTEN_FD' in os.environ\n"
        "    os.write(1, f\"{os.environ['RANK']} held={held} taken={taken} left={left}\\n\".encode())\n"
        "    return 0\n"
        "code = launch(2, Call(rank, ()))\n"
        'probe = \'import os; os.write(1, ("c %s" % ("K2_MASTER_LISTEN_FD" in os.environ)).encode() + bytes([10]))\'\n'
        "code += launch(2, ['-c', probe])\n"
        "sys.exit(code)"
    )
    p = _python(src)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err[-3000:]
    assert sorted(out.splitlines()) == [
        "0 held=True taken=yes left=False",
        "1 held=True taken=yes left=False",
        "c False",
        "c False",
    ], out + err[-2000:]
