// The limit every entry point (C ABI, CPU backend, GPU backend) checks besides
// attngrad::CheckBackwardArguments (backward.h), which names the check that failed.
#ifndef ATTNGRAD_KERNELS_VALIDATE_H_
#define ATTNGRAD_KERNELS_VALIDATE_H_

#include "attngrad/backward.h"

namespace attngrad {

// The most tokens (B*S) one call may carry: keeps every element count far inside size_t and int64.
inline constexpr long long kMaxTokens = 1LL << 26;

}  // namespace attngrad

#endif  // ATTNGRAD_KERNELS_VALIDATE_H_
