"""``k2-plan plan.published=all|NAME``: the step-time model against published runs.

``recipes/published/runs.yaml`` lists each run (model, hardware, layout, batch, precision, the published
step time and tokens/s, its source) with the ``k2-plan`` overrides that state it. Each is planned with
those overrides alone (the model's constants are the hardware profiles' sourced numbers, none fitted
to these runs) and compared: ``error = predicted / published - 1`` of the step time. A run whose
published figure is GPU-hours per token (``published_figure: gpu_hours``: wall time, failures, restarts
and checkpoint stalls included) is compared as the predicted step over the plan's expected goodput
(:func:`k2.launcher.planning.checkpoint.checkpoint_plan`: Llama 3's failure rate scaled to the cluster).
"""

from __future__ import annotations

from typing import Any

import yaml

from k2.config.errors import ConfigError
from k2.config.recipes import RECIPES_DIR

RUNS_FILE = RECIPES_DIR / "published" / "runs.yaml"
_FIGURES = ("step_time", "gpu_hours")  # what a run published (module docstring)


def published_runs() -> list[dict[str, Any]]:
    """The runs of ``recipes/published/runs.yaml`` (each a mapping; keys as in the file)."""
    return list(yaml.safe_load(RUNS_FILE.read_text())["runs"])


def compare_run(run: dict[str, Any], extra: list[str] = ()) -> dict[str, Any]:
    """Plan one published run and compare: its name, the predicted and published step seconds and tokens
    per second per GPU, the error, MFU (BF16 peak), the breakdown (seconds) and the what-if labels;
    ``predicted_step_s`` is the step over the expected goodput for a ``gpu_hours`` figure (``step_s``:
    the step itself, ``goodput``: the divisor, 1 otherwise).

    Raises:
        ConfigError: an unknown ``published_figure``.
    """
    from k2.config import load_config
    from k2.launcher.planning.cluster import plan_cluster

    cfg = load_config(list(run["overrides"]) + list(extra))
    p = plan_cluster(cfg).report
    gpus = p["world_size"]
    kind = run.get("published_figure", "step_time")
    if kind not in _FIGURES:
        raise ConfigError(
            f"{RUNS_FILE.name}: run {run['name']}: published_figure={kind!r}; allowed: {', '.join(_FIGURES)}"
        )
    goodput = p["checkpoint"]["expected_goodput"] if kind == "gpu_hours" else 1.0
    step = p["step_time_s_estimated"] / goodput
    breakdown = dict(p["step_time_breakdown_s"])
    if kind == "gpu_hours":  # the wall time failures, restarts and checkpoint stalls add per step
        breakdown["goodput_loss"] = step - p["step_time_s_estimated"]
    return {
        "name": run["name"],
        "gpus": gpus,
        "predicted_step_s": step,
        "published_step_s": run["published_step_s"],
        "error": step / run["published_step_s"] - 1,
        "published_figure": kind,
        "goodput": goodput,
        "step_s": p["step_time_s_estimated"],
        "predicted_tokens_per_s_per_gpu": p["global_batch_tokens"] / step / gpus,
        "published_tokens_per_s_per_gpu": run["published_tokens_per_s_per_gpu"],
        "mfu_bf16_peak": p["mfu_estimated"],
        "breakdown_s": breakdown,
        "what_if": p["what_if"],
        "gemm_precision": p["gemm_precision"],
        "hardware": p["hardware"],
        "source": run["source"],
    }


def compare_published(which: str, extra: list[str] = ()) -> list[dict[str, Any]]:
    """:func:`compare_run` for ``which`` (a run's name, or ``all``).

    Raises:
        ConfigError: an unknown name, naming ``plan.published`` and the allowed names.
    """
    runs = published_runs()
    names = [r["name"] for r in runs]
    if which != "all" and which not in names:
        raise ConfigError(f"plan.published={which!r}: allowed: all, {', '.join(names)}")
    return [compare_run(r, extra) for r in runs if which in ("all", r["name"])]


def format_published(rows: list[dict[str, Any]]) -> str:
    """Text table of :func:`compare_published`'s rows, then each breakdown."""
    w = max([38, *(len(r["name"]) + 1 for r in rows)])  # the run name column fits the longest name
    lines = [
        "step-time model vs published runs (recipes/published/runs.yaml; error = predicted / published - 1)",
        f"  {'run':<{w}}{'GPUs':>6}{'predicted s':>13}{'published s':>13}{'error':>8}{'tok/s/GPU':>11}"
        f"{'published':>11}{'MFU':>7}  {'GEMMs':<10}what-if",
    ]
    for r in rows:
        lines.append(
            f"  {r['name']:<{w}}{r['gpus']:>6}{r['predicted_step_s']:>13.2f}{r['published_step_s']:>13.2f}"
            f"{100 * r['error']:>+7.1f}%{r['predicted_tokens_per_s_per_gpu']:>11.0f}"
            f"{r['published_tokens_per_s_per_gpu']:>11.0f}{100 * r['mfu_bf16_peak']:>6.1f}%  "
            f"{r['gemm_precision']:<10}{','.join(r['what_if']) or '-'}"
        )
    for r in rows:
        terms = ", ".join(f"{k} {v:.2f}" for k, v in r["breakdown_s"].items() if v >= 0.005)
        lines.append(f"  {r['name']}: {terms}")
    return "\n".join(lines)
