// Argument checks shared by every entry point (C ABI, CPU backend, GPU backend): shapes, pointers and
// scalars of SPEC section 1, so that bad input returns ATTNGRAD_INVALID_ARGUMENT, never a crash.
#ifndef ATTNGRAD_KERNELS_VALIDATE_H_
#define ATTNGRAD_KERNELS_VALIDATE_H_

#include "attngrad/backward.h"

namespace attngrad {

// The most tokens (B*S) one call may carry: keeps every element count far inside size_t and int64.
inline constexpr long long kMaxTokens = 1LL << 26;

// ATTNGRAD_OK when the configuration, shape, scalars and all 17 pointers are usable.
attngrad_status ValidateBackwardArguments(const LayerConfig& config, int batch, int seq_len,
                                          const Scalars& scalars, const BackwardInputs& in,
                                          const BackwardOutputs& out);

}  // namespace attngrad

#endif  // ATTNGRAD_KERNELS_VALIDATE_H_
