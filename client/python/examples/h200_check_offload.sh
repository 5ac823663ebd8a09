#!/usr/bin/env bash
# The end-to-end offload check on a GPU machine (one `run` call): check_offload.py for gemma-3-270m
# (RETURN mode) and gemma-3-1b (ACCUMULATE mode), each on one server and split over two, 20 steps.
# Logs in $OUT (offload_<config>_<mode>.log); a summary last; exit 1 when a check failed.
#   SERVER    the attngrad-server binary (default build-h200/server/attngrad-server)
#   DEVICES   the servers' --devices (default 0; "cpu" when the GPU kernels refuse head_dim 256)
#   LIBS      a folder of the server's shared libraries (shared/tools/bundle-libs.sh), if any
#   SEQ_LEN   tokens per sequence (default 128), STEPS (default 20), CONFIGS (default "270m:return
#             1b:accumulate")
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
SERVER=${SERVER:-build-h200/server/attngrad-server}
DEVICES=${DEVICES:-0}
if [[ -n "${LIBS:-}" ]]; then
  export LD_LIBRARY_PATH="$LIBS:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
fi
export PYTHONUNBUFFERED=1
python3 -c "import torch, transformers, grpc; print('torch', torch.__version__, 'transformers',
transformers.__version__, 'grpcio', grpc.__version__)" | tee "$OUT/versions.txt"
status=0
for item in ${CONFIGS:-270m:return 1b:accumulate}; do
  config=${item%%:*}
  mode=${item##*:}
  log="$OUT/offload_${config}_${mode}.log"
  date -u +"start $config $mode %T UTC" | tee -a "$OUT/times.txt"
  python3 client/python/examples/check_offload.py --server "$SERVER" --devices "$DEVICES" \
    --config "$config" --mode "$mode" --steps "${STEPS:-20}" --seq-len "${SEQ_LEN:-128}" \
    > "$log" 2>&1 || status=1
done
date -u +"done %T UTC" | tee -a "$OUT/times.txt"
echo "==== summary"
for log in "$OUT"/offload_*.log; do
  echo "--- $log"
  grep -E "^Gemma-3|^\| |^RESULT" "$log" || tail -20 "$log"
done
exit $status
