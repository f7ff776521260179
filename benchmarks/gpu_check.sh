#!/usr/bin/env bash
# One-shot check on one CUDA GPU (wheels from scripts/offline_wheels.sh in .whl/): the same trainer
# code on one GPU (the CPU backend must stay inactive), fp32 losses comparable with the CPU run of the same
# overrides, a bf16 MuonClip run, and the attention and optimizer benchmarks. Results go to $OUT.
#   usage (on the GPU machine, checkout with .whl/ and data_cache/): bash benchmarks/gpu_check.sh
# (the whole trainer on one GPU, every feature, memory against the plan: benchmarks/gpu_session.sh)
set -uo pipefail
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH="/tmp/site:$(bash scripts/checkout_path.sh)" WANDB_MODE=disabled PYTHONUNBUFFERED=1
D=data_cache/stdlib-3.12.1-v4096
COMMON=(data.path=$D/train data.valid_path=$D/valid data.tokenizer=$D/tokenizer.json
        train.eval_interval=0 schedule.phases.0.steps=0 run.seed=7 run.wandb.mode=disabled train.progress=false)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import torch, sys; from k2.parallel import cpu_backend; print(torch.__version__, torch.cuda.get_device_name(0), 'cpu_backend.enable() ->', cpu_backend.enable())" > "$OUT/env.txt" 2>&1
timeout 150 python3 -m k2.launcher.train "${COMMON[@]}" train.iters=3 run.dir="$OUT/gpu_fp32" > "$OUT/gpu_fp32.log" 2>&1; echo "fp32 rc=$?" >> "$OUT/status.txt"
timeout 150 python3 -m k2.launcher.train "${COMMON[@]}" train.iters=40 train.precision=bf16 optim=muonclip run.dir="$OUT/gpu_bf16" > "$OUT/gpu_bf16.log" 2>&1; echo "bf16 muonclip rc=$?" >> "$OUT/status.txt"
timeout 120 python3 -m k2.launcher.bench bench=attention output=json > "$OUT/bench_attention.json" 2> "$OUT/bench_attention.log"; echo "bench rc=$?" >> "$OUT/status.txt"
timeout 90 python3 -m k2.launcher.bench bench=optimizer output=json > "$OUT/bench_optimizer.json" 2> "$OUT/bench_optimizer.log"; echo "bench optimizer rc=$?" >> "$OUT/status.txt"
# one summary file (the device tool returns a limited number of files)
python3 - "$OUT" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
def recs(d):
    p = out / d / "metrics.jsonl"
    return [json.loads(l) for l in p.read_text().splitlines()] if p.exists() else []
s = {"env": (out / "env.txt").read_text(), "gpu": (out / "gpu.txt").read_text(),
     "fp32": recs("gpu_fp32"), "bf16": recs("gpu_bf16")}
for name in ("bench_attention", "bench_optimizer"):
    b = out / f"{name}.json"
    if b.exists():
        try: s[name] = json.loads(b.read_text())
        except ValueError: pass
(out / "summary.json").write_text(json.dumps(s, indent=1))
PY
rm -rf "$OUT/gpu_fp32" "$OUT/gpu_bf16"
cat "$OUT/status.txt"
