"""The training loop and what it needs: the decisions made before any process group (``prepare``), the
:class:`~k2.launcher.training.trainer.Trainer` and the run's :class:`~k2.launcher.training.state.TrainState`,
one global batch through megatron's schedule (``step``), the datasets of the current phase
(``phase_data``), MoE metrics, ``metrics.jsonl`` / wandb (``metrics``), preemption, and starting local ranks
(``launch``).
"""
