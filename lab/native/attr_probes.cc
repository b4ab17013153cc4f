// CPU handlers that decode the CUDA handlers' attribute structs (xla_ffi/cuda/handlers/attrs.h, and
// the host handlers' layout bundle the CUDA layout takes, LayoutAttrsView) with the very decoders
// the CUDA handlers use, and write back what they decoded: a test emits them with the attributes
// the Python side builds for each CUDA custom call, so a bundle that drifts from its struct (a
// member missing, renamed or of another type) fails on a machine without a GPU. Each writes int32
// values into `out`, in the struct's member order; the layout probe appends the placement spans.
#include "lab/native/attr_probes.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/common/ffi_support.h"
#include "xla_ffi/cpu/handlers/handlers.h"
#include "xla_ffi/cuda/handlers/attrs.h"

namespace jax_hybridep {
namespace ffi = xla::ffi;
namespace {

ffi::Error Write(const std::vector<int64_t>& values, ffi::ResultBuffer<ffi::S32> out) {
  if (static_cast<int64_t>(out->element_count()) != static_cast<int64_t>(values.size())) {
    return ffi::Error::InvalidArgument("attribute probe: out must have " +
                                       std::to_string(values.size()) + " elements");
  }
  std::copy(values.begin(), values.end(), out->typed_data());
  return ffi::Error::Success();
}

std::vector<int64_t> TransportValues(const TransportAttrs& a) {
  return {a.site, a.num_ranks, a.timeout_ms, a.num_sms, a.multi_process};
}

ffi::Error Transport(TransportAttrs a, ffi::ResultBuffer<ffi::S32> out) {
  return Write(TransportValues(a), out);
}

ffi::Error Rows(RowsAttrs a, ffi::ResultBuffer<ffi::S32> out) {
  std::vector<int64_t> v = TransportValues(a);
  v.push_back(a.sparse_pad_multiple);
  return Write(v, out);
}

ffi::Error Dispatch(DispatchAttrs a, ffi::ResultBuffer<ffi::S32> out) {
  std::vector<int64_t> v = TransportValues(a);
  v.push_back(a.sparse_pad_multiple);
  v.push_back(a.fp8_hidden);
  return Write(v, out);
}

ffi::Error Unpermute(UnpermuteAttrs a, ffi::ResultBuffer<ffi::S32> out) {
  return Write({a.weighted}, out);
}

ffi::Error Layout(LayoutAttrsView a, ffi::ResultBuffer<ffi::S32> out) {
  std::vector<int64_t> v = {a.num_ranks, a.num_slots, a.capacity, a.rows, a.pad_multiple, a.strict};
  v.insert(v.end(), a.expert_rank.begin(), a.expert_rank.end());
  v.insert(v.end(), a.expert_slot.begin(), a.expert_slot.end());
  return Write(v, out);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER(kProbeTransport, Transport,
                       ffi::Ffi::Bind().Attrs<TransportAttrs>().Ret<ffi::Buffer<ffi::S32>>());
XLA_FFI_DEFINE_HANDLER(kProbeRows, Rows,
                       ffi::Ffi::Bind().Attrs<RowsAttrs>().Ret<ffi::Buffer<ffi::S32>>());
XLA_FFI_DEFINE_HANDLER(kProbeDispatch, Dispatch,
                       ffi::Ffi::Bind().Attrs<DispatchAttrs>().Ret<ffi::Buffer<ffi::S32>>());
XLA_FFI_DEFINE_HANDLER(kProbeUnpermute, Unpermute,
                       ffi::Ffi::Bind().Attrs<UnpermuteAttrs>().Ret<ffi::Buffer<ffi::S32>>());
XLA_FFI_DEFINE_HANDLER(kProbeLayout, Layout,
                       ffi::Ffi::Bind().Attrs<LayoutAttrsView>().Ret<ffi::Buffer<ffi::S32>>());

std::vector<HandlerEntry> AttrProbeHandlers() {
  return {
      {"jax_hybridep_testing_decode_transport", kProbeTransport},
      {"jax_hybridep_testing_decode_rows", kProbeRows},
      {"jax_hybridep_testing_decode_dispatch", kProbeDispatch},
      {"jax_hybridep_testing_decode_unpermute", kProbeUnpermute},
      {"jax_hybridep_testing_decode_layout", kProbeLayout},
  };
}

}  // namespace jax_hybridep
