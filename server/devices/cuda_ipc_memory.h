// CUDA IPC regions (rpc/regions.h): same-host clients' GPU memory, opened on the server's GPUs
// with cudaIpcOpenMemHandle and closed (cudaIpcCloseMemHandle) when the last region and batch
// that use it are gone. A handle opened by several regions (e.g. two tensors of one torch
// allocation) is opened once. Built with CUDA only (ATTNGRAD_HAVE_CUDA).
#ifndef ATTNGRAD_SERVER_CUDA_IPC_MEMORY_H_
#define ATTNGRAD_SERVER_CUDA_IPC_MEMORY_H_

#include <memory>
#include <vector>

#include "rpc/regions.h"

namespace attngrad::server {

// Opens handles of memory on `devices` (the CUDA device ordinals this server computes on); a
// handle of another device is FAILED_PRECONDITION naming cuda_ipc.device.
std::shared_ptr<DeviceMemoryOpener> MakeCudaIpcMemoryOpener(std::vector<int> devices);

}  // namespace attngrad::server

#endif  // ATTNGRAD_SERVER_CUDA_IPC_MEMORY_H_
