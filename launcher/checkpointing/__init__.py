"""Checkpoints and resume: megatron-core dist-checkpointing (``torch_dist``) plus the run's own state.

Layout of ``<run.dir>/checkpoints/``::

    iter_0000004/            a complete checkpoint (only complete ones carry this name)
        *.distcp, .metadata  megatron dist-checkpointing (torch_dist): model chunks, optimizer
        common.pt, metadata.json
        k2_state.json        step, tokens, schedule/data position, layout, wandb run id (rank 0)
        config.yaml          the resolved config of the run that wrote it
        k2_manifest.json     every other file with its size and xxh3-64 checksum (written last)
    iter_0000008.partial/    a save in progress (or killed mid-way): never loaded, removed on start
    latest                   text: the directory name of the newest complete checkpoint

Visibility protocol (a killed job must never leave a checkpoint that looks complete): every
rank writes into ``iter_N.partial``; after megatron's save returns on all ranks (its own barriers) and
one more barrier, every rank hashes the shards it wrote and rank 0 gathers the entries, writes
``k2_state.json`` and ``config.yaml``, then the manifest (atomically), renames the directory to
``iter_N`` (atomic on one file system) and only then replaces ``latest`` (write-to-temp + rename). A
crash at any point before the rename of ``latest`` leaves the previous checkpoint as latest. Resume
checks the checkpoint against its manifest (``checkpoint.verify``; :mod:`.manifest`): sizes before any
process group, checksums in the ranks, in parallel, before the model is built.

What is in a checkpoint: model parameters of every chunk (megatron sharded state dict: global layer numbers,
experts by global index), the optimizer (megatron's ``DistributedOptimizer`` in the ``dp_reshardable`` format:
fp32 master weights, Adam moments, Muon momentum; megatron's layer-wise optimizer with
``optim.muon_zero1=layer_wise``), the LR/schedule position (``k2.schedules.lr.TokenLRScheduler`` state: tokens
consumed, steps), the data position (the step: global batch ``j`` of a context stretch reads samples ``[jG,
(j+1)G)``, see ``k2.launcher.training.phase_data.PhaseData``), the RNG state of every rank (torch CPU/CUDA
generators, Python, NumPy, megatron's model-parallel RNG-tracker streams) and the wandb run id.

Resharding: megatron's dist-checkpointing reshards model tensors for any layout; its optimizer formats that work
here reshard over DP only (``dp_reshardable``; the layer-wise Muon optimizer: the same DP). So a resume may
change the DP size (AdamW, MuonClip's byte-range Distributed Muon) but not PP, VPP or EP;
:func:`k2.launcher.checkpointing.resume.check_resume_compatible` says so before any process starts.

Who saves what, and when: :class:`~k2.launcher.checkpointing.manager.CheckpointManager` (``manager``), over
the parts of a run registered once as ``Stateful`` (``state_dict()`` / ``load_state_dict()``) plus the model
and optimizer tensors; the training loop calls it at every step boundary.

Modules: ``manager`` (the checkpoint manager: when to save, the synchronous strategy, restore), ``reasons``
(why a checkpoint was written), ``manifest`` (what a checkpoint holds, its verification), ``paths`` (names,
completeness), ``resume`` (which checkpoint, and whether it may serve this run), ``rng`` (per-rank RNG state),
``store`` (save, retention, the sharded state dict), ``loading`` (load, verification on resume),
``background`` (saves written by a forked writer while training goes on: ``checkpoint.async_save``),
``unpickle`` (the allow-list every pickled part of a checkpoint is read through), ``load_progress`` (a load's
progress for the hang watchdog). The run state in ``k2_state.json`` is defined by
:class:`k2.launcher.training.state.TrainState` (its top level) and the other registered parts (one key each:
``goodput``, ``spike``).
"""
