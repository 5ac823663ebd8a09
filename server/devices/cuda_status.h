// CUDA runtime errors as absl::Status, for the host code of the GPU devices (CUDA builds only).
#ifndef ATTNGRAD_SERVER_DEVICES_CUDA_STATUS_H_
#define ATTNGRAD_SERVER_DEVICES_CUDA_STATUS_H_

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace attngrad::server {

// OK for cudaSuccess; else INTERNAL naming `what` and the error.
inline absl::Status CudaStatus(cudaError_t error, const char* what) {
  if (error == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(
      absl::StrCat(what, ": ", cudaGetErrorName(error), " (", cudaGetErrorString(error), ")"));
}

}  // namespace attngrad::server

// Returns the CudaStatus of `call` from the enclosing function when it failed.
#define ATTNGRAD_CUDA_RETURN(call)                                             \
  do {                                                                         \
    absl::Status cuda_status_ = ::attngrad::server::CudaStatus((call), #call); \
    if (!cuda_status_.ok()) return cuda_status_;                               \
  } while (false)

#endif  // ATTNGRAD_SERVER_DEVICES_CUDA_STATUS_H_
