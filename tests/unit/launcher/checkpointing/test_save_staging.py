"""What a save costs the training loop: the background writer copies views after the fork
(``_copy_views``), since the rank no longer does, and megatron's sharding-integrity check runs once per
structure (``needs_validation``), with the garbage collector paused while the save is planned."""

import io

import pytest
import torch

from k2.launcher.checkpointing.background import _copy_views, _snapshot_writer_class


def test_views_are_copied_whole_tensors_are_not():
    flat = torch.arange(100_000, dtype=torch.float32)
    view, whole = flat[4:8], torch.ones(3)
    blob = io.BytesIO(b"x")
    buckets = [("/d/__0_0.distcp", "__0_0.distcp", ([("b", blob)], [("v", view), ("w", whole)]))]
    ((path, name, (bytes_data, tensors)),) = _copy_views(buckets)
    assert (path, name, bytes_data) == buckets[0][:2] + ([("b", blob)],)
    (_, v), (_, w) = tensors
    assert w is whole  # no copy of a tensor that owns its storage
    assert torch.equal(v, view) and v.untyped_storage().size() == 4 * 4  # a copy of only its 4 elements
    # torch.save is what DCP's _write_item does: the view itself would write the whole 400 KB buffer
    assert len(_saved(v)) < 10_000 < 400_000 < len(_saved(view))


def _saved(t):
    buf = io.BytesIO()
    torch.save(t, buf)
    return buf.getvalue()


def test_the_snapshot_writer_does_not_clone_while_planning():
    writer_cls = _snapshot_writer_class()
    flat = torch.arange(8.0)
    seen = []

    class Planner:
        def resolve_data(self, item):
            return flat[2:6]

    from torch.distributed.checkpoint.filesystem import _StoragePrefix
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

    item = WriteItem(index=MetadataIndex("t"), type=WriteItemType.TENSOR)
    for cls in (writer_cls, writer_cls.__mro__[1]):  # ours, then megatron's
        w = cls("/nonexistent", thread_count=1)
        w.prepare_write_data(SavePlan([item], storage_data=_StoragePrefix("__0_")), Planner())
        ((_, _, (_, [(_, t)])),) = w.write_buckets
        seen.append(t.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr())
    assert seen == [True, False]  # ours shares the rank's memory (the fork is the copy); megatron's copies


def _touch_shards(rank, write_buckets, results_queue):  # megatron's write_fn, reduced to its files
    for path, _, _ in write_buckets:
        open(path, "wb").close()


def test_the_writer_copies_views_after_a_fork_from_a_rank_that_used_its_thread_pool(tmp_path):
    """The rank has run parallel torch ops (its OpenMP pool is up; a user's default threads) when the
    writer forks: the writer's copies of views must not wait for a pool that did not survive the fork."""
    import multiprocessing as mp

    from k2.launcher.checkpointing.background import PipeChannel, _background_writer

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        flat = torch.ones(4_000_000)
        assert float((flat * 2).sum()) == 8_000_000  # the pool is in use
        buckets = [(str(tmp_path / "__0_0.distcp"), "__0_0.distcp", ([], [("v", flat[10:3_000_000])]))]
        report = PipeChannel()
        proc = mp.get_context("fork").Process(
            target=_background_writer, args=(_touch_shards, report, tmp_path, 0, buckets, None)
        )
        proc.start()
        proc.join(timeout=60)
        alive = proc.is_alive()
        if alive:
            proc.kill()
        assert not alive and proc.exitcode == 0
        assert set(report.get_nowait()) == {"__0_0.distcp"}
        report.close()
    finally:
        torch.set_num_threads(threads)


def test_sharding_is_validated_on_the_first_save_and_when_the_structure_changes():
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from k2.launcher.checkpointing import staging

    def sd(rows):
        return {
            "w": ShardedTensor.from_rank_offsets("layer.w", torch.zeros(rows, 4)),
            "b": ShardedTensor.from_rank_offsets("layer.b", torch.zeros(4)),
        }

    staging.VALIDATED_STRUCTURE.clear()  # a fresh process
    assert [staging.needs_validation(sd(r)) for r in (3, 3, 3, 5, 5, 3)] == [True, False, False, True, False, True]


def test_garbage_collection_is_paused_while_a_save_is_planned_and_restored_after():
    import gc

    from k2.launcher.gc_pause import gc_paused

    assert gc.isenabled()
    with pytest.raises(RuntimeError):
        with gc_paused():
            assert not gc.isenabled()
            raise RuntimeError("a failed plan")
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # a caller's own pause is left alone
    finally:
        gc.enable()


def test_reused_save_plans_write_each_saves_own_tensors_and_are_dropped_when_the_structure_changes(
    megatron_world1, tmp_path
):
    """Four saves through megatron's real path with the process's cached strategy (save_strategy): the
    values change between saves, the structure of the first three does not, so the third save reuses
    the plans (megatron's ``validated_cache_reuse``); each checkpoint loads back to the values it was
    saved with (a stale plan or metadata would load the first save's, or fail). The fourth save has a
    different shape and dtype: a fresh strategy, whose checkpoint loads back too."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from k2.launcher.checkpointing import staging

    def sd(w, b):
        return {"w": ShardedTensor.from_rank_offsets("layer.w", w), "b": ShardedTensor.from_rank_offsets("layer.b", b)}

    staging.VALIDATED_STRUCTURE.clear()
    staging._STRATEGY.clear()
    saved, strategies = [], []
    for i, (rows, dtype) in enumerate([(3, torch.float32)] * 3 + [(5, torch.bfloat16)]):
        w, b = torch.full((rows, 4), float(i), dtype=dtype), torch.arange(4.0) + 10 * i
        state = sd(w, b)
        changed = staging.needs_validation(state)
        strategy = staging.save_strategy(changed)
        strategies.append((changed, strategy, strategy.validated_cache_reuse))
        (tmp_path / str(i)).mkdir()
        dist_checkpointing.save(
            state, str(tmp_path / str(i)), sharded_strategy=strategy, validate_access_integrity=changed
        )
        saved.append((w.clone(), b.clone()))
    assert [c for c, _, _ in strategies] == [True, False, False, True]
    assert strategies[0][1] is strategies[1][1] is strategies[2][1] is not strategies[3][1]
    assert strategies[2][2] and not strategies[3][2]  # the third save reused the plans; the fourth did not
    for i, (w, b) in enumerate(saved):
        got = dist_checkpointing.load(sd(torch.empty_like(w), torch.empty_like(b)), str(tmp_path / str(i)))
        assert torch.equal(got["w"], w) and torch.equal(got["b"], b), i


def _write_after(go, buckets, out):  # a forked writer that writes once the rank has trained on
    go.wait(60)
    torch.save({item: t for _, _, (_, tensors) in buckets for item, t in tensors}, out)


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded")  # (the fork is the subject)
def test_the_writer_gets_the_step_boundarys_bytes_of_host_memory_a_fork_shares(tmp_path):
    """Offloaded optimizer states live in pinned host memory on a GPU, which a fork shares instead of
    copying on write, and the next step overwrites them in place while the writer runs. Seam: the same
    buffers in shared memory (``share_memory_``), which a fork shares as the driver's pinned mapping is.
    What the writer writes is the staging-time bytes: for a whole buffer, a view of one, and (left to the
    fork) a pageable tensor."""
    import multiprocessing as mp

    from k2.parallel import cpu_backend

    cpu_backend.enable()  # (megatron's staging synchronises CUDA)
    shared = torch.arange(16.0).share_memory_()
    view_base = torch.arange(100.0, 132.0).share_memory_()
    pageable = torch.arange(200.0, 204.0)
    want = {"whole": shared.clone(), "view": view_base[8:12].clone(), "pageable": pageable.clone()}
    buckets = [
        (
            str(tmp_path / "__0_0.distcp"),
            "__0_0.distcp",
            ([], [("whole", shared), ("view", view_base[8:12]), ("pageable", pageable)]),
        )
    ]
    staged = _snapshot_writer_class().preload_tensors(buckets)  # in the rank, before the fork
    ((_, _, (_, tensors)),) = staged
    assert tensors[2][1] is pageable  # the fork is its snapshot: no copy
    ctx = mp.get_context("fork")
    go = ctx.Event()
    proc = ctx.Process(target=_write_after, args=(go, staged, tmp_path / "written.pt"))
    proc.start()
    shared.add_(1000.0)  # the next optimizer step, in place, while the writer waits
    view_base.mul_(-1.0)
    pageable.add_(1000.0)
    go.set()
    proc.join(timeout=60)
    assert proc.exitcode == 0
    got = torch.load(tmp_path / "written.pt")
    assert {k: torch.equal(got[k], want[k]) for k in want} == {k: True for k in want}, got
