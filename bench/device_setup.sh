# Sourced by the bench/h200_*_run.sh device scripts (bash): unpacks a carried archive and records
# the GPU and the start time.
#   device_setup DIR ARCHIVE   unpacks DIR/ARCHIVE into DIR (exit 1 when it cannot), puts DIR/lib
#                              and CUDA's libraries on LD_LIBRARY_PATH, makes $OUT (default
#                              /tmp/out) and writes the GPU's name, driver and power limit and the
#                              start time to $INFO ($OUT/info.txt), echoing them.
device_setup() {
  local dir=$1 archive=$2
  OUT=${OUT:-/tmp/out}
  INFO="$OUT/info.txt"
  mkdir -p "$OUT"
  tar -xJf "$dir/$archive" -C "$dir" || exit 1
  export LD_LIBRARY_PATH="$PWD/$dir/lib:/usr/local/cuda/lib64:/usr/local/cuda/lib:${LD_LIBRARY_PATH:-}"
  export PYTHONUNBUFFERED=1
  nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee "$INFO"
  date -u +"start %F %T UTC" | tee -a "$INFO"
}

# device_setup DIR ARCHIVE, then what the scripts that run DIR/attngrad-server beside PyTorch
# clients share: SERVER_BINARY (its absolute path), no .pyc files written into the carried trees,
# and the torch and grpcio versions recorded in $INFO.
device_setup_with_torch_clients() {
  device_setup "$1" "$2"
  SERVER_BINARY="$PWD/$1/attngrad-server"
  export PYTHONDONTWRITEBYTECODE=1
  python3 -c "import torch, grpc; print('torch', torch.__version__, 'grpcio', grpc.__version__)" \
    | tee -a "$INFO"
}
