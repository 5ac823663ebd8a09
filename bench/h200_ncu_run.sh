#!/usr/bin/env bash
# One device call (H200): Nsight Compute's view of the attention kernels inside one whole backward
# (bench/profile_backward.py through libattngrad's C ABI), to see which pipe bounds each kernel.
# The carried folder $K holds bundle.tar.xz with libattngrad.so and lib/ (as h200_kernels_run.sh).
#   WORKLOADS   "B:S ..." (default "2:2048 4:128")
#   KERNELS     ncu's kernel-name regex (default "Attention|KeyValue|Query|Short")
#   COUNT       kernels profiled per workload (default 6)
#   SOURCE      a kernel-name regex: also sample where that kernel's warps stall, per SASS
#               instruction (SourceCounters), at the first workload; bench/ncu_source_top.py
#               prints the top instructions into $OUT/source_top.txt
# Per workload: $OUT/ncu_B_S.txt (sections: speed of light, compute, warp state, scheduler,
# occupancy, launch) and the pipes' utilisation and stall reasons as metrics.
set -u
K=${K:-build-kern}
source bench/device_setup.sh  # (run from the repository root)
device_setup "$K" bundle.tar.xz
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
for workload in ${WORKLOADS:-2:2048 4:128}; do
  batch=${workload%%:*}
  seq=${workload##*:}
  log="$OUT/ncu_${batch}_${seq}.txt"
  timeout "${NCU_LIMIT:-150}" "$NCU" -k "regex:${KERNELS:-Attention|KeyValue|Query|Short}" \
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
  timeout "${NCU_LIMIT:-150}" "$NCU" -k "regex:$SOURCE" --launch-skip 0 --launch-count 1 \
    --section SourceCounters --section WarpStateStats -f -o /tmp/source_report \
    python3 bench/profile_backward.py --lib "$K/libattngrad.so" --batch "${first%%:*}" \
    --seq "${first##*:}" --calls 1 > "$OUT/source_profile.log" 2>&1
  "$NCU" -i /tmp/source_report.ncu-rep --page source --csv --print-source sass \
    > /tmp/source.csv 2>> "$OUT/source_profile.log"
  python3 bench/ncu_source_top.py /tmp/source.csv --top "${SOURCE_TOP:-60}" \
    > "$OUT/source_top.txt" 2>&1
  head -c 4000 "$OUT/source_top.txt"
fi
