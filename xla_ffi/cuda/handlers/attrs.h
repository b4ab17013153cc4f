// Attribute bundles of the CUDA handlers, decoded as one struct per handler (`.Attrs<T>()`) in
// the host handlers' vocabulary (xla_ffi/common/ffi_support.h): where an exchange meets
// (ExchangeAttrs) plus how the GPU transport runs it. jax_hybridep/exchange/ffi_call.py
// (transport_attrs) builds the same bundles; a member missing on either side fails the call with
// the member's name (tests/cuda_lowering_test.py decodes what Python emits with these decoders on
// the CPU).
#ifndef JAX_HYBRIDEP_XLA_FFI_CUDA_HANDLERS_ATTRS_H_
#define JAX_HYBRIDEP_XLA_FFI_CUDA_HANDLERS_ATTRS_H_

#include <cstdint>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/common/ffi_support.h"

namespace jax_hybridep {

// Every exchange of the transport: the meeting point, and how it runs. (`site` keeps each emitted
// call distinct in the HLO and tags the flags; a call site's own state is held by the
// executable, state/site_state.h, so the CUDA handlers need no key.)
struct TransportAttrs : ExchangeAttrs {
  int64_t num_sms;     // blocks of each send phase (DispatchConfig.num_sms)
  bool multi_process;  // some peers live in other processes: their windows come by CUDA IPC
};

// The permuting exchanges: the transport, and which rows nobody fills stay unwritten
// (sparse_pad_multiple > 0: those at or past sum(group_sizes); 0: none).
struct RowsAttrs : TransportAttrs {
  int64_t sparse_pad_multiple;
};

// dispatch: the above, and FP8 on the wire (docs/design.md §2.1.8): rows of fp8_hidden = H
// elements travel as FP8 wire rows; 0: rows travel as they are.
struct DispatchAttrs : RowsAttrs {
  int64_t fp8_hidden;
};

// unpermute (local): whether each row is scaled by its routing weight.
struct UnpermuteAttrs {
  bool weighted;
};

}  // namespace jax_hybridep

#define JAX_HYBRIDEP_TRANSPORT_MEMBERS                             \
  JAX_HYBRIDEP_EXCHANGE_MEMBERS, StructMember<int64_t>("num_sms"), \
      StructMember<bool>("multi_process")
#define JAX_HYBRIDEP_ROWS_MEMBERS \
  JAX_HYBRIDEP_TRANSPORT_MEMBERS, StructMember<int64_t>("sparse_pad_multiple")

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(::jax_hybridep::TransportAttrs,
                                      JAX_HYBRIDEP_TRANSPORT_MEMBERS);
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(::jax_hybridep::RowsAttrs, JAX_HYBRIDEP_ROWS_MEMBERS);
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(::jax_hybridep::DispatchAttrs, JAX_HYBRIDEP_ROWS_MEMBERS,
                                      StructMember<int64_t>("fp8_hidden"));
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(::jax_hybridep::UnpermuteAttrs,
                                      StructMember<bool>("weighted"));

#endif  // JAX_HYBRIDEP_XLA_FFI_CUDA_HANDLERS_ATTRS_H_
