"""Configuration: the bottom layer of k2-launcher.

What is here: :class:`ConfigError` (``errors``), the typed schema of every setting (``schema``; the allowed
values of each setting that takes one of a fixed set of names as an ``Enum`` in ``choices``), loading the Hydra
config tree shipped as ``k2.recipes`` (``load``; where it is and a group's recipes: ``recipes``), the hardware
profile ``plan.hardware`` names (``schema_hardware``, read by ``hardware``), and every rule that depends on the
config alone (``validate``: each section checks itself, the rules that span sections live in one place). Every
function that takes the config or a section is typed with the schema's class and reads its attributes.
:func:`load_config` runs the validation, so every tool (``k2-train``, ``k2-plan``, ``k2-submit``, the sweep,
``k2-bench``, ``k2-data``) applies the same checks. Checks that need the machine (files, CUDA, Transformer
Engine) or a world size stay with the module that owns them.

Layers of the project; imports point only down this list (``tests/unit/test_layering.py`` enforces it):

1. ``k2.config`` -- imports nothing of k2-launcher;
2. ``k2.parallel`` -- parallel dimensions, process groups, the CPU backend of megatron-core;
3. ``k2.model`` -- the K2 model on megatron-core, activation memory, FLOP and parameter counts;
4. ``k2.schedules`` -- the token-based training schedule, LR scheduler, pipeline-schedule hooks;
5. ``k2.optim`` -- MuonClip and the optimizers under ZeRO-1;
   then ``k2.launcher.quiet``, ``k2.launcher.gc_pause`` and ``k2.launcher.progress`` -- process hygiene
   (library messages, the garbage collector's pauses, progress of long work for the hang watchdog) that
   imports nothing of k2-launcher;
6. the launcher's building blocks, which do not import each other: ``k2.launcher.datasets``,
   ``k2.launcher.checkpointing``, ``k2.launcher.planning``;
7. ``k2.launcher.hf`` -- Hugging Face checkpoints in and out (uses checkpointing and datasets);
8. ``k2.launcher.training`` -- the training loop;
9. ``k2.launcher.benchmarks`` and ``k2.launcher.tools`` (sweep, Slurm submission);
10. ``k2.launcher.cli`` -- the command-line contract shared by the entry modules;
11. the entry modules ``k2.launcher.{train,plan,data,bench,submit,sweep_report,convert}`` (parse, call,
    print).
"""

from k2.config.errors import ConfigError
from k2.config.load import load_config, to_yaml
from k2.config.recipes import RECIPES_DIR

__all__ = ["ConfigError", "RECIPES_DIR", "load_config", "to_yaml"]
