// Forwards to weights/served_weights.h (the server's LayerWeights), for code that still includes
// this path.
#ifndef ATTNGRAD_SERVER_WEIGHTS_LAYER_WEIGHTS_H_
#define ATTNGRAD_SERVER_WEIGHTS_LAYER_WEIGHTS_H_

#include "weights/served_weights.h"

#endif  // ATTNGRAD_SERVER_WEIGHTS_LAYER_WEIGHTS_H_
