// Forwards to attngrad/common/status_macros.h, where the status macros live, for code that still
// includes this path (bench/wire_ceiling).
#ifndef ATTNGRAD_WIRE_STATUS_MACROS_H_
#define ATTNGRAD_WIRE_STATUS_MACROS_H_

#include "attngrad/common/status_macros.h"

#endif  // ATTNGRAD_WIRE_STATUS_MACROS_H_
