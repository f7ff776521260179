"""The launcher: k2-launcher's building blocks, training loop, tools and command-line entry points.

Sub-packages, in import order (each imports only from those before it and from ``k2.config`` ...
``k2.optim``; ``k2.config`` states the whole order):

* building blocks, independent of each other: :mod:`k2.launcher.datasets` (the embedded corpus, data
  settings, megatron GPT datasets, microbatches), :mod:`k2.launcher.checkpointing` (dist-checkpoints,
  resume decisions, RNG state), :mod:`k2.launcher.planning` (memory per GPU, pipeline bubble, layout
  search: ``k2-plan``'s engine);
* :mod:`k2.launcher.training` -- ``Trainer``, ``TrainState``, metrics, preemption, local rank launch;
* :mod:`k2.launcher.benchmarks` (``k2-bench``) and :mod:`k2.launcher.tools` (sparsity sweep, Slurm);
* :mod:`k2.launcher.cli` -- error line, exit status 2 for a bad setting, 42 for a requeue, the filters
  for library messages that carry no action for a user;
* entry modules, thin: ``train`` (``k2-train``), ``plan`` (``k2-plan``), ``data`` (``k2-data``), ``bench``
  (``k2-bench``), ``submit`` (``k2-submit``), ``sweep_report`` (``k2-sweep-report``).
"""

import k2.parallel  # noqa: F401 (first: without CUDA, megatron-core's import-time torch.compile stays eager)
from k2.launcher.quiet import quiet_libraries

quiet_libraries()  # before anything below imports megatron-core
