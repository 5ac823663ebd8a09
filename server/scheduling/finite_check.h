// Forwards to scheduling/nonfinite_gradients.h (the host-side count of non-finite gradients), for
// code that still includes this path.
#ifndef ATTNGRAD_SERVER_FINITE_CHECK_H_
#define ATTNGRAD_SERVER_FINITE_CHECK_H_

#include "scheduling/nonfinite_gradients.h"

#endif  // ATTNGRAD_SERVER_FINITE_CHECK_H_
