// CHECK_CUDA for the benchmark tools: print the failing expression and exit (a benchmark has no
// way to go on after a CUDA error). Header-only; bench/ only.
#ifndef ATTNGRAD_BENCH_BENCH_CHECK_H_
#define ATTNGRAD_BENCH_BENCH_CHECK_H_

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#define CHECK_CUDA(expression)                                                 \
  do {                                                                         \
    const cudaError_t error_ = (expression);                                   \
    if (error_ != cudaSuccess) {                                               \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expression, \
                   cudaGetErrorString(error_));                                \
      std::exit(1);                                                            \
    }                                                                          \
  } while (0)

#endif  // ATTNGRAD_BENCH_BENCH_CHECK_H_
