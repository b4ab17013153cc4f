// XLA FFI handlers (platform Host) for multi-level topologies, one level at a time (levels.h).
//
// Levels whose ranks share a process exchange in shared memory: level_send writes each rank's
// item copies straight into the peers' next-level buffers, level_reduce_pull adds combine's
// partials reading them in place from the peers, blocks_all_to_all moves the routing-weight
// gradients back; levels that cross processes pack locally (level_pack) around an XLA
// all-to-all. The local steps (expand_items, expand_items_vjp, item_partials, level_reduce,
// level_pick) are shared.
#include <algorithm>
#include <memory>
#include <sstream>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/common/ffi_support.h"
#include "xla_ffi/common/rendezvous.h"
#include "xla_ffi/cpu/handlers/handlers.h"
#include "xla_ffi/cpu/kernels/levels.h"

namespace jax_hybridep {
namespace {

LevelShape MakeLevelShape(ffi::AnyBuffer rows, ffi::Buffer<ffi::S32> dest, int64_t size,
                          int64_t stride) {
  const int64_t items = rows.dimensions()[0];
  return {size, stride, items, dest.dimensions()[1],
          items > 0 ? static_cast<int64_t>(rows.size_bytes()) / items : 0};
}

LevelItems Items(ffi::AnyBuffer rows, ffi::Buffer<ffi::S32> dest, ffi::Buffer<ffi::S32> pos,
                 ffi::Buffer<ffi::F32> weights) {
  return {static_cast<char*>(rows.untyped_data()), dest.typed_data(), pos.typed_data(),
          weights.typed_data()};
}

LevelItems Items(ffi::Result<ffi::AnyBuffer>& rows, ffi::ResultBuffer<ffi::S32>& dest,
                 ffi::ResultBuffer<ffi::S32>& pos, ffi::ResultBuffer<ffi::F32>& weights) {
  return {static_cast<char*>(rows->untyped_data()), dest->typed_data(), pos->typed_data(),
          weights->typed_data()};
}

// One level by direct write: the peers publish their next-level item buffers and each rank
// writes its item copies straight into them.
ffi::Future LevelSendImpl(ffi::RunId run_id, ffi::AnyBuffer rows, ffi::Buffer<ffi::S32> dest,
                          ffi::Buffer<ffi::S32> pos, ffi::Buffer<ffi::F32> weights,
                          ffi::Buffer<ffi::S32> coord, ffi::Buffer<ffi::S32> level_group,
                          LevelSendAttrs attrs, ffi::Result<ffi::AnyBuffer> out_rows,
                          ffi::ResultBuffer<ffi::S32> out_dest, ffi::ResultBuffer<ffi::S32> out_pos,
                          ffi::ResultBuffer<ffi::F32> out_weights,
                          ffi::ResultBuffer<ffi::S32> send_slot) {
  const CallSite call = MakeCallSite(run_id, coord, level_group, attrs);
  const LevelShape shape = MakeLevelShape(rows, dest, call.num_ranks, attrs.stride);
  auto next = std::make_shared<LevelItems>(Items(out_rows, out_dest, out_pos, out_weights));
  ClearItems(shape, call.num_ranks * shape.items, *next);

  Participant p;
  p.published = {next.get()};
  p.write = [=, held = Items(rows, dest, pos, weights),
             send_slot = send_slot->typed_data()](const std::vector<Published>& peers) {
    std::vector<const LevelItems*> out(peers.size());
    for (size_t r = 0; r < peers.size(); ++r) out[r] = static_cast<LevelItems*>(peers[r][0]);
    const std::vector<int64_t> base(peers.size(), call.rank * shape.items);
    SendLevel(shape, held, out.data(), base.data(), send_slot);
  };
  p.read = [next] { return Status::Ok(); };  // keeps `next` alive until every rank wrote
  return Exchange("level send", call, std::move(p));
}

// One level packed for an XLA all-to-all: slot block p holds the copies for peer p.
ffi::Error LevelPackImpl(ffi::AnyBuffer rows, ffi::Buffer<ffi::S32> dest, ffi::Buffer<ffi::S32> pos,
                         ffi::Buffer<ffi::F32> weights, int64_t num_ranks, int64_t stride,
                         ffi::Result<ffi::AnyBuffer> out_rows, ffi::ResultBuffer<ffi::S32> out_dest,
                         ffi::ResultBuffer<ffi::S32> out_pos,
                         ffi::ResultBuffer<ffi::F32> out_weights,
                         ffi::ResultBuffer<ffi::S32> send_slot) {
  const LevelShape shape = MakeLevelShape(rows, dest, num_ranks, stride);
  const LevelItems packed = Items(out_rows, out_dest, out_pos, out_weights);
  ClearItems(shape, num_ranks * shape.items, packed);
  const std::vector<const LevelItems*> out(num_ranks, &packed);
  std::vector<int64_t> base(num_ranks);
  for (int64_t r = 0; r < num_ranks; ++r) base[r] = r * shape.items;
  SendLevel(shape, Items(rows, dest, pos, weights), out.data(), base.data(),
            send_slot->typed_data());
  return ffi::Error::Success();
}

// The last level's items into expert-major rows.
ffi::Error ExpandItemsImpl(ffi::AnyBuffer rows, ffi::Buffer<ffi::S32> pos,
                           ffi::Buffer<ffi::F32> weights, RowAttrs attrs,
                           ffi::Result<ffi::AnyBuffer> tokens,
                           ffi::ResultBuffer<ffi::F32> row_weights) {
  auto output = ToOutputRows(tokens->element_type(), attrs.fp8_hidden, "the rows");
  if (output.has_error()) return output.error();
  const LevelShape shape = MakeLevelShape(rows, pos, 1, 1);
  const LevelItems items{static_cast<char*>(rows.untyped_data()), nullptr, pos.typed_data(),
                         weights.typed_data()};
  RowOutputs out;
  out.tokens = static_cast<char*>(tokens->untyped_data());
  out.weights = row_weights->typed_data();
  out.sparse_pad_multiple = attrs.sparse_pad_multiple;
  out.fp8_hidden = output->dequantized_hidden;
  ExpandItems(shape, items, tokens->dimensions()[0], output->dtype, out);
  return ffi::Error::Success();
}

// A weighted combine's VJP on the last level's items of g: scaled = row * scale[row] and
// dot = RowDot(y[row], row) per row (as the one-level combine_vjp), the rows never stored.
ffi::Error ExpandItemsVjpImpl(ffi::AnyBuffer rows, ffi::Buffer<ffi::S32> pos,
                              ffi::Buffer<ffi::F32> scale, ffi::AnyBuffer y, RowAttrs attrs,
                              ffi::Result<ffi::AnyBuffer> scaled, ffi::ResultBuffer<ffi::F32> dot) {
  auto dtype = ToDtype(rows.element_type(), "g");
  if (dtype.has_error()) return dtype.error();
  const LevelShape shape = MakeLevelShape(rows, pos, 1, 1);
  const int64_t out_rows = scaled->dimensions()[0];
  if (ffi::Error error = CheckVjpY(y, rows.element_type(), out_rows, shape.row_bytes);
      error.failure()) {
    return error;
  }
  const LevelItems items{static_cast<char*>(rows.untyped_data()), nullptr, pos.typed_data(),
                         nullptr};
  RowOutputs out;
  out.scale = scale.typed_data();
  out.scaled = static_cast<char*>(scaled->untyped_data());
  out.y = static_cast<const char*>(y.untyped_data());
  out.dot = dot->typed_data();
  out.sparse_pad_multiple = attrs.sparse_pad_multiple;
  ExpandItems(shape, items, out_rows, dtype.value(), out);
  return ffi::Error::Success();
}

// Per held item: this rank's rows summed in ascending k (combine's first partials).
ffi::Error ItemPartialsImpl(ffi::AnyBuffer y, ffi::Buffer<ffi::F32> weights,
                            ffi::Buffer<ffi::S32> pos, bool weighted,
                            ffi::Result<ffi::AnyBuffer> partials) {
  auto dtype = ToDtype(y.element_type(), "y");
  if (dtype.has_error()) return dtype.error();
  const int64_t items = pos.dimensions()[0];
  const int64_t row_bytes = items > 0 ? static_cast<int64_t>(partials->size_bytes()) / items : 0;
  ItemPartials(items, pos.dimensions()[1], row_bytes, dtype.value(),
               static_cast<const char*>(y.untyped_data()),
               weighted ? weights.typed_data() : nullptr, pos.typed_data(),
               static_cast<char*>(partials->untyped_data()));
  return ffi::Error::Success();
}

// The direct-write all-to-all over one level: block p of this rank's data lands in block
// (this rank's coordinate) of peer p's output.
ffi::Future BlocksAllToAllImpl(ffi::RunId run_id, ffi::AnyBuffer data, ffi::Buffer<ffi::S32> coord,
                               ffi::Buffer<ffi::S32> level_group, ExchangeAttrs exchange,
                               ffi::Result<ffi::AnyBuffer> out) {
  const CallSite call = MakeCallSite(run_id, coord, level_group, exchange);
  const int64_t num_ranks = call.num_ranks;
  const int64_t block_bytes = static_cast<int64_t>(data.size_bytes()) / num_ranks;
  Participant p;
  p.published = {out->untyped_data()};
  p.write = [=, src = static_cast<const char*>(data.untyped_data())](
                const std::vector<Published>& peers) {
    std::vector<char*> dst(peers.size());
    for (size_t r = 0; r < peers.size(); ++r) dst[r] = static_cast<char*>(peers[r][0]);
    WriteBlocks(num_ranks, block_bytes, call.rank, src, dst.data());
  };
  p.read = [] { return Status::Ok(); };
  return Exchange("level return", call, std::move(p));
}

// Per held item: the partials its peers returned (back: an all-to-all's output), added in
// ascending peer order.
ffi::Error LevelReduceImpl(ffi::AnyBuffer back, ffi::Buffer<ffi::S32> send_slot,
                           ffi::Result<ffi::AnyBuffer> out) {
  auto dtype = ToDtype(back.element_type(), "partials");
  if (dtype.has_error()) return dtype.error();
  const int64_t items = send_slot.dimensions()[0], size = send_slot.dimensions()[1];
  const int64_t row_bytes = items > 0 ? static_cast<int64_t>(out->size_bytes()) / items : 0;
  std::vector<const char*> blocks(size);
  for (int64_t p = 0; p < size; ++p) {
    blocks[p] = static_cast<const char*>(back.untyped_data()) + p * items * row_bytes;
  }
  ReduceLevel(LevelShape{size, 1, items, 0, row_bytes}, dtype.value(), blocks.data(),
              send_slot.typed_data(), static_cast<char*>(out->untyped_data()));
  return ffi::Error::Success();
}

// The same for a level whose ranks share the process: every rank publishes its partials
// [S * M, H] and reads its block (its coordinate) of each peer's in place, with no copy first.
ffi::Future LevelReducePullImpl(ffi::RunId run_id, ffi::AnyBuffer partials,
                                ffi::Buffer<ffi::S32> send_slot, ffi::Buffer<ffi::S32> coord,
                                ffi::Buffer<ffi::S32> level_group, ExchangeAttrs exchange,
                                ffi::Result<ffi::AnyBuffer> out) {
  auto dtype = ToDtype(partials.element_type(), "partials");
  if (dtype.has_error()) return Failed(dtype.error());
  const CallSite call = MakeCallSite(run_id, coord, level_group, exchange);
  const int64_t num_ranks = call.num_ranks;
  const int64_t items = send_slot.dimensions()[0];
  const int64_t row_bytes = items > 0 ? static_cast<int64_t>(out->size_bytes()) / items : 0;
  if (send_slot.dimensions()[1] != num_ranks ||
      static_cast<int64_t>(partials.size_bytes()) != num_ranks * items * row_bytes) {
    std::ostringstream msg;
    msg << "jax_hybridep: level reduce needs partials of " << num_ranks << " x " << items
        << " rows of " << row_bytes << " bytes and send_slot [" << items << ", " << num_ranks
        << "]; got " << partials.size_bytes() << " bytes and send_slot [" << items << ", "
        << send_slot.dimensions()[1] << "]";
    return Failed(ffi::Error::InvalidArgument(msg.str()));
  }
  const LevelShape shape{num_ranks, 1, items, 0, row_bytes};
  auto peers = std::make_shared<std::vector<const char*>>(num_ranks);
  Participant p;
  p.published = {partials.untyped_data()};
  p.write = [=](const std::vector<Published>& published) {
    // Every rank has arrived, so its partials are ready and stay alive until all have read.
    for (int64_t r = 0; r < num_ranks; ++r) {
      (*peers)[r] = static_cast<const char*>(published[r][0]) + call.rank * items * row_bytes;
    }
  };
  p.read = [=, dtype = dtype.value(), send_slot = send_slot.typed_data(),
            out = static_cast<char*>(out->untyped_data())]() {
    ReduceLevel(shape, dtype, peers->data(), send_slot, out);
    return Status::Ok();
  };
  return Exchange("level reduce", call, std::move(p));
}

// Per held (item, k): the value the peer holding that row returned.
ffi::Error LevelPickImpl(ffi::Buffer<ffi::F32> back, ffi::Buffer<ffi::S32> send_slot,
                         ffi::Buffer<ffi::S32> held_dest, int64_t stride,
                         ffi::ResultBuffer<ffi::F32> out) {
  const int64_t items = send_slot.dimensions()[0], size = send_slot.dimensions()[1];
  PickLevelValues(LevelShape{size, stride, items, held_dest.dimensions()[1], 0}, back.typed_data(),
                  send_slot.typed_data(), held_dest.typed_data(), out->typed_data());
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER(kLevelSend, LevelSendImpl,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::RunId>()
                           .Arg<ffi::AnyBuffer>()         // rows [M, H]
                           .Arg<ffi::Buffer<ffi::S32>>()  // dest [M, K]
                           .Arg<ffi::Buffer<ffi::S32>>()  // pos [M, K]
                           .Arg<ffi::Buffer<ffi::F32>>()  // weights [M, K]
                           .Arg<ffi::Buffer<ffi::S32>>()  // coord [] (rank within the level)
                           .Arg<ffi::Buffer<ffi::S32>>()  // level_group []
                           .Attrs<LevelSendAttrs>()
                           .Ret<ffi::AnyBuffer>()           // rows [S * M, H]
                           .Ret<ffi::Buffer<ffi::S32>>()    // dest [S * M, K]
                           .Ret<ffi::Buffer<ffi::S32>>()    // pos [S * M, K]
                           .Ret<ffi::Buffer<ffi::F32>>()    // weights [S * M, K]
                           .Ret<ffi::Buffer<ffi::S32>>());  // send_slot [M, S]

XLA_FFI_DEFINE_HANDLER(kLevelPack, LevelPackImpl,
                       ffi::Ffi::Bind()
                           .Arg<ffi::AnyBuffer>()         // rows [M, H]
                           .Arg<ffi::Buffer<ffi::S32>>()  // dest [M, K]
                           .Arg<ffi::Buffer<ffi::S32>>()  // pos [M, K]
                           .Arg<ffi::Buffer<ffi::F32>>()  // weights [M, K]
                           .Attr<int64_t>("num_ranks")
                           .Attr<int64_t>("stride")
                           .Ret<ffi::AnyBuffer>()           // rows [S * M, H]
                           .Ret<ffi::Buffer<ffi::S32>>()    // dest [S * M, K]
                           .Ret<ffi::Buffer<ffi::S32>>()    // pos [S * M, K]
                           .Ret<ffi::Buffer<ffi::F32>>()    // weights [S * M, K]
                           .Ret<ffi::Buffer<ffi::S32>>());  // send_slot [M, S]

XLA_FFI_DEFINE_HANDLER(kExpandItems, ExpandItemsImpl,
                       ffi::Ffi::Bind()
                           .Arg<ffi::AnyBuffer>()         // rows [M, H] (or FP8 wire rows)
                           .Arg<ffi::Buffer<ffi::S32>>()  // pos [M, K]
                           .Arg<ffi::Buffer<ffi::F32>>()  // weights [M, K]
                           .Attrs<RowAttrs>()
                           .Ret<ffi::AnyBuffer>()           // tokens [C, H]
                           .Ret<ffi::Buffer<ffi::F32>>());  // row_weights [C]

XLA_FFI_DEFINE_HANDLER(kExpandItemsVjp, ExpandItemsVjpImpl,
                       ffi::Ffi::Bind()
                           .Arg<ffi::AnyBuffer>()         // rows [M, H] (of g)
                           .Arg<ffi::Buffer<ffi::S32>>()  // pos [M, K]
                           .Arg<ffi::Buffer<ffi::F32>>()  // scale [C]
                           .Arg<ffi::AnyBuffer>()         // y [C, H]
                           .Attrs<RowAttrs>()
                           .Ret<ffi::AnyBuffer>()           // scaled [C, H]
                           .Ret<ffi::Buffer<ffi::F32>>());  // dot [C]

XLA_FFI_DEFINE_HANDLER(kItemPartials, ItemPartialsImpl,
                       ffi::Ffi::Bind()
                           .Arg<ffi::AnyBuffer>()         // y [C, H]
                           .Arg<ffi::Buffer<ffi::F32>>()  // weights [C]
                           .Arg<ffi::Buffer<ffi::S32>>()  // pos [M, K]
                           .Attr<bool>("weighted")
                           .Ret<ffi::AnyBuffer>());  // partials [M, H]

XLA_FFI_DEFINE_HANDLER(kBlocksAllToAll, BlocksAllToAllImpl,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::RunId>()
                           .Arg<ffi::AnyBuffer>()         // data [S * n, ...]
                           .Arg<ffi::Buffer<ffi::S32>>()  // coord []
                           .Arg<ffi::Buffer<ffi::S32>>()  // level_group []
                           .Attrs<ExchangeAttrs>()
                           .Ret<ffi::AnyBuffer>());  // out [S * n, ...]

XLA_FFI_DEFINE_HANDLER(kLevelReduce, LevelReduceImpl,
                       ffi::Ffi::Bind()
                           .Arg<ffi::AnyBuffer>()         // back [S * M, H]
                           .Arg<ffi::Buffer<ffi::S32>>()  // send_slot [M, S]
                           .Ret<ffi::AnyBuffer>());       // out [M, H]

XLA_FFI_DEFINE_HANDLER(kLevelReducePull, LevelReducePullImpl,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::RunId>()
                           .Arg<ffi::AnyBuffer>()         // partials [S * M, H]
                           .Arg<ffi::Buffer<ffi::S32>>()  // send_slot [M, S]
                           .Arg<ffi::Buffer<ffi::S32>>()  // coord []
                           .Arg<ffi::Buffer<ffi::S32>>()  // level_group []
                           .Attrs<ExchangeAttrs>()
                           .Ret<ffi::AnyBuffer>());  // out [M, H]

XLA_FFI_DEFINE_HANDLER(kLevelPick, LevelPickImpl,
                       ffi::Ffi::Bind()
                           .Arg<ffi::Buffer<ffi::F32>>()  // back [S * M, K]
                           .Arg<ffi::Buffer<ffi::S32>>()  // send_slot [M, S]
                           .Arg<ffi::Buffer<ffi::S32>>()  // held_dest [M, K]
                           .Attr<int64_t>("stride")
                           .Ret<ffi::Buffer<ffi::F32>>());  // out [M, K]

std::vector<HandlerEntry> CpuLevelHandlers() {
  return {
      {"jax_hybridep_level_send", kLevelSend},
      {"jax_hybridep_level_pack", kLevelPack},
      {"jax_hybridep_expand_items", kExpandItems},
      {"jax_hybridep_expand_items_vjp", kExpandItemsVjp},
      {"jax_hybridep_level_reduce_pull", kLevelReducePull},
      {"jax_hybridep_item_partials", kItemPartials},
      {"jax_hybridep_blocks_all_to_all", kBlocksAllToAll},
      {"jax_hybridep_level_reduce", kLevelReduce},
      {"jax_hybridep_level_pick", kLevelPick},
  };
}

}  // namespace jax_hybridep
