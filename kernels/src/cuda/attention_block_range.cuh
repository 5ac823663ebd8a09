// Block geometry of the attention kernels: the causal / sliding-window mask, which keys a query
// row sees, the order of a 1-D grid's work items, and where the stored dS tiles of a query tile
// lie. Internal to kernels/.
#ifndef ATTNGRAD_KERNELS_CUDA_ATTENTION_BLOCK_RANGE_CUH_
#define ATTNGRAD_KERNELS_CUDA_ATTENTION_BLOCK_RANGE_CUH_

#include <cuda_runtime.h>

#include "cuda/attention_params.cuh"

namespace attngrad::cuda::attention_detail {

// The causal and sliding-window mask: key j is hidden from query row i when j > i or j <= i -
// window.
__device__ __forceinline__ bool IsMasked(const AttentionParams& p, int key, int row) {
  return key > row || key <= row - p.window;
}

// First key a query row sees (rows past the sequence included: they are never stored).
__device__ __forceinline__ int FirstVisibleKey(const AttentionParams& p, int row) {
  return max(0, row - p.window + 1);
}

// Tiles [first, end) along one side of the attention matrix: the key tiles that a block of queries
// sees, or the query tiles that see a block of keys.
struct TileRange {
  int first, end;
  __device__ __forceinline__ int Count() const { return end - first; }
};

// The causal and sliding-window geometry between blocks of kQueryRows queries and blocks of
// kKeyRows keys, the same for every tiled kernel: which key tiles a query block sees, and which
// query tiles see a key block. Tiles wholly after the diagonal or wholly before the window are left
// out; those at either end of a range may be partly masked. The arguments are values (not
// AttentionParams), as the kernels read them.
template <int kQueryRows, int kKeyRows>
struct BlockRange {
  // Key tiles (of kKeyRows) that queries [query0, query0 + kQueryRows) see: from the tile of the
  // first key in query0's window to that of the block's last query, or of the sequence's last key.
  __device__ __forceinline__ static TileRange KeyTiles(int query0, int seq_len, int window) {
    const int key_end = min(seq_len, query0 + kQueryRows);
    TileRange tiles;
    tiles.first = max(0, query0 - window + 1) / kKeyRows;
    tiles.end = (key_end + kKeyRows - 1) / kKeyRows;
    return tiles;
  }
  // Query tiles (of kQueryRows) that see a key of [key0, key0 + kKeyRows): from the tile of key0
  // (no earlier query sees it) to that of the last query whose window holds the block's last key,
  // key0 + kKeyRows - 1 + window - 1, or of the sequence's last query.
  __device__ __forceinline__ static TileRange QueryTiles(int key0, int seq_len, int window) {
    const int query_end = min(seq_len, key0 + kKeyRows - 1 + window);
    TileRange tiles;
    tiles.first = key0 / kQueryRows;
    tiles.end = (query_end + kQueryRows - 1) / kQueryRows;
    return tiles;
  }
};

// Work item of a 1-D grid of num_tiles * num_heads * batch blocks, heaviest tiles first (causal
// load balance): heavy_last means the last tile index has the most work.
struct WorkItem {
  int tile, head, batch;
};
__device__ __forceinline__ WorkItem DecodeBlock(int num_tiles, int num_heads, int batch,
                                                bool heavy_last) {
  const int per_rank = num_heads * batch;
  const int block = static_cast<int>(blockIdx.x);
  const int rank = block / per_rank, rest = block % per_rank;
  WorkItem item;
  item.head = rest % num_heads;
  item.batch = rest / num_heads;
  item.tile = heavy_last ? num_tiles - 1 - rank : rank;
  return item;
}

// Where the stored dS tiles lie. Tile (query tile qt, key tile kt) of a (batch, query head) holds
// dS^T, 64 keys x 64 queries, as the image of a 1024-byte aligned swizzled shared-memory tile
// (hopper_wgmma.cuh's SwizzledTile<64, 64>: key rows of 128 bytes), 4096 halves. A query tile's key
// tiles are kt = FirstKeyTile(qt) .. qt (the causal mask and the window; the tiles the dK/dV
// kernel computes); row qt starts at RowStart(qt) of its head's PerHead() tiles: qt (qt + 1) / 2
// under the causal mask, or qt * (the most key tiles a window covers) where a window makes that
// fewer (so a window never needs more tiles than the causal mask alone).
struct ScoreTiles {
  static constexpr int kRows = 64;
  static constexpr int kHalves = kRows * kRows;
  int query_tiles = 0;
  int window = 0;        // AttentionParams::window
  int row_capacity = 0;  // 0: causal rows (qt + 1 tiles); else the window's most tiles per row

  __host__ __device__ static ScoreTiles Of(int seq_len, int window) {
    ScoreTiles tiles;
    tiles.query_tiles = (seq_len + kRows - 1) / kRows;
    tiles.window = window;
    const int window_tiles = (window + kRows - 2) / kRows + 1;
    tiles.row_capacity =
        window < seq_len && 2 * window_tiles < tiles.query_tiles + 1 ? window_tiles : 0;
    return tiles;
  }
  __host__ __device__ int FirstKeyTile(int query_tile) const {
    const int first_key = query_tile * kRows - window + 1;
    return first_key > 0 ? first_key / kRows : 0;
  }
  __host__ __device__ long long RowStart(int query_tile) const {
    return row_capacity > 0 ? static_cast<long long>(query_tile) * row_capacity
                            : static_cast<long long>(query_tile) * (query_tile + 1) / 2;
  }
  __host__ __device__ long long PerHead() const { return RowStart(query_tiles); }
  // Halves from grad_scores to the tile (qt, kt) of `head` of `batch`.
  __host__ __device__ long long Offset(int batch, int head, int num_heads, int query_tile,
                                       int key_tile) const {
    return ((static_cast<long long>(batch) * num_heads + head) * PerHead() + RowStart(query_tile) +
            (key_tile - FirstKeyTile(query_tile))) *
           kHalves;
  }
};

}  // namespace attngrad::cuda::attention_detail

#endif  // ATTNGRAD_KERNELS_CUDA_ATTENTION_BLOCK_RANGE_CUH_
