#!/usr/bin/env bash
# GPU figures in one device-tool call, ~6 min on one H200
# (at most ~9 min: every step has its own timeout, so one failure does not lose the others):
#   1. bench=attention on CUDA: K2 shape (64 heads, qk 192 / v 128, s 4096, bf16), torch and Triton
#      max-logit passes (time_k2_ms, max_logit_overhead, time_k2_triton_ms, max_logit_overhead_triton);
#   2. bench=step at K2 widths (default config: 3 layers, 16 experts, s 4096, 8 microbatches, bf16):
#      baseline vs the full K2 step and each feature off;
#   3. bench=step on the tiny config with memory=k2 (offload on CUDA streams, FP8, recompute, grouped
#      GEMMs in bf16): a smoke test of every CUDA branch.
#   4. bench=hardware: this GPU's profile for k2-plan (GEMM rate by shape, HBM bandwidth, per-kernel cost;
#      one GPU, so no NCCL collectives) written to $OUT/h200_measured.yaml: compare with
#      recipes/hardware/h200.yaml and update its measured lines.
# TINY=1 runs the same steps on the CPU with tiny sizes (no wheels, no GPU): a check of the script itself.
# Results in $OUT: status.txt (progress, GPU, rc per step, summary), <step>.json (the k2-bench JSON
# record), <step>.log (stderr; the tail is printed on failure).
#   here:   scripts/offline_wheels.sh     (once: .whl/, git-ignored), then copy the checkout with .whl/
#   there:  bash benchmarks/gpu_session.sh
set -uo pipefail
OUT=${OUT:-/tmp/gpu_session}
mkdir -p "$OUT"
S=$OUT/status.txt
T0=$SECONDS
log() { echo "[$((SECONDS - T0)) s] $*" | tee -a "$S"; }

TINY=${TINY:-0}
if [ "$TINY" = 1 ]; then
    log "TINY: CPU, tiny sizes, the checkout's own environment"
    PY=${PYTHON:-.venv/bin/python}
    export WANDB_MODE=disabled PYTHONUNBUFFERED=1
else
    log "installing wheels"
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -3
    PY=python3
    export PYTHONPATH="/tmp/site:$(bash scripts/checkout_path.sh)" WANDB_MODE=disabled PYTHONUNBUFFERED=1
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee -a "$S"
fi
$PY -c "import torch; from k2.parallel import cpu_backend; print('torch', torch.__version__, 'cudnn', torch.backends.cudnn.version(), 'cpu_backend.enable() ->', cpu_backend.enable())" 2>&1 | tail -3 | tee -a "$S"

bench() {  # name, time limit (s), k2-bench overrides...
    local name=$1 limit=$2 rc
    shift 2
    log "start $name (limit $limit s)"
    timeout -k 10 "$limit" $PY -m k2.launcher.bench output=json "$@" > "$OUT/$name.json" 2> "$OUT/$name.log"
    rc=$?
    log "end $name rc=$rc$([ $rc -eq 124 ] && echo ' (timed out)')"
    if [ $rc -ne 0 ]; then grep -v -i warn "$OUT/$name.log" | tail -20; fi
}

if [ "$TINY" = 1 ]; then
    bench hardware 120 bench=hardware bench.options.ranks=1 bench.options.repeats=2 bench.options.gemm_size=256 \
        bench.options.name=cpu_tiny bench.options.out="$OUT/cpu_tiny_measured.yaml"
else
    bench attention 100 bench=attention bench.options.devices=cuda
    bench step_k2 330 bench=step bench.options.size=k2 bench.options.warmup=2 bench.options.repeats=5
    bench step_tiny 90 bench=step bench.options.size=tiny bench.options.memory=k2 bench.options.precision=bf16 \
        bench.options.seq_length=512 bench.options.microbatches=2 bench.options.warmup=1 bench.options.repeats=2 \
        bench.options.resident=8
    bench hardware 90 bench=hardware bench.options.ranks=1 bench.options.repeats=5 bench.options.name=h200 \
        bench.options.out="$OUT/h200_measured.yaml"
fi

$PY - "$OUT" <<'PY' 2>&1 | tee -a "$S"
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
def load(name):
    try:
        return json.loads((out / f"{name}.json").read_text())["figures"]
    except (OSError, ValueError, KeyError):
        return None
att = load("attention")
if att and "cuda" in att:
    c = att["cuda"]
    print("attention:", {k: c.get(k) for k in ("time_k2_ms", "time_k2_no_record_ms", "max_logit_overhead",
          "time_k2_triton_ms", "max_logit_overhead_triton", "max_logit_abs_diff", "max_logit_abs_diff_triton")})
hw = load("hardware")
if hw:
    p = hw["profile"]
    print("hardware:", {k: p.get(k) for k in ("gpu", "gemm_bf16_tflops", "gemm_fp32_tflops", "attention_tflops",
                                               "memory_gbps", "kernel_launch_us")}, "by shape:", hw["gemm_by_shape_tflops"])
for name in ("step_k2", "step_tiny"):
    f = load(name)
    if not f:
        print(name, ": no figures")
        continue
    print(f"{name}: gemm peak {f['gemm_peak_tflops']:.0f} TFLOP/s, {f['config']['tokens_per_step']} tokens/step")
    for case, c in f["cases"].items():
        print(f"  {case:<20} {c['step_ms']:9.1f} ms  {c['tokens_per_s']:9.0f} tok/s  x{c['tokens_per_s_over_baseline']:.3f}"
              f"  {c['model_tflops']:6.1f} TFLOP/s  MFU {c['mfu']:.3f}  opt {c['optimizer_ms']:7.1f} ms"
              f"  peak {c.get('peak_memory_bytes', 0) / 2**30:6.1f} GiB")
PY
log "done"
