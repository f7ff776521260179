#!/usr/bin/env bash
# Convergence check of the activation-memory switches: training with every activation-memory switch on (memory=k2: FP8 storage of the MoE
# fc1 inputs and SwiGLU inputs, recompute of RMSNorm / SwiGLU / MLA up-projection / MoE down-projection,
# offload of the rest) for 200 steps of the README's main job (k2_tiny, parallel=cpu4, the tiny_wsd
# schedule, the stdlib corpus) stays within 2 % of the baseline (memory=none) validation loss.
# Runs both in turn (about 3 minutes each on a quiet 2-core machine) and prints both validation-loss
# curves (every 50 steps) and the relative difference at step 200; exit status 1 when it exceeds 2 %.
#   usage: bash benchmarks/memory_convergence.sh [OUT_DIR]     (default runs/memory_convergence)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${K2_PYTHON:-.venv/bin/python}
OUT=${1:-runs/memory_convergence}
rm -rf "$OUT/none" "$OUT/k2"
mkdir -p "$OUT"
for mem in none k2; do
  "$PY" -m k2.launcher.train parallel=cpu4 train.iters=200 memory=$mem run.dir="$OUT/$mem" \
    run.wandb.mode=disabled train.progress=false > "$OUT/$mem.log" 2>&1
done
"$PY" - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
recs = {m: [json.loads(l) for l in (out / m / "metrics.jsonl").read_text().splitlines()] for m in ("none", "k2")}
val = {m: {r["step"]: r["val_loss"] for r in rs if "val_loss" in r} for m, rs in recs.items()}
time = {m: sum(r["step_time_s"] for r in rs) / len(rs) for m, rs in recs.items()}
print("step  val_loss(memory=none)  val_loss(memory=k2)  rel.diff")
for step in sorted(val["none"]):
    a, b = val["none"][step], val["k2"].get(step)
    print(f"{step:4d}  {a:21.4f}  {b:19.4f}  {(b - a) / a:+8.3%}")
last = max(val["none"])
rel = abs(val["k2"][last] - val["none"][last]) / val["none"][last]
print(f"mean step time: none {time['none']:.2f} s, k2 {time['k2']:.2f} s")
print(f"step {last}: |val_loss(k2) - val_loss(none)| / val_loss(none) = {rel:.3%} (limit 2 %)")
json.dump({"val_loss": val, "rel_diff": rel, "mean_step_s": time}, open(out / "summary.json", "w"), indent=1)
sys.exit(0 if rel <= 0.02 else 1)
PY
