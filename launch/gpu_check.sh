#!/usr/bin/env bash
# ember's device check (`make gpu-check`): one command of at most ~8 minutes on one H100/H200 with no
# network (default budget 430 s of stages), so that one rerun fits a 15-minute device budget.
#
#   make gpu-wheels        # here, with network: the wheels the GPU image lacks, into the git-ignored .whl/
#   make gpu-check         # there, from the repository root; the report lands in $OUT (or /tmp/ember_gpu_check)
#   STAGES="b1 b2" GPU_CHECK_BUDGET_S=430 make gpu-check    # a rerun: the 125M comparison alone
#
# Stages, each under `timeout -s ABRT` (a hang dumps every thread's Python stack through faulthandler
# before the kill; a native crash prints its stack too), in this order (rough H100 times):
#   env  ~15 s    versions, GPU, every native extension in one process, bf16 matmul peak, JAX's GPU grab
#   a    60-100 s launch/train.py llama3_tiny on CUDA: compile, evals, orbax checkpoints, the sample
#   a2   30-60 s  the same run resumed from its last checkpoint to more steps, the sample again
#   c1   20-40 s  the compiled step twice in-process (bitwise?), eager and CPU references, RNG, checkpoint
#   c2   20-40 s  c1 again in a second process (the summary compares the two processes' bits)
#   t    60-150 s pytest -m gpu over tests/ (every test marked gpu; the determinism test compiles in a subprocess)
#   d    45-90 s  qwen3_moe_tiny (dropless) against its dense twin, bf16, compiled, round-robin
#   b1   the rest llama3_125m bf16, torch.compile(module) + fused AdamW against ember's compiled step in
#                 one process, on an empty Inductor cache: cold first calls, steady ms, MFU, peak memory
#   b2   30-120 s b1's variants again in a second process on b1's cache: warm first calls
# Each stage's exit status and wall time go to $WORK/results.tsv; `summary` reads them and the log
# and prints (and writes $OUT/summary.md) the table for BENCHMARKS.md.
#
# Knobs: STAGES ("env a a2 c1 c2 t d b1 b2"), GPU_CHECK_BUDGET_S (430), GPU_CHECK_MODE (gpu|cpu; default:
# gpu when nvidia-smi sees one; cpu runs the same entry points eagerly at toy sizes, as CI does),
# GPU_CHECK_BLOCKING=1 (CUDA_LAUNCH_BLOCKING=1, for a rerun after a crash), GPU_CHECK_GDB=1 (each
# stage under cuda-gdb: a native backtrace), B_VARIANTS (torch_compiled_bf16,ember_inductor_bf16),
# B_EXTRA (more step_compare flags, e.g. "--data.batch_size 4"), B2_EXTRA (b2's alone, e.g. "--profile": where
# each warm first call's seconds go), GPU_TESTS (pytest paths: tests),
# PY (python3), OUT (the report folder), GPU_CHECK_WORK (scratch: caches, runs; /tmp/ember_gpu_check_work).
set -u -o pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO" || exit 2
PY=${PY:-python3}
OUT=${OUT:-/tmp/ember_gpu_check}
WORK=${GPU_CHECK_WORK:-/tmp/ember_gpu_check_work}
BUDGET=${GPU_CHECK_BUDGET_S:-430}
STAGES=" ${STAGES:-env a a2 c1 c2 t d b1 b2} "
START=$(date +%s)
DEADLINE=$((START + BUDGET))
mkdir -p "$OUT" "$WORK"
LOG=$OUT/gpu_check.log
RESULTS=$WORK/results.tsv
: > "$RESULTS"

if [ -z "${GPU_CHECK_MODE:-}" ]; then
  GPU_CHECK_MODE=cpu
  command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && GPU_CHECK_MODE=gpu
fi
case "$GPU_CHECK_MODE" in
  gpu | cpu) ;;
  *) echo "error: GPU_CHECK_MODE must be gpu or cpu, got '$GPU_CHECK_MODE'; unset it to pick by nvidia-smi" >&2; exit 2 ;;
esac

export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 TORCH_SHOW_CPP_STACKTRACES=1 PYTHONDONTWRITEBYTECODE=1
export TORCHINDUCTOR_CACHE_DIR=$WORK/inductor   # a, a2, c1, c2, t, d share it (c reuses a's kernels)
[ "${GPU_CHECK_BLOCKING:-0}" = 1 ] && export CUDA_LAUNCH_BLOCKING=1
[ "$GPU_CHECK_MODE" = cpu ] && export CUDA_VISIBLE_DEVICES=   # the CPU mode is the CPU, on a GPU host too
ulimit -c 0   # an abort (also the timeout's ABRT) writes no core file

# Sizes: the GPU mode's are the real check; the CPU mode's are toys that only prove flags and plumbing.
if [ "$GPU_CHECK_MODE" = gpu ]; then
  TINY="--log_every 10 --eval_every 10 --eval_batches 2 --checkpoint_every 10 --sample_tokens 8"
  A_STEPS=20 A2_STEPS=30 REPEAT="--steps 5" MOE="--warmup 2 --iters 10"
  B_ARGS="--config llama3_125m --warmup 2 --iters 10"
  B_VARIANTS=${B_VARIANTS:-torch_compiled_bf16,ember_inductor_bf16}
else
  TINY="--backend eager --compute_dtype float32 --model.n_layers 1 --data.batch_size 2 --data.seq_len 32
        --log_every 1 --eval_every 2 --eval_batches 1 --checkpoint_every 2 --sample_tokens 4 --data.max_bytes 200000"
  A_STEPS=2 A2_STEPS=3 REPEAT="--steps 2"
  MOE="--backend eager --dtype float32 --n-layers 1 --warmup 0 --iters 1 --peak-reps 1"
  B_ARGS="--config llama3_tiny --model.n_layers 1 --data.batch_size 2 --data.seq_len 32 --warmup 0 --iters 1
          --peak-reps 1"
  B_VARIANTS=${B_VARIANTS:-torch_eager,ember_eager}
fi
B_ARGS="$B_ARGS --variants $B_VARIANTS ${B_EXTRA:-}"
PEAK_REPS=$([ "$GPU_CHECK_MODE" = gpu ] && echo 10 || echo 1)

# stage KEY CAP_S MIN_S CMD...: run CMD under `timeout -s ABRT` for min(CAP_S, time left), or skip it.
stage() {
  local key=$1 cap=$2 min=$3
  shift 3
  case "$STAGES" in *" $key "*) ;; *) return 0 ;; esac
  local left t rc t0 t1 wall status wrap=()
  left=$((DEADLINE - $(date +%s)))
  if [ "$left" -lt "$min" ]; then
    echo "===== [$key] SKIPPED: ${left}s of the budget left, ${min}s needed"
    printf '%s\t%s\t%s\n' "$key" "skipped (budget)" "-" >> "$RESULTS"
    return 0
  fi
  t=$((cap < left ? cap : left))
  echo "===== [$key] $(date +%T) timeout ${t}s: $*"
  [ "${GPU_CHECK_GDB:-0}" = 1 ] && wrap=(cuda-gdb -q -batch -ex run -ex bt -ex "info threads" --args)
  t0=$(date +%s.%N)
  timeout -s ABRT -k 15 "$t" "${wrap[@]}" "$@"
  rc=$?
  t1=$(date +%s.%N)
  wall=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')
  case $rc in
    0) status=ok ;;
    124 | 137) status="TIMEOUT after ${t}s" ;;
    134) status="ABORTED (rc 134)" ;;
    139) status="SEGFAULT (rc 139)" ;;
    *) status="FAILED (rc $rc)" ;;
  esac
  echo "===== [$key] $status, ${wall}s"
  [ "$GPU_CHECK_MODE" = gpu ] && nvidia-smi --query-gpu=memory.used,utilization.gpu,temperature.gpu,clocks.sm \
    --format=csv,noheader 2>/dev/null | sed "s/^/[$key] gpu after: /"
  printf '%s\t%s\t%s\n' "$key" "$status" "$wall" >> "$RESULTS"
  return 0
}

# What the GPU image lacks (grain, tyro, ...) comes from the carried .whl/, installed into $WORK/site.
python_path() {
  local missing
  missing=$($PY -c "import importlib.util as u; print(*[m for m in ('torch', 'grain', 'tyro', 'beartype')
    if u.find_spec(m) is None])" 2>/dev/null) || missing="torch grain tyro beartype"
  case " $missing " in *" torch "*)  # the wheels cannot help: torch comes with the GPU image or a venv
    echo "FATAL: $PY cannot import $missing: GPU_PY (PY for launch/gpu_check.sh) must be a python with torch," \
      "the GPU image's, or ember's venv here: make gpu-check GPU_PY=.venv/bin/python"
    return 1 ;;
  esac
  if [ -n "$missing" ]; then
    if ! ls "$REPO"/.whl/*.whl >/dev/null 2>&1; then
      echo "FATAL: $PY cannot import $missing, and .whl/ holds no wheels: on the GPU image run" \
        "\`make gpu-wheels\` first where there is network; elsewhere pass a python that has them:" \
        "make gpu-check GPU_PY=.venv/bin/python"
      return 1
    fi
    if ! $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" \
      "$REPO"/.whl/*.whl; then  # no pip: a wheel is a zip of what goes on the path
      echo "pip install --target failed: unzipping the wheels into $WORK/site instead"
      for w in "$REPO"/.whl/*.whl; do $PY -m zipfile -e "$w" "$WORK/site" || return 1; done
    fi
    export PYTHONPATH=$WORK/site${PYTHONPATH:+:$PYTHONPATH}
  fi
  # The repository root is the package (package-dir "ember" = "."): import it through a link named ember.
  mkdir -p "$WORK/pkgroot"
  ln -sfn "$REPO" "$WORK/pkgroot/ember"
  export PYTHONPATH=$WORK/pkgroot${PYTHONPATH:+:$PYTHONPATH}
}

main() {
  echo "ember device check: mode $GPU_CHECK_MODE, budget ${BUDGET}s, stages${STAGES}, repo $REPO, $(date -u +%FT%TZ)"
  python_path || return 1
  if [ "$GPU_CHECK_MODE" = gpu ]; then
    { nvidia-smi; $PY -m pip list 2>/dev/null; } > "$OUT/env.txt" 2>&1
    nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version,clocks.max.sm --format=csv,noheader
  fi
  local m="$PY -m ember.launch.device_check" run_a=$WORK/run_a
  stage env 60 10 $m.env_probe --peak-reps "$PEAK_REPS"
  # shellcheck disable=SC2086  # the size flags are word lists
  stage a 150 40 $PY launch/train.py --config llama3_tiny --out "$run_a" --overwrite $TINY --steps "$A_STEPS"
  stage a2 100 20 $PY launch/train.py --config llama3_tiny --out "$run_a" --resume $TINY --steps "$A2_STEPS"
  [ -f "$run_a/metrics.jsonl" ] && cp "$run_a/metrics.jsonl" "$OUT/metrics_a.jsonl"
  stage c1 75 20 $m.repeat --config llama3_tiny $REPEAT $TINY
  stage c2 75 20 $m.repeat --config llama3_tiny $REPEAT $TINY
  stage t 150 15 $m.gpu_tests ${GPU_TESTS:-tests}
  stage d 120 30 $m.moe_step $MOE
  # 125M: b1 compiles cold (its cache emptied first) and gets what is left but b2's share; b2 reuses it.
  local b1_cap=$((DEADLINE - $(date +%s)))
  case "$STAGES" in *" b2 "*) [ "$b1_cap" -gt 75 ] && b1_cap=$((b1_cap - 45)) ;; esac
  case "$STAGES" in *" b1 "*) rm -rf "$WORK/inductor_125m" ;; esac
  stage b1 "$b1_cap" 30 env TORCHINDUCTOR_CACHE_DIR="$WORK/inductor_125m" \
    $m.step_compare --phase cold $B_ARGS
  stage b2 150 10 env TORCHINDUCTOR_CACHE_DIR="$WORK/inductor_125m" $m.step_compare --phase warm $B_ARGS ${B2_EXTRA:-}
  [ "$GPU_CHECK_MODE" = gpu ] && dmesg 2>/dev/null | grep -i -E 'xid|nvrm' | tail -5 | sed 's/^/dmesg: /'
  $PY launch/device_check/summary.py --log "$LOG" --results "$RESULTS" --out "$OUT" \
    --command "${GPU_CHECK_COMMAND:-make gpu-check}" --mode "$GPU_CHECK_MODE"
  echo "total $(($(date +%s) - START))s of ${BUDGET}s; report in $OUT: $(ls "$OUT" | tr '\n' ' ')"
}

: > "$LOG"
main 2>&1 | tee -a "$LOG"
