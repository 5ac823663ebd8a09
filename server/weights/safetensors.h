// Forwards to weights/checkpoint_layer.h (one layer loaded from a safetensors checkpoint), for
// code that still includes this path.
#ifndef ATTNGRAD_SERVER_WEIGHTS_SAFETENSORS_H_
#define ATTNGRAD_SERVER_WEIGHTS_SAFETENSORS_H_

#include "weights/checkpoint_layer.h"

#endif  // ATTNGRAD_SERVER_WEIGHTS_SAFETENSORS_H_
