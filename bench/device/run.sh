#!/usr/bin/env bash
# The device runner: what one call on a lent GPU machine runs, as suites. From the checkout's root
# (the runner changes to it), with the carried folders beside it:
#   bash bench/device/run.sh SUITE[:ARG] [SUITE[:ARG] ...]
# Suites run one after the other, each in its own shell; each logs to $OUT/SUITE (ARG appended:
# $OUT/hd256-time) and prints its own summary when it ends; the runner's summary (each suite's exit
# status and seconds) is printed last and the runner exits with the first non-zero status (a suite
# exits 0 unless it says otherwise below or cannot unpack its archive).
# Common to every suite: OUT (the folder that comes back; a fresh temporary folder when unset),
# $OUT/info.txt (GPU name, driver and power limit, start and phase times, versions),
# LD_LIBRARY_PATH with LIBS (a folder of shared libraries, if set), the carried folder's lib/ (where
# a suite unpacks one) and CUDA_HOME's lib64 and lib (default /usr/local/cuda), PYTHONUNBUFFERED=1,
# SCRATCH (work files that should not come back; default a temporary folder).
# DRY_RUN=1 prints the commands each suite would run (with the folder it runs them in) instead of
# running them; the carried folders need not exist.
#
# A carried folder holds an archive that bench/device/stage.sh makes (the kernels archive:
# `stage.sh kernels`; the service archive: `stage.sh service`) or one made by hand as below; its
# lib/ holds the libraries the binaries need that the machine lacks (`stage.sh libs`). A variable
# set for the call applies to every suite that reads it; the defaults are per suite.
#
# Kernel suites (K: the carried folder, ARCHIVE: its archive, default bundle.tar.xz):
#   kernels   K=build-kern; the kernels archive (libattngrad.so, attngrad_gpu_tests,
#             attngrad_attention_tests, attngrad_hopper_wgmma_tests, attngrad_bench,
#             attngrad_attention_bench, base/ with the benches of the build compared with, one
#             folder per VARIANTS name). In order, each phase's summary printed when it ends:
#             1. checks, all at once: the GPU tests (SHARDS shards, default 4), the attention tests
#                (ATTENTION_SHARDS, default 1), the wgmma tests, bench/check_torch.py (AUTO in
#                CHECK_ROUNDS rounds, default 3; FP16/TF32/FP32 with --mode-rounds MODE_ROUNDS,
#                default FP32=1; AUTO at grad_output scales 1e-7 and 3e4) and bench/check_gemma3.py
#                at SHAPES (default 1:1000,2:7), each within CHECK_LIMIT s (default 150);
#                CHECKS=0 skips them (A/B timing of builds already checked, never a recorded run);
#             2. attngrad_bench of this build, the VARIANTS and base, alternated ROUNDS times
#                (default 2), then --stages at STAGE_WORKLOADS (default 1:128,2:2048,16:256;
#                empty skips);
#             3. attngrad_attention_bench --time-only --fp16-only ATTENTION_FLAGS;
#             4. check_torch.py's timing of PyTorch (TORCH, default eager_tf32,compile_tf32;
#                TORCH=none skips it and the torch.compile warm-up beside phase 1) within
#                TORCH_LIMIT s (default 90).
#   ncu       K=build-kern; the kernels archive. Nsight Compute on bench/profile_backward.py per
#             WORKLOADS "B:S ..." (default "2:2048 4:128"): KERNELS (regex, default
#             Attention|KeyValue|Query|Short), COUNT kernels (default 6), NCU_LIMIT s (default
#             150); SOURCE (a kernel regex) also samples stalls per SASS instruction at the first
#             workload, the top SOURCE_TOP (default 60) in source_top.txt.
#   hd256[:PHASE]  K=build-k256; an archive with libattngrad.so, attngrad_gpu_tests,
#             attngrad_attention_tests, attngrad_bench, attngrad_bench_prev, lib/ and
#             check_gemma3.py. PHASE (default check):
#             check    head_dim 256 and other GPU/attention tests in 4 processes (TEST_LIMIT s,
#                      default 300) while check_gemma3.py checks at SHAPES (default
#                      1:1,2:7,1:1000,2:2500; MODELS, CHECK_LIMIT default 280); one A/B round;
#             time     check_gemma3.py --time --torch then --compile at TIME_SHAPES (default
#                      1:4096,4:1024,8:2048) for TIME_MODELS (default gemma-3-270m,gemma-3-1b,
#                      gemma-3-4b,gemma-3-12b) within TIME_LIMIT s (default 330); ROUNDS A/B
#                      rounds (default 1);
#             compile  one check_gemma3.py per (model, shape) of COMPILE_MODELS (default the five
#                      Gemma-3 sizes) x TIME_SHAPES, all compiling at once
#                      (TORCHINDUCTOR_COMPILE_THREADS=COMPILE_THREADS, default 2), timing one at a
#                      time (--timing-lock), all within TIME_LIMIT s (default 500);
#             all      check, then time.
#   prepared  K=build-prep; an archive with attngrad_gpu_tests, attngrad_server_gpu_test,
#             attngrad_bench, attngrad-server, attngrad-cli, attngrad-server-prev and lib/. The
#             prepared-weights GPU tests (TEST_LIMIT, default 150); attngrad_bench plain and
#             --prepared alternated ROUNDS times (default 2), --stages of both at 1x128 and 4x1024;
#             servers new, prev, new: attngrad-cli bench RETURN 1x128 one in flight and ACCUMULATE
#             4x1024 2 streams x 2 in flight for DURATION s (default 5).
#   gemma3    .carry/binaries.tar.xz unpacked into the checkout (build-h200/kernels/libattngrad.so,
#             build-h200/tests/gpu/*, build-h200/bench/attngrad_bench, .prev/attngrad_bench_*,
#             .carry/lib/): GPU and attention tests while check_gemma3.py checks at SHAPES
#             (default 1:1,2:7,1:1000,2:2500), check_gemma3.py --time at TIME_SHAPES (default
#             1:4096,4:1024) with TORCH_FLAG (default --torch), two rounds of this build's and the
#             previous build's attngrad_bench.
# Service suites (B: the carried folder, ARCHIVE: its archive; PY: a client/python tree laid out
# as the repository, with its generated stubs, tests/python and bench/cuda_ipc_bench.py, default
# $B/py). The carried server tests start attngrad-server (and the soak attngrad-cli) from the
# build directory they were compiled in: ROOT names it; unset, the runner reads $B/build_dir.txt
# (stage.sh service writes it) or the path compiled into attngrad_server_test, and copies the
# carried binaries there.
#   service[:PHASE]  B=build-svc; the service archive (svc.tar.xz). PHASE (default check):
#             check    in parallel: attngrad_server_test (SERVER_FILTER, default *; TEST_LIMIT s,
#                      default 420) and attngrad_server_wire_test on the GPU worker, the finite
#                      check's GPU tests, the offload-check suite (OFFLOAD_LIMIT s, default 420),
#                      scripts/soak.sh for SOAK_SECONDS (default 0: none); then attngrad-cli
#                      backward --check for each wire dtype pair;
#             service  one server on GPU 0: attngrad-cli bench beside attngrad_wire_ceiling
#                      (protobuf and ByteBuffer) for fp32/bf16 ACCUMULATE, fp32/bf16 RETURN at
#                      4x1024 for DURATION s (default 10), RETURN 1x128 one in flight; the
#                      server's CPU seconds per GB moved.
#   wire      B=build-wire; svc.tar.xz, optionally old-attngrad-server.xz and py/. Checks (CHECKS=0
#             skips; TEST_LIMIT, default 75): the server, wire and GPU server tests on the GPU
#             worker and PY's test_cuda_ipc; then one compact line per run of attngrad-cli bench
#             and the ceiling (D s each, default 3) on the new server, the server with
#             --stage_on_arrival=false and the old one; perf when installed; the bridge
#             (BRIDGE, default bridge,bridge_tcp; OLD_BRIDGE default bridge; BRIDGE_COUNT default
#             40). SHORT=1: only the main settings, no bridge; CEILINGS=main: the ceiling of the
#             main settings only; REGION_TESTS=1: the regions tests last.
#   svc       B=build-svc2; svc.tar.xz, main-attngrad-server.xz and main-attngrad-cli.xz (main's
#             binaries), optionally perf.tar.xz (perf/perf, perf/lib/), py/ and py-main/ (PY_MAIN).
#             CHECKS=0 skips the batch-path tests (TEST_LIMIT, default 40); A/B of this branch's CLI
#             and main's on one server, D s per run (default 2), AB_ROUNDS=2 repeats each pair in
#             the other order; the shared-memory path (SHM=0 skips) and the bridge; main's server
#             last. DEVICES, SHAPE, LATENCY_SHAPE, LATENCY_COUNT: a dry run against a CPU build.
#   cuda_ipc  B=build-ipcr, ARCHIVE=ipcr.tar.xz (svc.tar.xz works too; PY=. takes the checkout's
#             client, carry client/python/attngrad/v1): the regions tests on the GPU worker,
#             test_cuda_ipc, then bench/cuda_ipc_bench.py (BENCH_LIMIT s, default 150; DURATION,
#             default 8; CONFIGS, default 2x3,4x2).
#   bridge    B=build-bridge, ARCHIVE=bridge.tar.xz (attngrad-server, lib/, one client tree per
#             name in TREES, default "py-main py-new py-main py-new"): each tree's
#             cuda_ipc_bench.py --only=bridge,bridge_tcp --count=COUNT (default 40; --phases for
#             py-new*) within BENCH_LIMIT s (default 60) against one server, then TESTS (default
#             "test_cuda_ipc test_torch_bridge test_offload") of the last tree (TEST_LIMIT, 70).
# Offload and other suites (no archive; SERVER: the attngrad-server binary, default
# build-h200/server/attngrad-server; DEVICES: its --devices, default 0; LIBS for its libraries):
#   offload-check  client/python/examples/check_offload.py for each of CONFIGS (default
#             "270m:return 1b:accumulate"), STEPS (default 20), SEQ_LEN (default 128); exit 1 when
#             a check failed.
#   offload   bench/offload_bench.py --server SERVER --devices DEVICES, within OFFLOAD_LIMIT s
#             (default 540), with --configs OFFLOAD_CONFIGS, --shapes OFFLOAD_SHAPES, --steps
#             OFFLOAD_STEPS, --warmup OFFLOAD_WARMUP, --lr OFFLOAD_LR, --precision
#             OFFLOAD_PRECISION, --micro-batches OFFLOAD_MICRO_BATCHES, --seed OFFLOAD_SEED,
#             --timeout OFFLOAD_TIMEOUT where set, --compile, --remote, --spec-layer where
#             OFFLOAD_COMPILE, OFFLOAD_REMOTE, OFFLOAD_SPEC_LAYER are 1, then OFFLOAD_ARGS.
#   nccl[:DIR]  on two GPUs: the NCCL wrapper's tests and ServerNcclSumTest of DIR (a CUDA build
#             directory or a folder holding attngrad_server_test and attngrad_server_gpu_test;
#             default NCCL_BUILD or build-server-gpu), NCCL_NVLS_ENABLE=0; libnccl.so.2 on
#             LD_LIBRARY_PATH (LIBS). Exit 0 when it passed, 2 when skipped, 1 otherwise.
# E.g. K=build-x CHECK_ROUNDS=10 bash bench/device/run.sh kernels ncu

# Suites are called by name, run in subshells and quote commands for other shells:
# shellcheck disable=SC2317,SC2030,SC2031,SC2016,SC2129
set -u
RUNNER="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")"
cd "$(dirname "$RUNNER")/../.." || exit 1
REPO=$PWD
DRY_RUN=${DRY_RUN:-0}
export DRY_RUN
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}

usage() { sed -n '2,/^$/s/^# \{0,1\}//p' "$RUNNER"; }

# ---- helpers shared by the suites

dry() { [ "$DRY_RUN" = 1 ]; }
# Prints a command as a shell would read it (fd 3: the runner's output, whatever the suite's is).
say_cmd() {
  local line="+" where="" arg
  [ "$PWD" = "$REPO" ] || where=" (in ${PWD#"$REPO"/})"
  for arg in "$@"; do
    if [[ $arg =~ ^[A-Za-z0-9_./:=,+@%-]+$ ]]; then line+=" $arg"
    else line+=" '${arg//\'/\'\\\'\'}'"; fi
  done
  echo "$line$where" >&3
}
# Runs a command, or prints it under DRY_RUN=1.
run() {
  if dry; then say_cmd "$@"; return 0; fi
  "$@"
}
# DIR CMD...: the command in DIR (in a subshell).
in_dir() {
  local dir=$1
  shift
  if dry; then say_cmd "$@"; echo "  (in $dir)" >&3; return 0; fi
  (cd "$dir" && "$@")
}
# LOG CMD...: the command in the background, its output in LOG; its process id in SPAWNED.
spawn() {
  local log=$1
  shift
  if dry; then say_cmd "$@"; echo "  (in the background, output to $log)" >&3; sleep 0 & SPAWNED=$!
  else "$@" > "$log" 2>&1 & SPAWNED=$!; fi
}
stop() { kill -TERM "$1"; wait "$1"; }  # PID: SIGTERM, then its exit
pause() { dry || sleep "$1"; }
present() { dry || test "$@"; }  # a test(1) on a carried file; true under DRY_RUN=1
have_command() { dry || command -v "$1" > /dev/null; }
abs() { case $1 in /*) echo "$1" ;; *) echo "$REPO/$1" ;; esac; }
cpu_seconds_of() {  # PID: its user + system CPU seconds
  if [ -r "/proc/$1/stat" ]; then awk '{print ($14 + $15) / 100}' "/proc/$1/stat"; else echo 0; fi
}
mark() { date -u +"$SUITE $1 %T UTC" | tee -a "$INFO"; }
# DIR ARCHIVE: unpacks DIR/ARCHIVE into DIR and puts DIR/lib on LD_LIBRARY_PATH.
unpack() {
  local dir=$1 archive=$2
  if dry; then say_cmd tar -xJf "$dir/$archive" -C "$dir"
  else tar -xJf "$dir/$archive" -C "$dir" || { echo "cannot unpack $dir/$archive" >&2; return 1; }
  fi
  LD_LIBRARY_PATH="$(abs "$dir")/lib:$LD_LIBRARY_PATH"
  export LD_LIBRARY_PATH
}
# After unpack: what the suites that run $1/attngrad-server beside PyTorch clients share.
torch_clients() {
  SERVER_BINARY="$(abs "$1")/attngrad-server"
  export PYTHONDONTWRITEBYTECODE=1
  run python3 -c "import torch, grpc; print('torch', torch.__version__, 'grpcio', grpc.__version__)" \
    | tee -a "$INFO"
}
# SRC.xz DST: an executable decompressed.
unxz_exe() {
  if dry; then say_cmd xz -dc "$1"; echo "  (to $2)" >&3; return 0; fi
  xz -dc "$1" > "$2" && chmod +x "$2"
}
# DIR (the carried folder): copies DIR's attngrad-server and attngrad-cli to where the carried test
# programs start them: ROOT/server and ROOT/client/cli, ROOT being the build directory they were
# compiled in (ROOT, DIR/build_dir.txt, or the path compiled into DIR/attngrad_server_test).
place_for_tests() {
  local dir=$1 root=${ROOT:-}
  if [ -z "$root" ] && [ -f "$dir/build_dir.txt" ]; then root=$(cat "$dir/build_dir.txt"); fi
  if [ -z "$root" ] && [ -f "$dir/attngrad_server_test" ]; then
    root=$(grep -aoE '/[^[:cntrl:]]*/server/attngrad-server' "$dir/attngrad_server_test" | head -1)
    root=${root%/server/attngrad-server}
  fi
  if [ -z "$root" ]; then
    echo "ROOT unknown (set ROOT): the tests that start attngrad-server will not find it" |
      tee -a "$INFO"
    dry && root='$ROOT' || return 0
  fi
  echo "ROOT $root" | tee -a "$INFO"
  run mkdir -p "$root/server" "$root/client/cli"
  run cp "$dir/attngrad-server" "$root/server/"
  if present -f "$dir/attngrad-cli"; then run cp "$dir/attngrad-cli" "$root/client/cli/"; fi
}
# The service benches' time output (times(1): "0m1.5s 0m0.2s ...") in seconds.
seconds_of() { awk '{ n = split($0, t, " "); s = 0; for (i = 1; i <= n; ++i) {
  split(t[i], p, "m"); sub("s", "", p[2]); s += p[1] * 60 + p[2] } print s }'; }

# ---- kernel suites

suite_kernels() {
  K=${K:-build-kern}
  unpack "$K" "${ARCHIVE:-bundle.tar.xz}" || exit 1
  LIMIT=${CHECK_LIMIT:-150}
  if [ "${TORCH:-}" != none ]; then
    # torch.compile's first compilations (batch 1 and batch > 1: dynamic shapes specialise 1) run
    # beside the checks and fill the inductor and Triton caches that phase 4 then hits.
    (run timeout "$LIMIT" python3 bench/check_torch.py --lib "$K/libattngrad.so" --no-check \
       --torch compile_tf32 --workloads 1:128,2:128 --torch-warmup 1 --torch-iters 1 \
       > "$OUT/torch_prewarm.log" 2>&1) &
  fi

  if [ "${CHECKS:-1}" != 0 ]; then
    run_test() {  # $1 binary, $2 log, then the environment's shard variables
      (run timeout "$LIMIT" env "${@:3}" "$K/$1" > "$OUT/$2" 2>&1; echo "exit $?" >> "$OUT/$2") &
    }
    SHARDS=${SHARDS:-4}
    for shard in $(seq 0 $((SHARDS - 1))); do
      run_test attngrad_gpu_tests "gpu_tests_$shard.log" GTEST_TOTAL_SHARDS="$SHARDS" \
        GTEST_SHARD_INDEX="$shard"
    done
    ATTENTION_SHARDS=${ATTENTION_SHARDS:-1}
    for shard in $(seq 0 $((ATTENTION_SHARDS - 1))); do
      run_test attngrad_attention_tests "attention_tests_$shard.log" \
        GTEST_TOTAL_SHARDS="$ATTENTION_SHARDS" GTEST_SHARD_INDEX="$shard"
    done
    run_test attngrad_hopper_wgmma_tests wgmma_tests.log
    check() {  # $1 log, then check_torch.py's arguments
      local log=$1
      shift
      (run timeout "$LIMIT" python3 bench/check_torch.py --lib "$K/libattngrad.so" --no-time "$@" \
         > "$OUT/$log" 2>&1; echo "check $* exit $?" >> "$OUT/$log") &
    }
    check check_auto.log --rounds "${CHECK_ROUNDS:-3}" --modes AUTO
    check check_modes.log --rounds 1 --modes FP16,TF32,FP32 --mode-rounds "${MODE_ROUNDS:-FP32=1}"
    check check_scale_small.log --rounds 1 --modes AUTO --grad-output-scale 1e-7
    check check_scale_large.log --rounds 1 --modes AUTO --grad-output-scale 3e4
    (run timeout "$LIMIT" python3 bench/check_gemma3.py --lib "$K/libattngrad.so" \
       --shapes "${SHAPES:-1:1000,2:7}" > "$OUT/gemma3.log" 2>&1
     echo "gemma3 exit $?" >> "$OUT/gemma3.log") &
    wait
    mark "checks done"
    echo "==== checks"
    for f in "$OUT"/gpu_tests_*.log "$OUT"/attention_tests_*.log "$OUT"/wgmma_tests.log; do
      echo "-- $(basename "$f"): $(grep -E "^\[  PASSED|^exit" "$f" | tr '\n' ' ')"
      grep -E "^\[  FAILED  \]" "$f" | head -10
    done
    for f in "$OUT"/check_*.log "$OUT"/gemma3.log; do
      echo "-- $(basename "$f"): $(grep -E "^correctness|exit" "$f" | tr '\n' ' ')"
      grep -E "FAIL" "$f" | head -8
    done
    echo "gemma3 PASS lines: $(grep -c PASS "$OUT/gemma3.log")"
    tests=("$OUT"/gpu_tests_*.log "$OUT"/attention_tests_*.log "$OUT"/wgmma_tests.log
           "$OUT"/check_*.log "$OUT"/gemma3.log)
    cat "${tests[@]}" > "$OUT/checks_full.log"
    rm -f "${tests[@]}"
  else
    wait  # the torch.compile warm-up, if any
    echo "==== checks skipped (CHECKS=0)"
  fi

  builds="$K ${VARIANTS:+$(for v in $VARIANTS; do printf '%s ' "$K/$v"; done)}$K/base"
  for round in $(seq 1 "${ROUNDS:-2}"); do
    for build in $builds; do
      echo "==== bench $build round $round" >> "$OUT/bench.log"
      run timeout 90 "$build/attngrad_bench" >> "$OUT/bench.log" 2>&1
    done
  done
  if [ "${STAGE_WORKLOADS-1:128,2:2048,16:256}" != "" ]; then
    echo "==== stages" >> "$OUT/bench.log"
    run timeout 60 "$K/attngrad_bench" --stages --workloads="${STAGE_WORKLOADS-1:128,2:2048,16:256}" \
      >> "$OUT/bench.log" 2>&1
  fi
  mark "bench done"
  echo "==== bench"
  grep -E "^====|geomean" "$OUT/bench.log"

  # shellcheck disable=SC2086  # ATTENTION_FLAGS: several flags
  run timeout 60 "$K/attngrad_attention_bench" --time-only --fp16-only ${ATTENTION_FLAGS:-} \
    > "$OUT/attention_bench.log" 2>&1
  echo "==== attention"
  grep -E "geomean|^time fp16|^forward" "$OUT/attention_bench.log" | cut -c1-150 | head -40

  [ "${TORCH:-}" = none ] && exit 0
  run timeout "${TORCH_LIMIT:-90}" python3 bench/check_torch.py --lib "$K/libattngrad.so" --no-check \
    --torch "${TORCH:-eager_tf32,compile_tf32}" --torch-warmup 3 --torch-iters 10 \
    > "$OUT/torch_time.log" 2>&1
  echo "torch timing exit $?" >> "$OUT/torch_time.log"
  mark end
  echo "==== torch"
  grep -vE "^$" "$OUT/torch_time.log" | tail -24
}

suite_ncu() {
  K=${K:-build-kern}
  unpack "$K" "${ARCHIVE:-bundle.tar.xz}" || exit 1
  NCU=$(command -v ncu || echo "$CUDA_HOME/bin/ncu")
  for workload in ${WORKLOADS:-2:2048 4:128}; do
    batch=${workload%%:*}
    seq=${workload##*:}
    log="$OUT/ncu_${batch}_${seq}.txt"
    run timeout "${NCU_LIMIT:-150}" "$NCU" -k "regex:${KERNELS:-Attention|KeyValue|Query|Short}" \
      --launch-skip 0 --launch-count "${COUNT:-6}" \
      --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \
      --section SchedulerStats --section Occupancy --section LaunchStats \
      --metrics "regex:sm__inst_executed_pipe_.*\.avg\.pct_of_peak_sustained_active,regex:sm__pipe_.*_cycles_active\.avg\.pct_of_peak_sustained_active,regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
      python3 bench/profile_backward.py --lib "$K/libattngrad.so" --batch "$batch" --seq "$seq" \
      --calls 1 > "$log" 2>&1
    echo "ncu $workload exit $?" | tee -a "$log"
    grep -E "^  [A-Za-z].*\(|Duration|Compute \(SM\) Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Issue Slots Busy|Executed Ipc A" "$log" | head -80
  done
  if [ -n "${SOURCE:-}" ]; then
    first=${WORKLOADS:-2:2048}
    first=${first%% *}
    run timeout "${NCU_LIMIT:-150}" "$NCU" -k "regex:$SOURCE" --launch-skip 0 --launch-count 1 \
      --section SourceCounters --section WarpStateStats -f -o "$SCRATCH/source_report" \
      python3 bench/profile_backward.py --lib "$K/libattngrad.so" --batch "${first%%:*}" \
      --seq "${first##*:}" --calls 1 > "$OUT/source_profile.log" 2>&1
    run "$NCU" -i "$SCRATCH/source_report.ncu-rep" --page source --csv --print-source sass \
      > "$SCRATCH/source.csv" 2>> "$OUT/source_profile.log"
    run python3 bench/ncu_source_top.py "$SCRATCH/source.csv" --top "${SOURCE_TOP:-60}" \
      > "$OUT/source_top.txt" 2>&1
    head -c 4000 "$OUT/source_top.txt"
  fi
}

suite_hd256() {
  K=${K:-build-k256}
  PHASE=${1:-${PHASE:-check}}
  unpack "$K" "${ARCHIVE:-bundle.tar.xz}" || exit 1

  bench_ab() {  # $1 rounds: this build, then the previous one, alternating
    for round in $(seq 1 "$1"); do
      echo "==== new round $round" >> "$OUT/bench_ab.log"
      run "$K/attngrad_bench" >> "$OUT/bench_ab.log" 2>&1
      echo "==== prev round $round" >> "$OUT/bench_ab.log"
      run "$K/attngrad_bench_prev" >> "$OUT/bench_ab.log" 2>&1
    done
  }

  if [ "$PHASE" = check ] || [ "$PHASE" = all ]; then
    # head_dim 256 cases and the rest in separate processes (each test's float64 / CPU reference
    # takes seconds; 16 cores).
    run_test() {  # $1 binary, $2 gtest filter, $3 log
      (run timeout "${TEST_LIMIT:-300}" "$K/$1" --gtest_filter="$2" > "$OUT/$3" 2>&1
       echo "exit $?" >> "$OUT/$3") &
    }
    run_test attngrad_attention_tests '*D256*' attention_tests_256.log
    run_test attngrad_attention_tests '-*D256*' attention_tests_128.log
    run_test attngrad_gpu_tests '*Gemma3HeadDim256*' gpu_tests_256.log
    run_test attngrad_gpu_tests '-*Gemma3HeadDim256*' gpu_tests_128.log
    run timeout "${CHECK_LIMIT:-280}" python3 "$K/check_gemma3.py" --lib "$K/libattngrad.so" \
      --shapes "${SHAPES:-1:1,2:7,1:1000,2:2500}" ${MODELS:+--models "$MODELS"} \
      > "$OUT/check_gemma3.log" 2>&1
    echo "check exit $?" >> "$OUT/check_gemma3.log"
    wait
    mark "checks done"
    bench_ab 1
  fi
  if [ "$PHASE" = time ] || [ "$PHASE" = all ]; then
    # attngrad and eager TF32 for every model first (quick), then torch.compile (one compilation per
    # model) for as many models as TIME_LIMIT allows.
    for variant in --torch --compile; do
      echo "==== $variant" >> "$OUT/time_gemma3.log"
      run timeout "${TIME_LIMIT:-330}" python3 "$K/check_gemma3.py" --lib "$K/libattngrad.so" \
        --no-check --time --time-shapes "${TIME_SHAPES:-1:4096,4:1024,8:2048}" "$variant" \
        --models "${TIME_MODELS:-gemma-3-270m,gemma-3-1b,gemma-3-4b,gemma-3-12b}" \
        >> "$OUT/time_gemma3.log" 2>&1
      echo "time $variant exit $?" >> "$OUT/time_gemma3.log"
    done
    mark "gemma3 timing done"
    bench_ab "${ROUNDS:-1}"
  fi
  if [ "$PHASE" = compile ]; then
    local dir=$SCRATCH/compile
    rm -rf "$dir" && mkdir -p "$dir"
    export TORCHINDUCTOR_COMPILE_THREADS=${COMPILE_THREADS:-2}
    models=${COMPILE_MODELS:-gemma-3-270m,gemma-3-1b,gemma-3-4b,gemma-3-12b,gemma-3-27b}
    shapes=${TIME_SHAPES:-1:4096,4:1024,8:2048}
    jobs=$(( $(echo "$models" | tr , '\n' | wc -l) * $(echo "$shapes" | tr , '\n' | wc -l) ))
    # All jobs at once: each waits for every other to have compiled before it times.
    for model in ${models//,/ }; do
      for shape in ${shapes//,/ }; do
        echo "$model $shape"
        dry && echo "  job: $model $shape" >&3
      done
    done | run xargs -P "$jobs" -L 1 sh -c \
      'left=$(($0 - $(date +%s))); [ "$left" -gt 30 ] || exit 0
       timeout "$left" python3 "$1/check_gemma3.py" --lib "$1/libattngrad.so" \
         --no-check --time --torch --compile --models "$4" --time-shapes "$5" \
         --timing-lock "$3/lock" --ready-dir "$3" --ready-count "$2" \
         > "$3/$4-$5.log" 2>&1
       echo "exit $?" >> "$3/$4-$5.log"' $(($(date +%s) + ${TIME_LIMIT:-500})) "$K" "$jobs" "$dir"
    cat "$dir"/*.log > "$OUT/time_compile.log"
    mark "compile timing done"
  fi
  mark end

  echo "==== summary"
  for f in "$OUT"/attention_tests_*.log "$OUT"/gpu_tests_*.log; do
    [ -f "$f" ] && grep -E "^\[  (PASSED|FAILED) |^\[  FAILED  \]|^exit" "$f" | head -30
  done
  [ -f "$OUT/check_gemma3.log" ] && grep -E "FAIL|correctness|exit" "$OUT/check_gemma3.log" | head -30
  [ -f "$OUT/check_gemma3.log" ] && echo "PASS lines: $(grep -c PASS "$OUT/check_gemma3.log")"
  [ -f "$OUT/time_gemma3.log" ] && grep -E "^\||exit|====" "$OUT/time_gemma3.log"
  [ -f "$OUT/time_compile.log" ] && grep -E "^\| gemma|^compiled|exit|Error" "$OUT/time_compile.log"
  [ -f "$OUT/bench_ab.log" ] && grep -E "^====|geomean" "$OUT/bench_ab.log"
}

suite_prepared() {
  K=${K:-build-prep}
  ROUNDS=${ROUNDS:-2}
  unpack "$K" "${ARCHIVE:-bundle.tar.xz}" || exit 1

  (run timeout "${TEST_LIMIT:-150}" "$K/attngrad_gpu_tests" --gtest_filter='*Prepared*:FiniteCheck*:*MatchesCpuBackendOnSmall*:*TwoCalls*:*Graph*:*Concurrent*:*BadArguments*:*Errors*:*WithoutSoftCap*:*Accumulate*' \
     > "$OUT/gpu_tests.log" 2>&1; echo "exit $?" >> "$OUT/gpu_tests.log") &
  (run timeout "${TEST_LIMIT:-150}" "$K/attngrad_server_gpu_test" --gtest_filter='*ResidentWeights*:*FiniteSumsGpu*' \
     > "$OUT/server_gpu_tests.log" 2>&1; echo "exit $?" >> "$OUT/server_gpu_tests.log") &
  wait
  mark "tests done"

  for round in $(seq 1 "$ROUNDS"); do
    echo "==== plain round $round" >> "$OUT/bench.log"
    run timeout 120 "$K/attngrad_bench" >> "$OUT/bench.log" 2>&1
    echo "==== prepared round $round" >> "$OUT/bench.log"
    run timeout 120 "$K/attngrad_bench" --prepared >> "$OUT/bench.log" 2>&1
  done
  for variant in "" --prepared; do  # the plain path: no flag
    echo "==== stages $variant" >> "$OUT/bench.log"
    # shellcheck disable=SC2086
    run timeout 60 "$K/attngrad_bench" --stages --workloads=1:128,4:1024 $variant \
      >> "$OUT/bench.log" 2>&1
  done
  mark "bench done"

  serve() {  # $1 server binary, $2 label
    spawn "$OUT/server_$2.log" "$1" --devices=0 --listen=127.0.0.1:50051 --metrics_listen=
    local pid=$SPAWNED
    for _ in $(seq 1 60); do
      run "$K/attngrad-cli" info > /dev/null 2>&1 && break
      sleep 0.5
    done
    echo "==== $2: RETURN 1x128, 1 in flight" >> "$OUT/service.log"
    run timeout 60 "$K/attngrad-cli" bench --mode=return --batch=1 --seq_len=128 --channels=1 \
      --streams=1 --in_flight=1 --count=30 --warmup=3 --progress=false >> "$OUT/service.log" 2>&1
    echo "==== $2: ACCUMULATE 4x1024, 2 streams x 2 in flight" >> "$OUT/service.log"
    run timeout 60 "$K/attngrad-cli" bench --batch=4 --seq_len=1024 --channels=2 --streams=2 \
      --in_flight=2 --count=0 --duration_seconds="${DURATION:-5}" --progress=false \
      >> "$OUT/service.log" 2>&1
    stop "$pid"
  }
  serve "$K/attngrad-server" new
  serve "$K/attngrad-server-prev" prev
  serve "$K/attngrad-server" new2
  mark end

  echo "==== summary"
  for f in "$OUT"/gpu_tests.log "$OUT"/server_gpu_tests.log; do
    echo "--- $f"; grep -E "^\[  (PASSED|FAILED) |^\[  FAILED  \]|^exit|SKIPPED \]" "$f" | head -30
  done
  grep -E "^====|geomean|^ +1 +128|^ +4 +1024" "$OUT/bench.log"
  grep -E "^====|server +mean|throughput|errors" "$OUT/service.log"
}

suite_gemma3() {
  run tar -xJf .carry/binaries.tar.xz || exit 1
  # OpenBLAS (the CPU reference backend linked into the library) and its Fortran runtime travel too.
  export LD_LIBRARY_PATH="$REPO/.carry/lib:$LD_LIBRARY_PATH"

  (run build-h200/tests/gpu/attngrad_gpu_tests > "$OUT/gpu_tests.log" 2>&1
   echo "exit $?" >> "$OUT/gpu_tests.log"
   run build-h200/tests/gpu/attngrad_attention_tests > "$OUT/attention_tests.log" 2>&1
   echo "exit $?" >> "$OUT/attention_tests.log") &
  tests_pid=$!

  run python3 bench/check_gemma3.py --lib build-h200/kernels/libattngrad.so \
    --shapes "${SHAPES:-1:1,2:7,1:1000,2:2500}" > "$OUT/check_gemma3.log" 2>&1
  echo "check exit $?" >> "$OUT/check_gemma3.log"
  wait "$tests_pid"
  mark "checks done"

  # shellcheck disable=SC2086  # TORCH_FLAG: one flag or none
  run python3 bench/check_gemma3.py --lib build-h200/kernels/libattngrad.so --no-check --time \
    --time-shapes "${TIME_SHAPES:-1:4096,4:1024}" ${TORCH_FLAG:---torch} > "$OUT/time_gemma3.log" 2>&1
  mark "gemma3 timing done"

  # shellcheck disable=SC2012  # the first of one file
  PREV=$(ls .prev/attngrad_bench_* 2> /dev/null | head -1)
  PREV=${PREV:-.prev/attngrad_bench_COMMIT}
  for round in 1 2; do
    run build-h200/bench/attngrad_bench > "$OUT/bench_new_$round.log" 2>&1
    run "$PREV" > "$OUT/bench_prev_$round.log" 2>&1
  done
  mark "bench done"

  echo "==== summary"
  grep -E "^\[  (PASSED|FAILED) |FAILED|^exit" "$OUT/gpu_tests.log" "$OUT/attention_tests.log" | head -40
  grep -E "FAIL|skipped|correctness" "$OUT/check_gemma3.log" | head -30
  grep -c PASS "$OUT/check_gemma3.log"
  tail -4 "$OUT/check_gemma3.log"
  tail -8 "$OUT/time_gemma3.log"
  for f in "$OUT"/bench_*.log; do echo "$f: $(grep -i geomean "$f" | head -1)"; done
}

# ---- service suites

suite_service() {
  B=${B:-build-svc}
  PHASE=${1:-${PHASE:-check}}
  unpack "$B" "${ARCHIVE:-svc.tar.xz}" || exit 1

  if [ "$PHASE" = check ]; then
    place_for_tests "$B"
    (run env ATTNGRAD_TEST_DEVICES=0 timeout "${TEST_LIMIT:-420}" "$B/attngrad_server_test" \
       --gtest_filter="${SERVER_FILTER:-*}" > "$OUT/server_tests_gpu.log" 2>&1
     echo "exit $?" >> "$OUT/server_tests_gpu.log") &
    (run env ATTNGRAD_TEST_DEVICES=0 timeout 300 "$B/attngrad_server_wire_test" \
       > "$OUT/wire_tests_gpu.log" 2>&1
     echo "exit $?" >> "$OUT/wire_tests_gpu.log") &
    (run timeout 300 "$B/attngrad_gpu_tests" --gtest_filter='*Finite*' > "$OUT/finite_gpu.log" 2>&1
     echo "exit $?" >> "$OUT/finite_gpu.log") &
    (run env OUT="$OUT/offload" LIBS="$(abs "$B")/lib" SERVER="$B/attngrad-server" DEVICES=0 \
       timeout "${OFFLOAD_LIMIT:-420}" bash "$RUNNER" offload-check > "$OUT/offload.log" 2>&1
     echo "exit $?" >> "$OUT/offload.log") &
    if [ "${SOAK_SECONDS:-0}" -gt 0 ]; then
      run mkdir -p build-soak/tests/server build-soak/server
      run cp "$B/attngrad_soak_test" build-soak/tests/server/
      run cp "$B/attngrad-server" build-soak/server/
      (run timeout $((SOAK_SECONDS + 120)) scripts/soak.sh --duration "$SOAK_SECONDS" --devices 0 \
         --build-dir build-soak --csv "$OUT/soak_gpu.csv" > "$OUT/soak_gpu.log" 2>&1
       echo "exit $?" >> "$OUT/soak_gpu.log") &
    fi
    wait
    mark "checks done"
    # What each wire dtype does to SPEC section 4's check (the reference of the rounded input).
    spawn "$OUT/dtype_server.log" "$B/attngrad-server" --devices=0 --listen=127.0.0.1:50051 \
      --metrics_listen=
    SERVER_PID=$SPAWNED
    pause 8
    for dtypes in float32:float32 bfloat16:float32 float16:float32 float32:bfloat16 \
                  bfloat16:bfloat16 float16:float16; do
      echo "==== input ${dtypes%%:*} response ${dtypes##*:}" >> "$OUT/dtype_check.log"
      run "$B/attngrad-cli" backward --check --batch=2 --seq_len=600 --mode=return \
        --input_dtype="${dtypes%%:*}" --response_dtype="${dtypes##*:}" \
        >> "$OUT/dtype_check.log" 2>&1
    done
    stop "$SERVER_PID"
  fi

  if [ "$PHASE" = service ]; then
    # 16 GiB in-flight budget: 8 streams x 2 in flight of 4x1024 RETURN batches hold ~4 GB.
    spawn "$OUT/server.log" "$B/attngrad-server" --devices=0 --listen=127.0.0.1:50051 \
      --metrics_listen= --max_inflight_bytes=17179869184
    SERVER_PID=$SPAWNED
    pause 8
    D=${DURATION:-10}
    A="--batch=4 --seq_len=1024 --in_flight=2 --count=0 --duration_seconds=$D"
    W="$B/attngrad_wire_ceiling"
    pair() {  # $1 label, then flags for both programs
      label=$1; shift
      echo "==== $label: $*" | tee -a "$OUT/service.log"
      before=$(cpu_seconds_of "$SERVER_PID")
      run "$B/attngrad-cli" bench "$@" >> "$OUT/service.log" 2>&1
      # Server CPU per GB moved: its CPU seconds over this bench / the bench's bytes (warm-up in
      # both).
      used=$(awk -v a="$(cpu_seconds_of "$SERVER_PID")" -v b="$before" 'BEGIN { print a - b }')
      moved=$(grep -E "^  moved " "$OUT/service.log" | tail -1 | awk '{print $2}')
      echo "server CPU seconds: $used, $(awk -v c="$used" -v g="${moved:-0}" \
        'BEGIN { if (g > 0) printf "%.3f", c / g; else print "?" }') CPU s per GB moved ($moved GB)" \
        >> "$OUT/service.log"
      run "$W" "$@" --json >> "$OUT/service.log" 2>&1
      run "$W" "$@" --transport=bytebuffer --json >> "$OUT/service.log" 2>&1
    }
    # shellcheck disable=SC2086  # A: several flags
    {
      pair "fp32 ACCUMULATE 4 streams 1 channel" $A --streams=4 --channels=1
      pair "fp32 ACCUMULATE 8 streams 8 channels" $A --streams=8 --channels=8
      pair "bf16 ACCUMULATE 8 streams 8 channels" $A --streams=8 --channels=8 \
        --input_dtype=bfloat16 --response_dtype=bfloat16
      pair "fp32 RETURN 8 streams 8 channels" $A --streams=8 --channels=8 --mode=return
      pair "bf16 RETURN 8 streams 8 channels" $A --streams=8 --channels=8 --mode=return \
        --input_dtype=bfloat16 --response_dtype=bfloat16
    }
    pair "latency RETURN 1x128, 1 in flight" --mode=return --batch=1 --seq_len=128 --channels=1 \
      --streams=1 --in_flight=1 --count=100
    stop "$SERVER_PID"
  fi
  mark end

  echo "==== summary"
  for f in "$OUT"/server_tests_gpu.log "$OUT"/wire_tests_gpu.log "$OUT"/finite_gpu.log; do
    [ -f "$f" ] && { echo "--- $f"; grep -E "^\[  (PASSED|FAILED) |^\[  FAILED  \]|^exit|SKIPPED \]" "$f" | head -40; }
  done
  [ -f "$OUT/offload.log" ] && { echo "--- offload"; tail -30 "$OUT/offload.log"; }
  [ -f "$OUT/soak_gpu.log" ] && { echo "--- soak"; tail -15 "$OUT/soak_gpu.log"; }
  [ -f "$OUT/dtype_check.log" ] && grep -E "^====|check|PASS|FAIL" "$OUT/dtype_check.log" | head -40
  # Compact: the bench's throughput, latency and server stage lines and the ceiling's tokens/s, p50
  # and CPU (the wire suite prints one line per run).
  [ -f "$OUT/service.log" ] && grep -vE "^\s*$" "$OUT/service.log" |
    grep -E "====|throughput|^  latency|^  server|server CPU|\{" |
    sed -E 's/"(channels|streams|in_flight|batch|seq_len|mode|input_dtype|response_dtype|rotary|hidden_size|num_heads|num_kv_heads|head_dim|batches|tokens|seconds|request_bytes|response_bytes|request_bytes_per_batch|response_bytes_per_batch|request_gb_per_second|response_gb_per_second|p90_seconds|p99_seconds|max_seconds|server_received_bytes|server_sent_bytes|server_batches|server_cpu_seconds|client_cpu_seconds|errors|first_error)":("[^"]*"|[^,}]*),?//g' |
    cut -c1-300
}

suite_wire() {
  B=${B:-build-wire}
  PY=${PY:-$B/py}
  D=${D:-3}
  unpack "$B" "${ARCHIVE:-svc.tar.xz}" || exit 1
  W=$SCRATCH/wire_logs
  mkdir -p "$W"
  CLI="$(abs "$B")/attngrad-cli"
  CEILING="$(abs "$B")/attngrad_wire_ceiling"
  NEW="$(abs "$B")/attngrad-server"
  OLD="$(abs "$B")/old-attngrad-server"
  if present -f "$OLD.xz"; then unxz_exe "$OLD.xz" "$OLD"; fi
  echo "cores $(nproc), perf: $(command -v perf || echo none)" | tee -a "$INFO"

  # 1. Checks, in parallel: the copy-free path, regions and memory budget tests, the server tests
  #    and the GPU server tests on the GPU worker, and the CUDA IPC tests of the Python client.
  place_for_tests "$B"
  if [ "${CHECKS:-1}" = 1 ]; then
    LIMIT=${TEST_LIMIT:-75}
    for test in attngrad_server_wire_test attngrad_server_test attngrad_server_gpu_test; do
      (run env ATTNGRAD_TEST_DEVICES=0 timeout "$LIMIT" "$B/$test" > "$W/$test.log" 2>&1
       echo "exit $?" >> "$W/$test.log") &
    done
    (in_dir "$PY/tests/python" env ATTNGRAD_SERVER="$NEW" timeout "$LIMIT" \
       python3 -m unittest -v test_cuda_ipc > "$W/test_cuda_ipc.log" 2>&1
     echo "exit $?" >> "$W/test_cuda_ipc.log") &
    wait
    mark "checks done"
    for f in "$W"/*.log; do
      echo "--- $(basename "$f")"
      grep -E "^\[  PASSED|^\[  FAILED|^exit|^Ran |^OK|^FAILED|Error:" "$f" | head -20
    done | tee "$OUT/checks.txt"
    cat "$W"/*.log > "$OUT/checks_full.log"
  fi

  # 2. Timing. One server at a time on GPU 0; attngrad-cli bench then the ceiling of the same bytes.
  serve() {  # $1 label, $2 server binary, then its extra flags
    local label=$1 binary=$2
    shift 2
    spawn "$W/server_$label.log" "$binary" --devices=0 --listen=127.0.0.1:50051 \
      --metrics_listen= --max_inflight_bytes=17179869184 "$@"
    SERVER_PID=$SPAWNED
    for _ in $(seq 1 80); do run "$CLI" info > /dev/null 2>&1 && break; sleep 0.25; done
    SERVER_LABEL=$label
  }
  unserve() { stop "$SERVER_PID"; }
  A="--batch=4 --seq_len=1024 --in_flight=2 --count=0 --duration_seconds=$D"
  bench() {  # $1 label, then the flags of both programs
    RUN=$((RUN + 1))
    local label=$1 before log=$W/bench_$RUN.log
    shift
    before=$(cpu_seconds_of "$SERVER_PID")
    ( run "$CLI" bench --progress=false "$@" > "$log" 2>&1; times > "$log.times" )
    local used client moved
    used=$(awk -v a="$(cpu_seconds_of "$SERVER_PID")" -v b="$before" 'BEGIN { print a - b }')
    client=$(tail -1 "$log.times" | seconds_of)
    moved=$(awk '/^  moved /{print $2}' "$log")
    awk -v label="$SERVER_LABEL $label" -v used="$used" -v client="$client" -v moved="${moved:-0}" '
      /throughput/ { tokens = $2 }
      /^  latency/ { p50 = $3 }
      /^  server / { gsub(",", ""); q = $7 * 1e3; ci = $9 * 1e3; c = $11 * 1e3; co = $13 * 1e3 }
      /^  errors/ { errors = $2 }
      END { printf "A %-34s %9.0f tok/s p50 %.4f s | ms queue %.1f in %.1f compute %.1f out %.1f | CPU s/GB server %.3f client %.3f | errors %s\n",
            label, tokens, p50, q, ci, c, co, (moved > 0 ? used / moved : -1),
            (moved > 0 ? client / moved : -1), errors }' "$log" | tee -a "$OUT/timing.txt"
    grep -E "^  (throughput|latency|server|errors)" "$log" | cut -c1-160 >> "$OUT/bench_raw.txt"
    if [ "${CEIL:-1}" = 1 ] && { [ "${CEILINGS:-all}" = all ] || [ "${MAIN:-0}" = 1 ]; }; then
      run "$CEILING" "$@" --transport=bytebuffer 2>&1 | grep -o "[0-9]* batches in.*" |
        sed -E 's/ \(([0-9]+) B\/batch\)//g; s/, errors 0$//' |
        awk -v label="$label" '{ printf "C %-34s %s\n", "ceiling " label, $0 }' |
        tee -a "$OUT/timing.txt"
    fi
  }
  F8="--streams=8 --channels=8"
  RUN=0
  # shellcheck disable=SC2086  # A, F8: several flags each
  {
    serve new "$NEW"
    [ "${SHORT:-0}" = 1 ] || bench "fp32 ACC 4x1 conn" $A --streams=4 --channels=1
    MAIN=1 bench "fp32 ACC 8/8" $A $F8
    MAIN=1 bench "bf16 ACC 8/8" $A $F8 --input_dtype=bfloat16 --response_dtype=bfloat16
    MAIN=1 bench "fp32 RET 8/8" $A $F8 --mode=return
    [ "${SHORT:-0}" = 1 ] ||
      bench "bf16 RET 8/8" $A $F8 --mode=return --input_dtype=bfloat16 --response_dtype=bfloat16
    MAIN=1 bench "RET 1x128 1 in flight" --mode=return --batch=1 --seq_len=128 --channels=1 \
      --streams=1 --in_flight=1 --count=100
    if have_command perf; then  # where the server's CPU goes at 8 connections
      spawn /dev/null perf record -F 499 -g -p "$SERVER_PID" -o "$W/perf.data" -- sleep "$D"
      PERF_PID=$SPAWNED
      CEIL=0 bench "fp32 ACC 8/8 (perf)" $A $F8
      wait "$PERF_PID"
      run perf report -i "$W/perf.data" --no-children --sort dso,sym --stdio 2> /dev/null |
        grep -vE "^#|^$" | grep -E "^ +[0-9]" | head -40 > "$OUT/perf.txt"
    fi
    bridge() {  # $1: what to time (cuda_ipc_bench.py --only)
      present -d "$PY/bench" && [ "${SHORT:-0}" != 1 ] || return
      run timeout 90 python3 "$PY/bench/cuda_ipc_bench.py" --only="$1" --count="${BRIDGE_COUNT:-40}" \
        2>&1 | grep -E "^\{|Error" | cut -c1-200 | sed "s/^/B $SERVER_LABEL /" | tee -a "$OUT/timing.txt"
    }
    bridge "${BRIDGE:-bridge,bridge_tcp}"
    unserve
    CEIL=0
    serve nostage "$NEW" --stage_on_arrival=false
    bench "fp32 ACC 8/8" $A $F8
    [ "${SHORT:-0}" = 1 ] || bench "fp32 RET 8/8" $A $F8 --mode=return
    unserve
    if present -x "$OLD"; then
      serve old "$OLD"
      bench "fp32 ACC 8/8" $A $F8
      [ "${SHORT:-0}" = 1 ] || bench "fp32 RET 8/8" $A $F8 --mode=return
      bridge "${OLD_BRIDGE:-bridge}"
      unserve
    fi
  }
  if [ "${REGION_TESTS:-0}" = 1 ]; then  # the regions tests on the GPU worker, in 3 shards
    for shard in 0 1 2; do
      (run env ATTNGRAD_TEST_DEVICES=0 GTEST_TOTAL_SHARDS=3 GTEST_SHARD_INDEX="$shard" timeout 40 \
         "$B/attngrad_server_wire_test" --gtest_filter='Regions*' > "$W/regions_$shard.log" 2>&1
       echo "exit $?" >> "$W/regions_$shard.log") &
    done
    wait
    grep -hE "^\[       OK|^\[  FAILED|^exit|Failure" "$W"/regions_*.log | cut -c1-120 |
      tee -a "$OUT/checks.txt"
  fi
  mark end
  for f in "$W"/server_*.log; do grep -iE "error|fatal|abort" "$f" | head -3; done
  echo "==== checks"; cat "$OUT/checks.txt" 2> /dev/null
  echo "==== timing"; cat "$OUT/timing.txt"
}

suite_svc() {
  B=${B:-build-svc2}
  PY=${PY:-$B/py}
  PY_MAIN=${PY_MAIN:-$B/py-main}
  D=${D:-2}
  unpack "$B" "${ARCHIVE:-svc.tar.xz}" || exit 1
  W=$SCRATCH/svc_logs
  mkdir -p "$W"
  CLI="$(abs "$B")/attngrad-cli"
  CEILING="$(abs "$B")/attngrad_wire_ceiling"
  NEW="$(abs "$B")/attngrad-server"
  for f in main-attngrad-server main-attngrad-cli; do
    if present -f "$B/$f.xz"; then unxz_exe "$B/$f.xz" "$B/$f"; fi
  done
  MAIN_SERVER="$(abs "$B")/main-attngrad-server"
  MAIN_CLI="$(abs "$B")/main-attngrad-cli"
  PERF=()
  if present -f "$B/perf.tar.xz" && run tar -xJf "$B/perf.tar.xz" -C "$B"; then
    PERF=(env "LD_LIBRARY_PATH=$(abs "$B")/perf/lib" "$(abs "$B")/perf/perf")
  fi
  echo "cores $(nproc), perf: ${PERF[*]:-none}" | tee -a "$INFO"

  if [ "${CHECKS:-1}" = 1 ]; then  # the server's batch path on the GPU worker, in parallel
    place_for_tests "$B"
    LIMIT=${TEST_LIMIT:-40}
    (run env ATTNGRAD_TEST_DEVICES=0 timeout "$LIMIT" "$B/attngrad_server_wire_test" \
       --gtest_filter='ServerCopyFreePathTest*:ServerWireIntegrityTest*:ReceivedBackward*' \
       > "$W/wire_test.log" 2>&1; echo "exit $?" >> "$W/wire_test.log") &
    (run env ATTNGRAD_TEST_DEVICES=0 timeout "$LIMIT" "$B/attngrad_server_test" \
       --gtest_filter='ServerBackwardTest*:ServerGradientsTest*:ServerBadInputTest*' \
       > "$W/server_test.log" 2>&1; echo "exit $?" >> "$W/server_test.log") &
    present -x "$B/attngrad_server_gpu_test" &&
      (run env ATTNGRAD_TEST_DEVICES=0 timeout "$LIMIT" "$B/attngrad_server_gpu_test" \
         > "$W/server_gpu_test.log" 2>&1; echo "exit $?" >> "$W/server_gpu_test.log") &
    wait
    for f in "$W"/*_test.log; do
      echo "--- $(basename "$f"): $(grep -E "^\[  PASSED|^\[  FAILED|^\[  SKIPPED|^exit" "$f" |
        tr '\n' ' ')"
      grep -E "^\[  FAILED|Failure" "$f" | head -5
    done | tee "$OUT/checks.txt"
  fi

  serve() {  # $1 label, $2 server binary
    spawn "$W/server_$1.log" "$2" --devices="${DEVICES:-0}" --listen=127.0.0.1:50051 \
      --metrics_listen= --max_inflight_bytes=17179869184
    SERVER_PID=$SPAWNED
    for _ in $(seq 1 80); do run "$CLI" info > /dev/null 2>&1 && break; sleep 0.25; done
    SERVER_LABEL=$1
  }
  unserve() { stop "$SERVER_PID"; }
  A="${SHAPE:---batch=4 --seq_len=1024} --in_flight=2 --count=0 --duration_seconds=$D"
  F8="--streams=8 --channels=8"
  RUN=0
  bench() {  # $1 label, $2 cli binary, then the flags of both programs; CEIL=1: the ceiling after
    RUN=$((RUN + 1))
    local label=$1 cli=$2 before log=$W/bench_$RUN.log
    shift 2
    before=$(cpu_seconds_of "$SERVER_PID")
    ( run "$cli" bench --progress=false "$@" > "$log" 2>&1; times > "$log.times" )
    local used client moved
    used=$(awk -v a="$(cpu_seconds_of "$SERVER_PID")" -v b="$before" 'BEGIN { print a - b }')
    client=$(tail -1 "$log.times" | seconds_of)
    moved=$(awk '/^  moved /{print $2}' "$log")
    awk -v label="$SERVER_LABEL $label" -v used="$used" -v client="$client" -v moved="${moved:-0}" '
      /throughput/ { tokens = $2 }
      /^  latency/ { p50 = $3 }
      /^  server / { gsub(",", ""); q = $7 * 1e3; ci = $9 * 1e3; c = $11 * 1e3; co = $13 * 1e3 }
      /^  client CPU/ { timed = $3 }
      /^  errors/ { errors = $2 }
      END { if (moved <= 0) moved = -1
            printf "A %-30s %8.0f tok/s p50 %.4f | ms q %.1f in %.1f c %.1f out %.1f | s/GB server %.3f client %.3f (timed %s) | err %s\n",
            label, tokens, p50, q, ci, c, co, used / moved, client / moved, timed, errors }' "$log" |
      tee -a "$OUT/timing.txt"
    if [ "${CEIL:-0}" = 1 ]; then
      run "$CEILING" "$@" --transport=bytebuffer 2>&1 | grep -o "[0-9]* batches in.*" |
        sed -E 's/ \(([0-9]+) B\/batch\)//g; s/, errors 0$//' |
        awk -v label="$label" '{ printf "C %-30s %s\n", "ceiling " label, $0 }' |
        tee -a "$OUT/timing.txt"
    fi
  }
  python_bench() {  # $1 what (cuda_ipc_bench.py --only), then its flags; PY: the client tree
    local what=$1
    shift
    present -d "$PY/bench" || return
    run timeout 75 python3 "$PY/bench/cuda_ipc_bench.py" --only="$what" "$@" 2>&1 |
      grep -E "^\{|Error" | cut -c1-220 | sed "s|^|P $SERVER_LABEL $(basename "$PY") |" |
      tee -a "$OUT/timing.txt"
  }
  ab() {  # $1 label, then the flags: the branch's CLI (the bare stream after it), then main's
    local label=$1
    shift
    CEIL=1 bench "$label" "$CLI" "$@"
    bench "$label main-cli" "$MAIN_CLI" "$@"
    if [ "${AB_ROUNDS:-1}" -ge 2 ]; then
      bench "$label main-cli (2nd)" "$MAIN_CLI" "$@"
      bench "$label (2nd)" "$CLI" "$@"
    fi
  }
  # shellcheck disable=SC2086  # A, F8, LATENCY_SHAPE: several flags each
  {
    serve new "$NEW"
    ab "fp32 ACC 8/8" $A $F8
    ab "bf16 ACC 8/8" $A $F8 --input_dtype=bfloat16 --response_dtype=bfloat16
    ab "fp32 RET 8/8" $A $F8 --mode=return
    CEIL=1 bench "RET 1x128 1 in flight" "$CLI" --mode=return \
      ${LATENCY_SHAPE:---batch=1 --seq_len=128} --channels=1 --streams=1 --in_flight=1 \
      --count=${LATENCY_COUNT:-100}
    if [ ${#PERF[@]} -gt 0 ]; then  # where the server's CPU goes at 8 connections
      spawn "$W/perf_record.log" "${PERF[@]}" record -F 499 -g -p "$SERVER_PID" -o "$W/perf.data" \
        -- sleep "$D"
      PERF_PID=$SPAWNED
      bench "fp32 ACC 8/8 (perf)" "$CLI" $A $F8
      wait "$PERF_PID"
      tail -2 "$W/perf_record.log"
      run "${PERF[@]}" report -i "$W/perf.data" --no-children --sort dso,sym --stdio 2> /dev/null |
        grep -E "^ +[0-9]" | head -45 > "$OUT/perf.txt"
      run "${PERF[@]}" report -i "$W/perf.data" --no-children --sort sym -g caller,0.5,callee \
        --stdio 2> /dev/null | grep -vE "^#|^$" | head -300 > "$OUT/perf_callers.txt"
    fi
    [ "${SHM:-1}" = 1 ] && python_bench shm --configs=8x2,4x2 --warmup=2 --duration=3
    python_bench bridge,bridge_tcp --count=40
    present -d "$PY_MAIN/bench" && PY=$PY_MAIN python_bench bridge_tcp --count=40
    unserve
    serve main "$MAIN_SERVER"
    bench "fp32 ACC 8/8 main-cli" "$MAIN_CLI" $A $F8
    bench "fp32 RET 8/8 main-cli" "$MAIN_CLI" $A $F8 --mode=return
    unserve
  }
  mark end
  for f in "$W"/server_*.log; do grep -iE "error|fatal|abort" "$f" | head -3; done
  echo "==== checks"; cat "$OUT/checks.txt" 2> /dev/null
  echo "==== timing"; cat "$OUT/timing.txt"
  echo "==== perf"; head -30 "$OUT/perf.txt" 2> /dev/null
}

suite_cuda_ipc() {
  B=${B:-build-ipcr}
  PY=${PY:-$B/py}
  unpack "$B" "${ARCHIVE:-ipcr.tar.xz}" || exit 1
  torch_clients "$B"

  (run env ATTNGRAD_TEST_DEVICES=0 timeout 120 "$B/attngrad_server_wire_test" \
     --gtest_filter='Regions*' > "$OUT/regions_gpu.log" 2>&1
   echo "exit $?" >> "$OUT/regions_gpu.log")
  (in_dir "$PY/tests/python" env ATTNGRAD_SERVER="$SERVER_BINARY" timeout 180 \
     python3 -m unittest -v test_cuda_ipc > "$OUT/test_cuda_ipc.log" 2>&1
   echo "exit $?" >> "$OUT/test_cuda_ipc.log")
  mark "tests done"

  spawn "$OUT/server.log" "$B/attngrad-server" --devices=0 --listen=127.0.0.1:50051 \
    --metrics_listen=
  SERVER_PID=$SPAWNED
  run timeout "${BENCH_LIMIT:-150}" python3 "$PY/bench/cuda_ipc_bench.py" \
    --target=127.0.0.1:50051 --duration="${DURATION:-8}" --configs="${CONFIGS:-2x3,4x2}" \
    --json="$OUT/bench.json" > "$OUT/bench.log" 2>&1
  echo "exit $?" >> "$OUT/bench.log"
  stop "$SERVER_PID"
  mark end

  echo "==== summary"
  grep -E "^\[  (PASSED|FAILED) |^\[  FAILED  \]|^exit" "$OUT/regions_gpu.log"
  grep -E "^test_|^Ran|^OK|^FAILED|Error|exit" "$OUT/test_cuda_ipc.log" | head -30
  tail -20 "$OUT/bench.log"
}

suite_bridge() {
  B=${B:-build-bridge}
  TREES=${TREES:-"py-main py-new py-main py-new"}
  COUNT=${COUNT:-40}
  unpack "$B" "${ARCHIVE:-bridge.tar.xz}" || exit 1
  torch_clients "$B"

  spawn "$OUT/server.log" "$SERVER_BINARY" --devices=0 --listen=127.0.0.1:50051 \
    --metrics_listen= --shutdown_grace_seconds=2
  SERVER_PID=$SPAWNED
  run=0
  for tree in $TREES; do
    run=$((run + 1))
    phases=()
    case "$tree" in py-new*) phases=(--phases) ;; esac
    run timeout "${BENCH_LIMIT:-60}" python3 "$B/$tree/bench/cuda_ipc_bench.py" \
      --target=127.0.0.1:50051 --client_id="bridge-$tree" --only=bridge,bridge_tcp \
      --count="$COUNT" "${phases[@]}" --json="$OUT/bridge-$run-$tree.json" \
      > "$OUT/bridge-$run-$tree.log" 2>&1
    echo "exit $?" >> "$OUT/bridge-$run-$tree.log"
  done
  stop "$SERVER_PID"
  last_tree=${TREES##* }
  for t in ${TESTS-test_cuda_ipc test_torch_bridge test_offload}; do
    (in_dir "$B/$last_tree/tests/python" env ATTNGRAD_SERVER="$SERVER_BINARY" \
       timeout "${TEST_LIMIT:-70}" python3 -m unittest -v "$t" > "$OUT/$t.log" 2>&1
     echo "exit $?" >> "$OUT/$t.log")
  done
  mark end

  echo "==== summary"
  for t in ${TESTS-test_cuda_ipc test_torch_bridge test_offload}; do
    echo "-- $t"
    grep -E "^test_.*(ok|FAIL|ERROR|skipped.*)$|^Ran|^OK|^FAILED|^exit" "$OUT/$t.log" | head -30
  done
  run=0
  for tree in $TREES; do
    run=$((run + 1))
    echo "-- run $run $tree"
    grep -vE "^\s*$" "$OUT/bridge-$run-$tree.log" | tail -6
  done
}

# ---- offload and other suites

suite_offload_check() {
  SERVER=${SERVER:-build-h200/server/attngrad-server}
  DEVICES=${DEVICES:-0}
  run python3 -c "import torch, transformers, grpc; print('torch', torch.__version__, 'transformers',
transformers.__version__, 'grpcio', grpc.__version__)" | tee "$OUT/versions.txt"
  status=0
  for item in ${CONFIGS:-270m:return 1b:accumulate}; do
    config=${item%%:*}
    mode=${item##*:}
    log="$OUT/offload_${config}_${mode}.log"
    mark "start $config $mode"
    run python3 client/python/examples/check_offload.py --server "$SERVER" --devices "$DEVICES" \
      --config "$config" --mode "$mode" --steps "${STEPS:-20}" --seq-len "${SEQ_LEN:-128}" \
      > "$log" 2>&1 || status=1
  done
  mark "done"
  echo "==== summary"
  for log in "$OUT"/offload_*.log; do
    echo "--- $log"
    grep -E "^Gemma-3|^\| |^RESULT" "$log" || tail -20 "$log"
  done
  exit "$status"
}

suite_offload() {
  local args=(--server "${SERVER:-build-h200/server/attngrad-server}" --devices "${DEVICES:-0}")
  local pair variable flag
  for pair in CONFIGS:--configs SHAPES:--shapes STEPS:--steps WARMUP:--warmup LR:--lr \
              PRECISION:--precision MICRO_BATCHES:--micro-batches SEED:--seed TIMEOUT:--timeout; do
    variable=OFFLOAD_${pair%%:*}
    flag=${pair#*:}
    if [ -n "${!variable:-}" ]; then args+=("$flag" "${!variable}"); fi
  done
  for pair in COMPILE:--compile REMOTE:--remote SPEC_LAYER:--spec-layer; do
    variable=OFFLOAD_${pair%%:*}
    if [ "${!variable:-0}" = 1 ]; then args+=("${pair#*:}"); fi
  done
  # shellcheck disable=SC2206  # OFFLOAD_ARGS: more flags, split at spaces
  args+=(${OFFLOAD_ARGS:-})
  run python3 -c "import torch, transformers, grpc; print('torch', torch.__version__, 'transformers',
transformers.__version__, 'grpcio', grpc.__version__)" | tee -a "$INFO"
  run timeout "${OFFLOAD_LIMIT:-540}" python3 bench/offload_bench.py "${args[@]}" \
    > "$OUT/offload_bench.log" 2>&1
  status=$?
  echo "exit $status" >> "$OUT/offload_bench.log"
  mark end
  echo "==== summary"
  grep -E "^#|^\||Error|^exit" "$OUT/offload_bench.log" | tail -80
  exit "$status"
}

suite_nccl() {
  local build=${1:-${NCCL_BUILD:-build-server-gpu}}
  # NVLink multicast stays off (it can take a shared host's GPUs out of service; ncclReduce needs
  # none).
  export NCCL_NVLS_ENABLE=0
  export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
  echo "nccl-check: $(date -u +%FT%TZ) $(git rev-parse --short HEAD 2> /dev/null || echo '?') build=$build"
  command -v nvidia-smi > /dev/null && run nvidia-smi -L
  echo "nccl-check: LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"

  status=0
  bindir="$build/tests/server"
  [[ -x "$bindir/attngrad_server_gpu_test" ]] || bindir="$build"
  unit="$bindir/attngrad_server_test"
  if present -x "$unit"; then
    run "$unit" --gtest_filter='NcclLibraryTest.*' --gtest_color=no || status=1
  else
    echo "nccl-check: $unit not built (cmake --build $build --target attngrad_server_test)"
    status=1
  fi
  gpu="$bindir/attngrad_server_gpu_test"
  if ! present -x "$gpu"; then
    echo "nccl-check: $gpu not built (cmake --build $build --target attngrad_server_gpu_test)"
    echo "nccl-check: RESULT FAIL (not built)"
    exit 1
  fi
  log="$OUT/nccl_sum.log"
  run "$gpu" --gtest_filter='ServerNcclSumTest.*' --gtest_color=no 2>&1 | tee "$log"
  gpu_rc=${PIPESTATUS[0]}
  if [[ $gpu_rc -ne 0 ]]; then
    result="FAIL (exit $gpu_rc)"
    status=1
  elif grep -q '^\[  SKIPPED \]' "$log"; then
    result="SKIPPED: $(grep -m1 -A1 ': Skipped$' "$log" | tail -1)"
    [[ $status -eq 0 ]] && status=2
  elif grep -q '^\[  PASSED  \] 1 test' "$log"; then
    result="PASS"
  else
    result="UNKNOWN (no test ran?)"
    status=1
  fi
  [[ $status -eq 1 && $result == PASS ]] && result="PASS (but NcclLibraryTest failed)"
  echo "nccl-check: RESULT $result"
  exit "$status"
}

# ---- the call

if [ $# -eq 0 ] || [ "$1" = -h ] || [ "$1" = --help ]; then
  usage
  [ $# -eq 0 ] && exit 2
  exit 0
fi
for arg in "$@"; do
  name=${arg%%:*}
  if ! declare -F "suite_${name//-/_}" > /dev/null; then
    echo "unknown suite: $name (bash bench/device/run.sh --help lists them)" >&2
    exit 2
  fi
done

dry && exec 3>&1  # where DRY_RUN=1 prints the commands
if [ -z "${OUT:-}" ]; then
  OUT=$(mktemp -d)
  echo "OUT not set: logs go to $OUT"
fi
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd) || exit 1
SCRATCH=${SCRATCH:-$(mktemp -d)}
INFO=$OUT/info.txt
export LD_LIBRARY_PATH="${LIBS:+$LIBS:}$CUDA_HOME/lib64:$CUDA_HOME/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PYTHONUNBUFFERED=1
run nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee -a "$INFO"
date -u +"start %F %T UTC $(git rev-parse --short HEAD 2> /dev/null)" | tee -a "$INFO"

results=()
first_status=0
for arg in "$@"; do
  name=${arg%%:*}
  param=
  [ "$arg" = "$name" ] || param=${arg#*:}
  folder=${arg//[:\/]/-}
  [ -e "$OUT/$folder" ] && folder="$folder-$(date +%s)"
  mkdir -p "$OUT/$folder"
  echo "==== suite $arg (logs in $OUT/$folder)"
  started=$(date +%s)
  if dry; then
    (SUITE=$arg OUT=$OUT/$folder; "suite_${name//-/_}" "$param"; exit 0) > "$OUT/$folder/dry.log" 2>&1
    # A dry run's status says only whether the suite's shell code failed.
    status=dry
    grep -E "unbound variable|syntax error|command not found" "$OUT/$folder/dry.log" && status=1
  else
    (SUITE=$arg OUT=$OUT/$folder; "suite_${name//-/_}" "$param"; exit 0) 2>&1 |
      tee "$OUT/$folder/console.log"
    status=${PIPESTATUS[0]}
  fi
  results+=("$(printf '%-16s exit %-3s %5s s  %s' "$arg" "$status" $(($(date +%s) - started)) \
    "$OUT/$folder")")
  [ "$first_status" != 0 ] || [ "$status" = dry ] || first_status=$status
done
date -u +"end %T UTC" | tee -a "$INFO"
echo "==== runner summary"
printf '%s\n' "${results[@]}"
exit "$first_status"
