"""Checkpoints, exact resume and preemption, on the production path (torchrun, gloo, megatron's
dist-checkpointing and distributed optimizer).

The reference is always an uninterrupted run with the same settings; "bitwise" means the per-step loss
and grad norm floats and the final parameters are equal, not close. Signals to whole ``k2-train``
processes (its parent, wandb offline, two trainers on one run dir): tests/integration/test_preemption_cli.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from support.distributed import run_trainer

# MuonClip with a tau small enough that QK-Clip fires: the resumed state includes Muon's momentum in
# megatron's byte-range ZeRO-1 shards (EP and DP) and the Adam moments of the other parameters
# microbatches of 4 sequences: 2 per DP rank (interleaved 1F1B still runs), half the passes of the default
# (checkpoint, resume and signal behaviour do not depend on the microbatch count)
CPU4 = [
    "parallel=cpu4",
    "optim=muonclip",
    "optim.qk_clip_tau=0.1",
    "train.eval_interval=2",
    "train.eval_iters=1",
    "train.micro_batch_size=4",
]
# synchronous saves (checkpoint.async_save is on by default): the reference the background saves are
# compared with, and the faults of a save in progress on the loop's own thread
SYNC = ["checkpoint.async_save=false"]


def _latest(run_dir: Path) -> str:
    return (run_dir / "checkpoints" / "latest").read_text().strip()


def _state(run_dir: Path, name: str | None = None) -> dict:
    return json.loads((run_dir / "checkpoints" / (name or _latest(run_dir)) / "k2_state.json").read_text())


def _by_step(recs: list[dict]) -> dict:
    return {r["step"]: r for r in recs}


def _model_tensors(ckpt: Path, tmp_path: Path) -> dict:
    """All model tensors of a torch_dist checkpoint, read in this process (no process group) with
    torch.distributed.checkpoint's converter: an independent reader of what megatron wrote."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / f"{ckpt.parent.parent.name}-{ckpt.name}.pt"
    dcp_to_torch_save(str(ckpt), str(out))
    sd = torch.load(out, weights_only=False)
    # the distributed optimizer's flat buffers hold uninitialised padding between parameters, so
    # only the model tensors are compared bitwise; the optimizer state shows in every later step
    return {k: v for k, v in sd.items() if torch.is_tensor(v) and "optimizer" not in k and "rng" not in k}


def _assert_same_steps(got: list[dict], ref: list[dict], steps) -> None:
    g, r = _by_step(got), _by_step(ref)
    for s in steps:
        assert (g[s]["loss"], g[s]["grad_norm"]) == (r[s]["loss"], r[s]["grad_norm"]), (s, g[s], r[s])
        assert g[s]["consumed_tokens"] == r[s]["consumed_tokens"] and g[s]["lr"] == r[s]["lr"]
        assert g[s].get("val_loss") == r[s].get("val_loss"), s


@pytest.fixture(scope="module")
def cpu4_reference(tmp_path_factory, stdlib_corpus):
    """cpu4 (PP2 VPP2 EP2 DP2, MuonClip), 7 steps straight, a checkpoint at steps 1, 2, 4 and 7 (the end;
    all kept): the steps and checkpoints the tests below compare with (7, not 6: a run's last step is
    evaluated, so a resumed run that ends at an odd step compares its validation loss with this one's)."""
    run_dir = tmp_path_factory.mktemp("ref") / "run"
    recs = run_trainer(
        [*CPU4, *SYNC, "train.iters=7", "checkpoint.save_steps=[1,2,4]", "checkpoint.keep_last=8"], 4, run_dir
    )
    assert [r["step"] for r in recs] == list(range(1, 8))
    assert any(r["qk_clipped_heads"] for r in recs)  # QK-Clip fired, so its effect is resumed too
    return run_dir, recs


ASYNC = ["checkpoint.async_save=true", "train.save_interval=2", "checkpoint.keep_last=8"]


@pytest.fixture(scope="module")
def async_run_resumed_twice(cpu4_reference, tmp_path_factory):
    """A run with checkpoint.async_save=true and optim.offload_fraction=1 (optimizer states in host
    memory, updated in place by every step) in shared memory (``K2_SHARED_OFFLOAD``): 4 steps, saves at
    steps 1, 2 and 4 (the end), the writer of step 2's checkpoint on rank 0 held until step 4 has started;
    then its step-4 checkpoint (the process's third save: megatron's cached save plans) resumed to step 6
    (a run that stops with its own end-of-run checkpoint) and that run resumed again to step 7 (its own
    latest). {"async": (run dir, records, stdout), "resumed": (run dir, records of the first resume,
    records after the second)}."""
    root = tmp_path_factory.mktemp("async")
    run_dir, out = root / "run", root / "stdout.txt"
    offload = ["optim.offload_fraction=1"]
    recs = run_trainer(
        [*CPU4, "train.iters=4", *ASYNC, "checkpoint.save_steps=[1]", *offload],
        4,
        run_dir,
        script="fault_train.py",
        env={"K2_FAULT": "none:0:0", "K2_HOLD_WRITER": "2:0", "K2_SHARED_OFFLOAD": "1", "K2_TEST_OUT": str(root)},
        stdout_to=out,
    )
    resumed = root / "resumed"
    once = run_trainer(
        [*CPU4, "train.iters=6", *offload, f"resume.from={run_dir / 'checkpoints' / 'iter_0000004'}"], 4, resumed
    )
    latest_once = _latest(resumed)
    twice = run_trainer([*CPU4, "train.iters=7", *offload], 4, resumed)  # resumes from its own iter 6
    return {"async": (run_dir, recs, out.read_text()), "resumed": (resumed, once, latest_once, twice)}


@pytest.mark.slow
def test_bitwise_resume_cpu4_once_and_twice(cpu4_reference, async_run_resumed_twice, tmp_path):
    """The asynchronous run's step-4 checkpoint (tensors equal to the reference's:
    test_async_saves_equal_sync_ones_with_offloaded_states_updated_while_written) resumed to 6 (a run that
    then stops with its own end-of-run checkpoint), resumed again to 7, equals 7 straight steps: every
    loss, grad norm, val loss, LR, and the final parameters; the data position after the second resume is
    7 steps' worth."""
    ref_dir, ref = cpu4_reference
    run, once, latest_once, twice = async_run_resumed_twice["resumed"]
    assert [r["step"] for r in once] == [5, 6] and latest_once == "iter_0000006"
    _assert_same_steps(once, ref, range(5, 7))
    assert [r["step"] for r in twice] == [5, 6, 7]
    _assert_same_steps(twice, ref, range(5, 8))
    st = _state(run)
    tokens_per_step = ref[0]["consumed_tokens"]
    assert st["step"] == 7 and st["consumed_tokens"] == 7 * tokens_per_step
    assert st["consumed_samples_in_context"] == 7 * ref[0]["global_batch_size"]

    want = _model_tensors(ref_dir / "checkpoints" / "iter_0000007", tmp_path)
    assert len(want) > 50
    got = _model_tensors(run / "checkpoints" / "iter_0000007", tmp_path)
    assert got.keys() == want.keys()
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    assert not bad, bad[:5]


@pytest.mark.slow
def test_forced_resume_with_a_changed_lr_schedule_and_weight_decay(cpu4_reference, tmp_path):
    """resume.force=true from the reference's step-4 checkpoint with the warmup's peak LR halved and the
    weight decay changed: the run resumes (megatron's distributed optimizer state loads), step 5's loss
    (computed before its update, on the restored parameters) equals the reference's bitwise, the LR of
    steps 5-6 follows the new warmup (linear from 0 to 1.5e-3 over 20 steps), and step 6's loss differs."""
    ref_dir, ref = cpu4_reference
    run = tmp_path / "run"
    recs = run_trainer(
        [
            *CPU4,
            "train.iters=6",
            f"resume.from={ref_dir / 'checkpoints' / 'iter_0000004'}",
            "schedule.phases.0.lr_end=1.5e-3",
            "schedule.weight_decay=0.05",
            "resume.force=true",
        ],
        4,
        run,
    )
    r = _by_step(ref)
    assert [x["step"] for x in recs] == [5, 6] and _latest(run) == "iter_0000006"
    assert recs[0]["loss"] == r[5]["loss"]
    for x in recs:
        assert x["lr"] == pytest.approx(1.5e-3 * x["step"] / 20, rel=1e-12)
        assert x["consumed_tokens"] == r[x["step"]]["consumed_tokens"]
    assert recs[1]["loss"] != r[6]["loss"]


@pytest.mark.slow
def test_sigterm_during_validation_saves_after_it(cpu4_reference, tmp_path):
    """The reference's step-1 checkpoint resumed; rank 1 gets SIGTERM during the validation that follows
    step 2: the validation finishes, then step 2 is saved (no periodic save is due) and the run stops."""
    ref_dir, ref = cpu4_reference
    run_dir = tmp_path / "run"
    recs = run_trainer(
        [*CPU4, "train.iters=4", f"resume.from={ref_dir / 'checkpoints' / 'iter_0000001'}"],
        4,
        run_dir,
        script="fault_train.py",
        env={"K2_FAULT": "sigterm_eval:1:1"},  # (its process's first step: step 2)
        expect_failure=True,
    )
    assert [r["step"] for r in recs] == [2] and "val_loss" in recs[-1]
    assert _latest(run_dir) == "iter_0000002" and _state(run_dir)["reason"] == "preempted: signal"
    _assert_same_steps(recs, ref, [2])  # validation finished before the save
    # (resuming from a preemption save: test_killed_before_first_save_then_sigterm_mid_step_resumes_bitwise)


@pytest.mark.slow
def test_save_killed_half_way_leaves_previous_latest(cpu4_reference, tmp_path):
    """Rank 2 dies after writing its shards of step 2 and before the checkpoint is made visible: latest
    stays at step 1, the partial directory is never loaded (and is removed), the resume matches."""
    _, ref = cpu4_reference
    run_dir = tmp_path / "run"
    args = [*CPU4, *SYNC, "train.iters=4", "train.save_interval=1"]
    run_trainer(args, 4, run_dir, script="fault_train.py", env={"K2_FAULT": "crash_save:2:2"}, expect_failure=True)
    ckpts = run_dir / "checkpoints"
    assert _latest(run_dir) == "iter_0000001"
    assert (ckpts / "iter_0000002.partial").is_dir() and not (ckpts / "iter_0000002").exists()
    recs = run_trainer(args, 4, run_dir)
    assert not (ckpts / "iter_0000002.partial").exists()
    # step 2 was logged before the crash and is run again: metrics.jsonl keeps the re-run one
    assert [r["step"] for r in recs] == list(range(1, 5))
    assert [r.get("replayed", False) for r in recs] == [False, True, False, False]
    replayed = [json.loads(x) for x in (run_dir / "metrics.replayed.jsonl").read_text().splitlines()]
    assert [r["step"] for r in replayed] == [2]
    _assert_same_steps(recs, ref, range(1, 5))
    # retention: keep_last=2 (default) plus the one latest names
    assert sorted(p.name for p in ckpts.iterdir() if p.is_dir()) == ["iter_0000003", "iter_0000004"]


GOODPUT_FIELDS = (
    "time_productive_s",
    "time_startup_s",
    "time_checkpoint_s",
    "time_replayed_s",
    "time_eval_s",
    "time_lost_s",
    "time_other_s",
)


@pytest.mark.slow
def test_killed_before_first_save_then_sigterm_mid_step_resumes_bitwise(cpu4_reference, tmp_path):
    """One run dir through two faults and three starts, against the uninterrupted run:

    * kill -9 of rank 0 in step 2, before the first checkpoint (step 2's): the same command again starts
      the run afresh (not refused), its records of the killed start set aside;
    * in that second start (wandb offline, its default, on rank 0) rank 3 alone gets SIGTERM during step
      1: all ranks finish step 1, save it, exit with the requeue code;
    * the third start resumes from that checkpoint (steps 2-4); every step equals the uninterrupted run
      bitwise; the killed start's step time is counted (replayed + lost) in the goodput fields, which add
      up to the total and continue over the checkpoints and starts; the summary prints the split.

    (One run dir for both faults: every start of a cpu4 run costs each rank its set-up.)"""
    ref_dir, ref = cpu4_reference
    run_dir = tmp_path / "run"
    args = [*CPU4, "train.iters=4", "train.save_interval=2", "checkpoint.keep_last=8"]
    run_trainer(args, 4, run_dir, script="fault_train.py", env={"K2_FAULT": "sigkill_train:2:0"}, expect_failure=True)
    killed = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in killed] == [0, 1] and not (run_dir / "checkpoints" / "latest").exists()
    args = [*args, "run.wandb.mode=offline"]
    out = tmp_path / "stdout.txt"
    recs = run_trainer(
        args,
        4,
        run_dir,
        script="fault_train.py",
        env={"K2_FAULT": "sigterm_train:1:3"},
        expect_failure=True,
        stdout_to=out,
    )
    text = out.read_text()
    assert "killed before its first checkpoint (steps up to 1 logged): starting it afresh" in text, text[-3000:]
    assert [r["step"] for r in recs] == [1]
    assert _latest(run_dir) == "iter_0000001" and _state(run_dir)["reason"] == "preempted: signal"
    assert (run_dir / "requeue").read_text().strip() == "1"
    recs = run_trainer(args, 4, run_dir, stdout_to=out)
    text = out.read_text()
    assert not (run_dir / "requeue").exists()
    _assert_same_steps(recs, ref, range(1, 5))
    assert [r.get("replayed", False) for r in recs] == [True] + [False] * 3
    replayed = [json.loads(x) for x in (run_dir / "metrics.replayed.jsonl").read_text().splitlines()]
    assert [r["step"] for r in replayed] == [0, 1]
    first, last = recs[0], recs[-1]
    # the killed start's step 1 is replayed time, its start-up and evaluation lost time
    assert first["time_replayed_s"] == pytest.approx(killed[1]["step_time_s"], rel=1e-9)
    assert first["time_lost_s"] == pytest.approx(killed[1]["time_total_s"] - killed[1]["step_time_s"], rel=1e-9)
    for r in recs:
        assert sum(r[k] for k in GOODPUT_FIELDS) == pytest.approx(r["time_total_s"], rel=1e-9)
        assert r["goodput"] == pytest.approx(r["time_productive_s"] / r["time_total_s"], rel=1e-9)
    assert last["time_productive_s"] >= sum(r["step_time_s"] for r in recs) * (1 - 1e-9)
    assert last["time_checkpoint_s"] > 0 and last["time_eval_s"] > 0 and last["time_startup_s"] > 0
    assert _state(run_dir)["goodput"]["starts"] == 3 and 0 < last["goodput"] < 1
    summary = re.search(r"goodput (0\.\d+): productive ([\d.]+) s of ([\d.]+) s over 3 starts \(start-up", text)
    # the summary adds what came after the last record (the end-of-run save, the shutdown): its productive
    # time is the last record's, its total at least the last record's, and its goodput their ratio (a fixed
    # allowance on the goodput failed on a slow machine whose end-of-run save took 7.9 s)
    assert summary, text[-2000:]
    goodput, productive, total = (float(x) for x in summary.groups())
    assert productive == pytest.approx(last["time_productive_s"], abs=0.06), text[-2000:]
    assert total >= last["time_total_s"] - 0.06, text[-2000:]
    assert goodput == pytest.approx(productive / total, abs=0.01), text[-2000:]  # (printed to 0.1 s)


def _all_tensors(ckpt: Path, tmp_path: Path) -> dict:
    """Every tensor of a torch_dist checkpoint (model, optimizer incl. its zeroed padding; the RNG
    state objects are left out), read without a process group."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / f"{ckpt.parent.parent.name}-{ckpt.name}-all.pt"
    dcp_to_torch_save(str(ckpt), str(out))
    sd = torch.load(out, weights_only=False)
    return {k: v for k, v in sd.items() if torch.is_tensor(v) and "rng" not in k}


@pytest.mark.slow
def test_async_saves_equal_sync_ones_with_offloaded_states_updated_while_written(
    cpu4_reference, async_run_resumed_twice, tmp_path
):
    """checkpoint.async_save=true with optim.offload_fraction=1 (optimizer states in host memory, updated
    in place by every step) in shared memory (``K2_SHARED_OFFLOAD``: what pinned buffers are on a GPU, pages
    a forked writer shares rather than copies on write): the writer of step 2's checkpoint on rank 0 is
    held until step 4 has started, so steps 3 and 4 update those states while it is written. The losses
    equal the synchronous reference's bitwise and every checkpoint's tensors (model and optimizer) equal
    the reference's: the writer got step 2's state (one that read the live buffers would have written step
    3's or 4's optimizer states).
    Resuming from the asynchronous step-4 checkpoint equals the uninterrupted reference: the third save
    of a process reuses megatron's cached save plans (``staging.save_strategy``), so this also checks
    that a save planned from the cache restores its own step's state."""
    ref_dir, ref = cpu4_reference
    run_dir, recs, text = async_run_resumed_twice["async"]
    _assert_same_steps(recs, ref, range(1, 5))
    assert "step 2: checkpoint staged in" in text and "written in the background" in text, text[-3000:]
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.is_dir())
    assert names == ["iter_0000001", "iter_0000002", "iter_0000004"], names
    for name in names:
        want = _all_tensors(ref_dir / "checkpoints" / name, tmp_path)
        got = _all_tensors(run_dir / "checkpoints" / name, tmp_path)
        assert got.keys() == want.keys() and any("optimizer" in k for k in want)
        bad = [k for k in want if not torch.equal(got[k], want[k])]
        assert not bad, (name, bad[:5])
    _, resumed, _, _ = async_run_resumed_twice["resumed"]  # (its first start: from step 4 to 6)
    _assert_same_steps(resumed, ref, range(5, 7))


@pytest.mark.slow
def test_faults_during_a_background_write(cpu4_reference, tmp_path):
    """The writer of step 2's checkpoint on rank 0 is held until step 4 starts, and rank 0 gets a fault
    then; two faults in one run dir. kill -9: latest stays step 1's checkpoint, step 2's is only
    ``.partial`` (its writer dies with the rank). The same command resumes from step 1, its writer of step
    2's checkpoint held again until step 4, and rank 0 gets SIGTERM then: step 2's checkpoint is
    committed, then step 4's, the requeue marker says 4 and nothing is left ``.partial``. The same
    command again resumes and equals the uninterrupted run bitwise.

    (One run dir for both faults: every start of a cpu4 run costs each rank its set-up.)"""
    _, ref = cpu4_reference
    run_dir = tmp_path / "run"
    ckpts = run_dir / "checkpoints"
    args = [*CPU4, "train.iters=6", *ASYNC, "checkpoint.save_steps=[1]"]
    run_trainer(
        args,
        4,
        run_dir,
        script="fault_train.py",
        expect_failure=True,
        env={"K2_FAULT": "sigkill_train:4:0", "K2_HOLD_WRITER": "2:0", "K2_TEST_OUT": str(tmp_path)},
    )
    assert _latest(run_dir) == "iter_0000001"
    assert (ckpts / "iter_0000002.partial").is_dir() and not (ckpts / "iter_0000002").exists()
    assert not any((ckpts / "iter_0000002.partial").glob("k2_*"))  # never committed
    # (fault_train.py counts the steps of its own process: resumed from step 1, its step 1 is step 2)
    run_trainer(
        args,
        4,
        run_dir,
        script="fault_train.py",
        expect_failure=True,
        env={"K2_FAULT": "sigterm_train:3:0", "K2_HOLD_WRITER": "1:0", "K2_TEST_OUT": str(tmp_path)},
    )
    assert _latest(run_dir) == "iter_0000004" and (ckpts / "iter_0000002").is_dir()
    assert _state(run_dir)["step"] == 4  # (the periodic save of step 4 serves the preemption)
    assert (run_dir / "requeue").read_text().strip() == "4"
    assert not any(p.name.endswith(".partial") for p in ckpts.iterdir())
    recs = run_trainer(args, 4, run_dir)
    _assert_same_steps(recs, ref, range(1, 7))
    assert not any(p.name.endswith(".partial") for p in ckpts.iterdir())
    # goodput: the killed start's steps after step 1 (2..3) were computed twice; the SIGTERM's save
    # left nothing to compute again
    again = [json.loads(x) for x in (run_dir / "metrics.replayed.jsonl").read_text().splitlines()]
    assert [r["step"] for r in again] == [2, 3]
    assert recs[-1]["time_replayed_s"] == pytest.approx(sum(r["step_time_s"] for r in again), rel=1e-9)
    assert recs[-1]["time_lost_s"] >= 0


@pytest.mark.slow
@pytest.mark.parametrize("async_save", [False, True])
def test_a_save_failing_on_one_rank_is_one_line_naming_directory_and_rank(tmp_path, async_save):
    """The file system turns read-only under rank 1 during the save of step 2 (after its shards; with
    checkpoint.async_save in its background writer): every rank stops, one error line names the
    checkpoint directory and rank 1, no traceback, nothing committed."""
    run_dir = tmp_path / "run"
    err = tmp_path / "stderr.txt"
    recs = run_trainer(
        [
            *CPU4,
            "train.iters=4",
            "train.save_interval=2",
            "train.eval_interval=0",
            f"checkpoint.async_save={str(async_save).lower()}",
        ],
        4,
        run_dir,
        script="fault_train.py",
        env={"K2_FAULT": "erofs_save:2:1"},
        expect_failure=True,
        stderr_to=err,
    )
    lines = [x for x in err.read_text().splitlines() if x.startswith("k2-train: error:")]
    partial = run_dir / "checkpoints" / "iter_0000002.partial"
    verb = "writing" if async_save else "saving"
    assert lines == [
        f"k2-train: error: {verb} checkpoint step 2 into {partial} failed on rank 1: OSError: "
        f"[Errno 30] Read-only file system: '{partial}'"
    ], err.read_text()[-3000:]
    assert "Traceback" not in err.read_text(), err.read_text()[-3000:]
    steps = [r["step"] for r in recs]  # (a background save fails at its commit, a step or two later)
    assert (steps[:2] if async_save else steps) == [1, 2], steps
    assert not (run_dir / "checkpoints" / "latest").exists()


# MuonClip (Distributed Muon on the byte-range ZeRO-1 shards, whose momentum megatron reshards, and
# AdamW's moments for the embedding, head and norms), Newton-Schulz in fp32 so that the DP reduction
# order moves the losses by fp32 rounding only (tests/integration/test_muonclip_parallel.py)
DP_RESUME = ["optim=muonclip", "optim.muon_fp32_matmul_prec=highest", "train.eval_interval=0"]


@pytest.mark.slow
def test_resume_with_another_dp_size(tmp_path, stdlib_corpus):
    """MuonClip, DP=2 -> DP=1 and DP=1 -> DP=2 (megatron reshards the distributed optimizers), PP1: the
    step-2 checkpoint of 6 steps at DP=2 resumed at DP=1 to step 4, and that run's step-4 checkpoint
    resumed at DP=2 to step 6, give the same data order (tokens, LR) and the same losses within fp32
    reduction-order tolerance as the 6 steps at DP=2 (two steps after each resume: the second one's loss
    shows the resharded optimizer state)."""
    ref = _by_step(
        run_trainer(
            [*DP_RESUME, "train.iters=6", "checkpoint.save_steps=[2]", "checkpoint.save_at_end=false"],
            2,
            tmp_path / "dp2",
        )
    )
    start = tmp_path / "dp2" / "checkpoints" / "iter_0000002"
    for dp, steps in ((1, [3, 4]), (2, [5, 6])):  # each from the checkpoint the run before it saved last
        run_dir = tmp_path / f"resumed_at_dp{dp}"
        recs = run_trainer([*DP_RESUME, f"train.iters={steps[-1]}", f"resume.from={start}"], dp, run_dir)
        assert [r["step"] for r in recs] == steps
        assert _state(run_dir)["layout"]["dp"] == dp
        for got in recs:
            s = got["step"]
            assert got["consumed_tokens"] == ref[s]["consumed_tokens"] and got["lr"] == ref[s]["lr"]
            assert got["loss"] == pytest.approx(ref[s]["loss"], rel=2e-6), s
        start = run_dir / "checkpoints" / _latest(run_dir)
