#!/usr/bin/env bash
# One GPU session in one device-tool call (at most ~9 min: SESSION_LIMIT_S; every step under its own
# timeout, cut to what is left, so one failure does not lose the others): k2-train itself on one GPU,
# then the benchmarks. The trainer's steps are benchmarks/gpu_session.py's (its docstring):
#   env            versions, GPU, CPU backend off, cuDNN attention at MLA's qk 192 / v 128
#   train_async    k2-train, NCCL world size 1, BF16, cuDNN SDPA + Triton max-logit kernel, grouped experts,
#                  FP8 storage + recompute + activation offload (memory=k2), optimizer offload, MuonClip
#                  with a QK-Clip that clips, a spike injected at step 3 and skipped, background saves
#                  (the writer of step 2 held while steps 3-4 update the offloaded states), peak memory
#   train_sync     the same with synchronous saves
#   train_resume   from train_async's step-2 checkpoint
#   compare        async vs sync checkpoints tensor by tensor, resumed vs uninterrupted losses
#   watchdog       a held background save ended by the hang watchdog with 42 (requeue)
#   ep_overlap     pipeline.ep_overlap (megatron's combined 1F1B, the communication CUDA stream) against the
#                  plain schedule, 3 steps each; one GPU has no EP peer: nothing hidden, nothing timed
#   plan           k2-plan of the same config on one GPU: measured peak memory over planned (summary)
#   bench_attention, bench_hardware, bench_step   k2-bench on CUDA: K2's attention shape (torch and Triton
#                  max-logit passes); this GPU's profile for k2-plan ($OUT/h200_measured.yaml: compare with
#                  recipes/hardware/h200.yaml); the K2 step against plain megatron-core
#   summary        $OUT/summary.json and one line per check; exit status 0 only when every check passes
# TINY=1 runs the same steps on the CPU with k2_tiny's sizes and the checkout's .venv (CI:
# tests/unit/test_gpu_session.py), checks bitwise where the GPU mode allows a tolerance.
# Results in $OUT: status.txt (progress, rc per step), <step>.json, <step>.log (output; tail printed on
# failure), summary.json. The runs' directories (GBs of checkpoints on a GPU) go to $RUNS (default
# /tmp/k2-gpu-session; with TINY=1 $OUT/runs), not to $OUT, which the device tool sends back.
#   here:   scripts/offline_wheels.sh   (once: .whl/, git-ignored; megatron-core, emerging-optimizers, hydra,
#           omegaconf, antlr4, PyYAML, psutil, xxhash, tokenizers, tqdm: what the GPU machine lacks)
#   device: run(command="bash benchmarks/gpu_session.sh", carry=[".whl", "data_cache"], timeout_s=600)
# To add a step: one `step NAME LIMIT_S COMMAND...` line below (and its figures to gpu_session.py summary).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-/tmp/gpu_session}
mkdir -p "$OUT"
S=$OUT/status.txt
: > "$S"
T0=$SECONDS
TINY=${TINY:-0}
LIMIT=${SESSION_LIMIT_S:-$([ "$TINY" = 1 ] && echo 840 || echo 530)}
# TINY: each step's own limit x3 (a shared CI machine may run it at a fraction of a core)
SCALE=${STEP_LIMIT_SCALE:-$([ "$TINY" = 1 ] && echo 3 || echo 1)}
log() { echo "[$((SECONDS - T0)) s] $*" | tee -a "$S"; }

if [ "$TINY" = 1 ]; then
    PY=${PYTHON:-.venv/bin/python}
    log "TINY: CPU, k2_tiny sizes, $PY"
else
    log "installing wheels"
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -3
    PY=python3
    export PYTHONPATH="/tmp/site:$(bash scripts/checkout_path.sh)"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee -a "$S"
fi
export OUT TINY WANDB_MODE=disabled PYTHONUNBUFFERED=1

FAILED=()
step() {  # NAME LIMIT_S COMMAND...: run under min(LIMIT_S, what is left of the session minus the summary's 30 s)
    local name=$1 limit=$(($2 * SCALE)) rc left
    shift 2
    left=$((LIMIT - (SECONDS - T0) - 30))
    [ "$name" = summary ] && left=$((left + 30))
    if [ "$left" -lt 10 ]; then log "skip $name (session time spent)"; FAILED+=("$name"); return; fi
    [ "$limit" -gt "$left" ] && limit=$left
    log "start $name (limit $limit s)"
    timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    log "end $name rc=$rc$([ $rc -eq 124 ] && echo ' (timed out)')"
    if [ $rc -ne 0 ]; then FAILED+=("$name"); [ "$name" = summary ] || grep -v -i warn "$OUT/$name.log" | tail -15; fi
}
bench() {  # NAME LIMIT_S K2-BENCH OVERRIDES...: the JSON record (stdout) into $OUT/NAME.json
    local name=$1 limit=$2
    shift 2
    step "$name" "$limit" bash -c 'out=$1; shift; "$@" > "$out"' _ "$OUT/$name.json" \
        $PY -m k2.launcher.bench output=json "$@"
}
G=benchmarks/gpu_session.py

step env 60 $PY $G env
step train_async 150 $PY $G train async
step train_sync 120 $PY $G train sync
step train_resume 100 $PY $G train resume
step compare 60 $PY $G compare
step watchdog 90 $PY $G watchdog
step ep_overlap 120 $PY $G ep_overlap
step plan 60 $PY $G plan
if [ "$TINY" = 1 ]; then
    bench bench_attention 60 bench=attention bench.options.devices=cpu bench.options.seq_length=64 \
        bench.options.warmup=1 bench.options.repeats=1
    bench bench_hardware 60 bench=hardware bench.options.ranks=1 bench.options.repeats=1 bench.options.gemm_size=128 \
        bench.options.name=cpu_tiny bench.options.out="$OUT/cpu_tiny_measured.yaml"
    bench bench_step 120 bench=step bench.options.size=tiny bench.options.warmup=1 bench.options.repeats=1
else
    bench bench_attention 60 bench=attention bench.options.devices=cuda bench.options.repeats=5
    bench bench_hardware 90 bench=hardware bench.options.ranks=1 bench.options.repeats=5 bench.options.name=h200 \
        bench.options.out="$OUT/h200_measured.yaml"
    bench bench_step 150 bench=step bench.options.size=k2 bench.options.microbatches=4 bench.options.warmup=1 \
        bench.options.repeats=3
fi
step summary 30 $PY $G summary
cat "$OUT/summary.log" | tee -a "$S"
log "done; failed steps: ${FAILED[*]:-none}"
[ ${#FAILED[@]} -eq 0 ]
