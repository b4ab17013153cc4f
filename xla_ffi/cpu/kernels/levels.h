// The per-level steps of hierarchical dispatch and combine, on the CPU (docs/design.md §2.1, §3).
//
// Entering level l, a rank holds M items (M = T at the slowest level): payload rows plus, per k,
// the destination EP rank (-1 when that k has no row below this rank), the destination row and the
// routing weight. At level l an item goes once to every peer (the S ranks differing from this one
// only in level l's coordinate) whose subtree holds one of its rows, carrying only the metadata of
// those rows; the S x M slots received are the next level's items. Combine returns per-item
// partial sums the same way back, and each sender adds its peers' partials in ascending peer order.
//
// Framework-free: raw pointers only.
#ifndef JAX_HYBRIDEP_XLA_FFI_CPU_KERNELS_LEVELS_H_
#define JAX_HYBRIDEP_XLA_FFI_CPU_KERNELS_LEVELS_H_

#include <cstdint>

#include "xla_ffi/common/numeric.h"
#include "xla_ffi/cpu/kernels/exchange.h"

namespace jax_hybridep {

// One level's geometry as seen by one rank.
struct LevelShape {
  int64_t size;       // S, ranks in this level's group
  int64_t stride;     // EP-rank stride of this level: peer of rank d is (d / stride) % S
  int64_t items;      // M, items held entering this level
  int64_t k;          // K
  int64_t row_bytes;  // payload bytes per item
};

// Items with their per-k metadata; every array has one entry (or K) per item.
struct LevelItems {
  char* rows;      // [n, row_bytes]
  int32_t* dest;   // [n, K]
  int32_t* pos;    // [n, K]
  float* weights;  // [n, K]
};

// Marks `count` item slots empty (no rows, zero weights; the payload is left as it is).
void ClearItems(const LevelShape& shape, int64_t count, const LevelItems& items);

// Sends every held item once to each peer holding one of its rows, in ascending item order:
// the j-th item for peer p goes to out[p] at slot base[p] + j. send_slot [M, S] records j (or -1).
// Direct write: out[p] = peer p's next-level items, base[p] = (this rank's coordinate) * M.
// Pack for an all-to-all: out[p] = one local buffer, base[p] = p * M.
void SendLevel(const LevelShape& shape, const LevelItems& held, const LevelItems* const* out,
               const int64_t* base, int32_t* send_slot);

// Expert-major rows from the last level's items: row pos holds the item's payload and routing
// weight, written into `out` (exchange.h; rows nobody fills as rows of zeros).
void ExpandItems(const LevelShape& shape, const LevelItems& items, int64_t rows, Dtype dtype,
                 const RowOutputs& out);

// Per item, this rank's rows summed in ascending k in float32 (each row times weights[row] when
// weights is non-null), rounded to `dtype`. partials: [M, row_bytes].
void ItemPartials(int64_t items, int64_t k, int64_t row_bytes, Dtype dtype, const char* y,
                  const float* weights, const int32_t* pos, char* partials);

// Per held item m: sum over peers p ascending with send_slot[m, p] >= 0 of back[p][slot], in
// float32, rounded once to `dtype`. back[p]: [M, row_bytes], the partials peer p returned (a block
// of an all-to-all's output, or read in place from the peer's buffer).
void ReduceLevel(const LevelShape& shape, Dtype dtype, const char* const* back,
                 const int32_t* send_slot, char* out);

// Per held item m and k with held_dest[m, k] >= 0: back[peer of that k, send_slot[m, peer], k]
// (the value returned for that row), else 0. back: [S, M, K]; out: [M, K].
void PickLevelValues(const LevelShape& shape, const float* back, const int32_t* send_slot,
                     const int32_t* held_dest, float* out);

// The direct-write all-to-all: block p of `src` ([S, n, bytes]) goes to block `coord` of peer p's
// `dst`.
void WriteBlocks(int64_t size, int64_t block_bytes, int64_t coord, const char* src,
                 char* const* peer_dst);

}  // namespace jax_hybridep

#endif  // JAX_HYBRIDEP_XLA_FFI_CPU_KERNELS_LEVELS_H_
