// Shared-memory regions (host memory, same-host zero copy) on the CPU backend: a client registers a
// sealed memfd over the region socket, batches read hidden_states / grad_output from it and write
// grad_hidden_states into it, with the bits of the bytes path; every bad reference (unknown region,
// another client's, out of bounds, misaligned, wrong size) is INVALID_ARGUMENT naming the field and
// the stream goes on; unregistered regions can no longer be named; CUDA IPC regions are refused
// clearly where they cannot be opened.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>

#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "attngrad/shared_memory_region.h"
#include "attngrad/wire/dtype.h"
#include "attngrad/wire/tensor.h"
#include "rpc/regions.h"
#include "server_test_util.h"

namespace attngrad::server::testing {
namespace {

// Host memory a client shares: a sealed memfd (attngrad::SharedMemoryRegion), mapped here.
class SharedMemory {
 public:
  explicit SharedMemory(std::size_t size) {
    absl::StatusOr<std::unique_ptr<SharedMemoryRegion>> region = SharedMemoryRegion::Create(size);
    EXPECT_TRUE(region.ok()) << region.status();
    if (region.ok()) region_ = *std::move(region);
  }
  char* data() const { return region_->data(); }
  int fd() const { return region_->fd(); }

 private:
  std::unique_ptr<SharedMemoryRegion> region_;
};

v1::RegionSlice Slice(std::uint64_t region, std::int64_t offset, std::int64_t bytes) {
  v1::RegionSlice slice;
  slice.set_region_id(region);
  slice.set_offset(offset);
  slice.set_byte_size(bytes);
  return slice;
}

class RegionsTest : public ServerTest {
 protected:
  static constexpr int kBatch = 1, kSeqLen = 8;

  std::size_t ActivationBytes() const {
    return static_cast<std::size_t>(kBatch) * kSeqLen * config().hidden_size * sizeof(float);
  }

  // Registers `memory`'s first `size` bytes over the server's region socket.
  absl::Status Register(const SharedMemory& memory, std::int64_t size, std::uint64_t* id,
                        const std::string& client_id = "") {
    RegionCredentials credentials;
    credentials.client_id = client_id;
    absl::StatusOr<std::uint64_t> registered =
        RegisterRegionDescriptor(server().region_socket_path(), memory.fd(), size, credentials);
    *id = registered.ok() ? *registered : 0;
    return registered.status();
  }
  grpc::Status Unregister(std::uint64_t id, const std::string& client_id = "") {
    grpc::ClientContext context;
    if (!client_id.empty()) context.AddMetadata("attngrad-client-id", client_id);
    v1::UnregisterRegionRequest request;
    request.set_region_id(id);
    v1::UnregisterRegionResponse response;
    return stub().UnregisterRegion(&context, request, &response);
  }

  // The request with its activations moved into `memory` ([hidden | grad_output | answer]) and
  // named by region; the answer asked into the region too.
  v1::BackwardRequest InRegion(v1::BackwardRequest request, std::uint64_t region,
                               SharedMemory& memory) {
    const std::int64_t bytes = static_cast<std::int64_t>(ActivationBytes());
    std::memcpy(memory.data(), request.hidden_states().raw_data().data(), bytes);
    std::memcpy(memory.data() + bytes, request.grad_output().raw_data().data(), bytes);
    request.mutable_hidden_states()->clear_raw_data();
    request.mutable_grad_output()->clear_raw_data();
    *request.mutable_hidden_states_region() = Slice(region, 0, bytes);
    *request.mutable_grad_output_region() = Slice(region, bytes, bytes);
    *request.mutable_grad_hidden_states_region() = Slice(region, 2 * bytes, bytes);
    return request;
  }
};

// Regions are for callers on the server's host: RegisterRegion from elsewhere (over TCP from
// another address) is PERMISSION_DENIED before any object is opened.
TEST(RegionCallerTest, OnlyCallersOnThisHostMayRegisterRegions) {
  EXPECT_TRUE(CheckRegionCaller("ipv4:127.0.0.1:40000").ok());
  EXPECT_TRUE(CheckRegionCaller("ipv6:[::1]:40000").ok());
  EXPECT_TRUE(CheckRegionCaller("unix:/run/attngrad.sock").ok());
  const absl::Status remote = CheckRegionCaller("ipv4:10.2.3.4:40000");
  EXPECT_EQ(remote.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_NE(remote.message().find("10.2.3.4"), absl::string_view::npos) << remote;
}

TEST_F(RegionsTest, ComputesFromAndIntoARegionWithTheBitsOfTheBytesPath) {
  const Batch batch = MakeBatch(config(), kBatch, kSeqLen, 5);
  const v1::BackwardRequest bytes_request =
      MakeRequest(config(), batch, 1, v1::GRADIENT_MODE_RETURN);
  const v1::BackwardResponse expected = RunOne(stub(), bytes_request);
  ASSERT_FALSE(expected.has_error()) << expected.error().message();

  const std::size_t bytes = ActivationBytes();
  SharedMemory memory(3 * bytes);
  std::uint64_t region = 0;
  ASSERT_TRUE(Register(memory, static_cast<std::int64_t>(3 * bytes), &region).ok());
  ASSERT_NE(region, 0u);
  std::memset(memory.data() + 2 * bytes, 0x7f, bytes);  // the answer overwrites this
  const v1::BackwardResponse response = RunOne(stub(), InRegion(bytes_request, region, memory));
  ASSERT_FALSE(response.has_error()) << response.error().message();

  // grad_hidden_states came in the region, its dtype and shape in the message.
  EXPECT_TRUE(response.grad_hidden_states().raw_data().empty());
  EXPECT_EQ(response.grad_hidden_states().dtype(), v1::DTYPE_FLOAT32);
  EXPECT_EQ(response.grad_hidden_states().shape_size(), 3);
  ASSERT_EQ(expected.grad_hidden_states().raw_data().size(), bytes);
  EXPECT_EQ(std::memcmp(memory.data() + 2 * bytes, expected.grad_hidden_states().raw_data().data(),
                        bytes),
            0);
  // The weight gradients came in the message, the same bits.
  EXPECT_EQ(response.weight_gradients().q_proj().raw_data(),
            expected.weight_gradients().q_proj().raw_data());
  EXPECT_EQ(response.weight_gradients().o_proj().raw_data(),
            expected.weight_gradients().o_proj().raw_data());
  EXPECT_EQ(response.weight_gradients().k_norm().raw_data(),
            expected.weight_gradients().k_norm().raw_data());
  // The inputs were only read.
  EXPECT_EQ(std::memcmp(memory.data(), bytes_request.hidden_states().raw_data().data(), bytes), 0);
  EXPECT_TRUE(Unregister(region).ok());
}

// RETURN's weight gradients into a region (weight_gradients_region): the six packed in
// q, k, v, o, q_norm, k_norm order with the bytes path's bits, the message carrying their dtypes
// and shapes only; with ACCUMULATE the field is INVALID_ARGUMENT naming it.
TEST_F(RegionsTest, WeightGradientsGoIntoARegionWithTheBitsOfTheBytesPath) {
  const Batch batch = MakeBatch(config(), kBatch, kSeqLen, 12);
  v1::BackwardRequest bytes_request = MakeRequest(config(), batch, 3, v1::GRADIENT_MODE_RETURN);
  const v1::BackwardResponse expected = RunOne(stub(), bytes_request);
  ASSERT_FALSE(expected.has_error()) << expected.error().message();
  const std::size_t bytes = ActivationBytes();
  const std::size_t weight_bytes = PackedWeightLayout(config()).total_elements * sizeof(float);
  SharedMemory memory(3 * bytes + weight_bytes);
  std::uint64_t region = 0;
  ASSERT_TRUE(Register(memory, static_cast<std::int64_t>(3 * bytes + weight_bytes), &region).ok());
  v1::BackwardRequest request = InRegion(bytes_request, region, memory);
  *request.mutable_weight_gradients_region() =
      Slice(region, static_cast<std::int64_t>(3 * bytes), static_cast<std::int64_t>(weight_bytes));
  const v1::BackwardResponse response = RunOne(stub(), request);
  ASSERT_FALSE(response.has_error()) << response.error().message();
  std::string packed;
  for (const v1::Tensor* tensor :
       {&expected.weight_gradients().q_proj(), &expected.weight_gradients().k_proj(),
        &expected.weight_gradients().v_proj(), &expected.weight_gradients().o_proj(),
        &expected.weight_gradients().q_norm(), &expected.weight_gradients().k_norm()}) {
    packed += tensor->raw_data();
  }
  ASSERT_EQ(packed.size(), weight_bytes);
  EXPECT_EQ(std::memcmp(memory.data() + 3 * bytes, packed.data(), weight_bytes), 0);
  EXPECT_TRUE(response.weight_gradients().q_proj().raw_data().empty());
  EXPECT_EQ(response.weight_gradients().q_proj().shape_size(), 2);
  EXPECT_EQ(response.weight_gradients().k_norm().dtype(), v1::DTYPE_FLOAT32);

  request.set_mode(v1::GRADIENT_MODE_ACCUMULATE);
  const v1::BackwardResponse refused = RunOne(stub(), request);
  EXPECT_EQ(refused.error().code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(refused.error().message().find("weight_gradients_region"), std::string::npos)
      << refused.error().message();
}

TEST_F(RegionsTest, A16BitAnswerGoesIntoTheRegionInTheResponseDtype) {
  const Batch batch = MakeBatch(config(), kBatch, kSeqLen, 6);
  v1::BackwardRequest bytes_request = MakeRequest(config(), batch, 2, v1::GRADIENT_MODE_RETURN);
  bytes_request.set_response_dtype(v1::DTYPE_BFLOAT16);
  const v1::BackwardResponse expected = RunOne(stub(), bytes_request);
  ASSERT_FALSE(expected.has_error()) << expected.error().message();
  const std::size_t bytes = ActivationBytes();
  SharedMemory memory(3 * bytes);
  std::uint64_t region = 0;
  ASSERT_TRUE(Register(memory, static_cast<std::int64_t>(3 * bytes), &region).ok());
  v1::BackwardRequest request = InRegion(bytes_request, region, memory);
  *request.mutable_grad_hidden_states_region() = Slice(region, 2 * bytes + 2, bytes / 2);
  const v1::BackwardResponse response = RunOne(stub(), request);
  ASSERT_FALSE(response.has_error()) << response.error().message();
  EXPECT_EQ(response.grad_hidden_states().dtype(), v1::DTYPE_BFLOAT16);
  ASSERT_EQ(expected.grad_hidden_states().raw_data().size(), bytes / 2);
  EXPECT_EQ(std::memcmp(memory.data() + 2 * bytes + 2,
                        expected.grad_hidden_states().raw_data().data(), bytes / 2),
            0);
}

TEST_F(RegionsTest, EveryBadReferenceIsInvalidArgumentAndTheStreamGoesOn) {
  const std::size_t bytes = ActivationBytes();
  SharedMemory memory(3 * bytes);
  SharedMemory others(3 * bytes);
  std::uint64_t region = 0, other_region = 0;
  ASSERT_TRUE(Register(memory, static_cast<std::int64_t>(3 * bytes), &region).ok());
  ASSERT_TRUE(Register(others, static_cast<std::int64_t>(3 * bytes), &other_region, "other").ok());
  const Batch batch = MakeBatch(config(), kBatch, kSeqLen, 7);
  const v1::BackwardRequest good =
      InRegion(MakeRequest(config(), batch, 0, v1::GRADIENT_MODE_RETURN), region, memory);
  const std::int64_t size = static_cast<std::int64_t>(bytes);

  std::map<std::uint64_t, std::string> expected_field;  // batch id -> the field the error names
  std::vector<v1::BackwardRequest> requests;
  auto bad = [&](const std::string& field, auto change) {
    v1::BackwardRequest request = good;
    request.set_batch_id(requests.size() + 1);
    change(request);
    expected_field[request.batch_id()] = field;
    requests.push_back(request);
  };
  bad("hidden_states_region.region_id", [&](v1::BackwardRequest& r) {
    r.mutable_hidden_states_region()->set_region_id(region + 100);
  });
  bad("grad_output_region.region_id",
      [&](v1::BackwardRequest& r) { r.mutable_grad_output_region()->set_region_id(other_region); });
  bad("hidden_states_region", [&](v1::BackwardRequest& r) {
    r.mutable_hidden_states_region()->set_offset(2 * size + 4);  // runs past the end
  });
  bad("hidden_states_region",
      [&](v1::BackwardRequest& r) { r.mutable_hidden_states_region()->set_offset(-4); });
  bad("grad_output_region.offset", [&](v1::BackwardRequest& r) {
    r.mutable_grad_output_region()->set_offset(size + 2);  // fp32 needs 4-byte alignment
  });
  bad("hidden_states_region.byte_size", [&](v1::BackwardRequest& r) {
    r.mutable_hidden_states_region()->set_byte_size(size - 4);  // too small for the shape
  });
  bad("grad_hidden_states_region.byte_size", [&](v1::BackwardRequest& r) {
    r.mutable_grad_hidden_states_region()->set_byte_size(size / 2);
  });
  bad("grad_hidden_states_region.region_id", [&](v1::BackwardRequest& r) {
    r.mutable_grad_hidden_states_region()->set_region_id(other_region);
  });
  bad("grad_hidden_states_region", [&](v1::BackwardRequest& r) {
    r.mutable_grad_hidden_states_region()->set_offset(2 * size + 4);
  });
  // Ordering by the caller's CUDA stream is for batches in GPU memory only.
  bad("stream_order", [&](v1::BackwardRequest& r) {
    v1::StreamOrder* order = r.mutable_stream_order();
    *order->mutable_ready() = Slice(region, 0, 4);
    *order->mutable_done() = Slice(region, 16, 4);
    order->set_value(1);
  });
  bad("hidden_states.raw_data", [&](v1::BackwardRequest& r) {
    r.mutable_hidden_states()->set_raw_data(std::string(bytes, '\0'));
  });
  v1::BackwardRequest last = good;
  last.set_batch_id(requests.size() + 1);
  requests.push_back(last);

  std::memset(others.data(), 0x55, 3 * bytes);
  grpc::Status status;
  const std::vector<v1::BackwardResponse> responses = RunStream(stub(), requests, &status);
  EXPECT_TRUE(status.ok()) << status.error_message();
  ASSERT_EQ(responses.size(), requests.size());
  for (const v1::BackwardResponse& response : responses) {
    auto field = expected_field.find(response.batch_id());
    if (field == expected_field.end()) {
      EXPECT_FALSE(response.has_error()) << response.error().message();  // the last, good one
      continue;
    }
    EXPECT_EQ(response.error().code(), grpc::StatusCode::INVALID_ARGUMENT)
        << "batch " << response.batch_id() << ": " << response.error().message();
    EXPECT_NE(response.error().message().find(field->second), std::string::npos)
        << "batch " << response.batch_id() << " should name " << field->second << ": "
        << response.error().message();
  }
  // Nothing was written into the other client's region.
  for (std::size_t i = 0; i < 3 * bytes; ++i) {
    if (others.data()[i] != 0x55) {
      ADD_FAILURE() << "byte " << i << " of another client's region was written";
      break;
    }
  }
}

// CUDA IPC regions (GPU memory) are opened only by a server on that GPU: on the CPU backend any
// such request is FAILED_PRECONDITION naming cuda_ipc; on a GPU server a device it does not
// compute on is FAILED_PRECONDITION naming cuda_ipc.device and a handle that does not open is
// INVALID_ARGUMENT naming cuda_ipc.handle (the real handles are tests/python/test_cuda_ipc.py's,
// from a second process). The server keeps serving: a region and a batch work afterwards.
TEST_F(RegionsTest, CudaIpcRegionsAreRefusedClearlyWhereTheyCannotBeOpened) {
  auto register_ipc = [&](const std::string& handle, int device, const std::string& name = "") {
    grpc::ClientContext context;
    v1::RegisterRegionRequest request;
    request.set_name(name);
    request.set_byte_size(4096);
    request.mutable_cuda_ipc()->set_handle(handle);
    request.mutable_cuda_ipc()->set_device(device);
    v1::RegisterRegionResponse response;
    return stub().RegisterRegion(&context, request, &response);
  };
  const std::string zero_handle(64, '\0');
  auto expect = [](const grpc::Status& status, grpc::StatusCode code, const std::string& field) {
    EXPECT_EQ(status.error_code(), code) << status.error_message();
    EXPECT_NE(status.error_message().find(field), std::string::npos)
        << "should name " << field << ": " << status.error_message();
  };
  expect(register_ipc(zero_handle, 0, "/attngrad-both"), grpc::StatusCode::INVALID_ARGUMENT,
         "name");
  if (!TestOnGpu()) {
    expect(register_ipc(zero_handle, 0), grpc::StatusCode::FAILED_PRECONDITION, "cuda_ipc");
  } else {
    expect(register_ipc(zero_handle, 99), grpc::StatusCode::FAILED_PRECONDITION, "cuda_ipc.device");
    expect(register_ipc(zero_handle.substr(1), 0), grpc::StatusCode::INVALID_ARGUMENT,
           "cuda_ipc.handle");
    expect(register_ipc(zero_handle, 0), grpc::StatusCode::INVALID_ARGUMENT, "cuda_ipc.handle");
  }

  const std::size_t bytes = ActivationBytes();
  SharedMemory memory(3 * bytes);
  std::uint64_t region = 0;
  ASSERT_TRUE(Register(memory, static_cast<std::int64_t>(3 * bytes), &region).ok());
  const Batch batch = MakeBatch(config(), kBatch, kSeqLen, 11);
  grpc::Status status;
  const std::vector<v1::BackwardResponse> responses = RunStream(
      stub(), {InRegion(MakeRequest(config(), batch, 1, v1::GRADIENT_MODE_RETURN), region, memory)},
      &status);
  EXPECT_TRUE(status.ok()) << status.error_message();
  ASSERT_EQ(responses.size(), 1u);
  EXPECT_FALSE(responses[0].has_error()) << responses[0].error().message();
}

// A region goes away once the process that passed its memfd has exited (the next registration,
// UnregisterRegion or stream end notices); RegisterRegion's owner_pid (CUDA IPC) that is no
// process is INVALID_ARGUMENT naming owner_pid.
TEST_F(RegionsTest, ARegionGoesAwayWithItsOwnerProcess) {
  grpc::ClientContext context;
  v1::RegisterRegionRequest owned_request;
  owned_request.set_byte_size(4096);
  owned_request.set_owner_pid(0x7ffffff0);
  v1::RegisterRegionResponse response;
  const grpc::Status no_process = stub().RegisterRegion(&context, owned_request, &response);
  EXPECT_EQ(no_process.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(no_process.error_message().find("owner_pid"), std::string::npos);

  SharedMemory memory(4096);
  int id_pipe[2];
  ASSERT_EQ(pipe(id_pipe), 0);
  const pid_t owner = fork();
  ASSERT_GE(owner, 0);
  if (owner == 0) {  // the owner: registers, says the id, waits to be killed
    const absl::StatusOr<std::uint64_t> id =
        RegisterRegionDescriptor(server().region_socket_path(), memory.fd(), 4096, {});
    const std::uint64_t value = id.ok() ? *id : 0;
    if (write(id_pipe[1], &value, sizeof(value)) != sizeof(value)) _exit(1);
    pause();
    _exit(0);
  }
  std::uint64_t owned = 0, mine = 0;
  ASSERT_EQ(read(id_pipe[0], &owned, sizeof(owned)), static_cast<ssize_t>(sizeof(owned)));
  close(id_pipe[0]);
  close(id_pipe[1]);
  ASSERT_NE(owned, 0u);
  ASSERT_TRUE(Register(memory, 4096, &mine).ok());
  kill(owner, SIGKILL);
  waitpid(owner, nullptr, 0);
  std::uint64_t other = 0;
  ASSERT_TRUE(Register(memory, 4096, &other).ok());  // notices the exit
  EXPECT_EQ(Unregister(owned).error_code(), grpc::StatusCode::INVALID_ARGUMENT);  // gone
  EXPECT_TRUE(Unregister(mine).ok());  // its owner (this process) lives
  EXPECT_TRUE(Unregister(other).ok());
}

TEST_F(RegionsTest, RegisterAndUnregisterCheckTheirArguments) {
  SharedMemory memory(4096);
  std::uint64_t id = 0;
  EXPECT_EQ(Register(memory, 0, &id).code(), absl::StatusCode::kInvalidArgument);
  const absl::Status too_big = Register(memory, 8192, &id);
  EXPECT_EQ(too_big.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(too_big.message().find("byte_size"), std::string::npos) << too_big;

  ASSERT_TRUE(Register(memory, 4096, &id).ok());
  EXPECT_EQ(Unregister(id, "other").error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(Unregister(id).ok());
  EXPECT_EQ(Unregister(id).error_code(), grpc::StatusCode::INVALID_ARGUMENT);

  // An unregistered region can no longer be named.
  const Batch batch = MakeBatch(config(), kBatch, kSeqLen, 8);
  v1::BackwardRequest request = MakeRequest(config(), batch, 9, v1::GRADIENT_MODE_RETURN);
  request.mutable_hidden_states()->clear_raw_data();
  *request.mutable_hidden_states_region() =
      Slice(id, 0, static_cast<std::int64_t>(ActivationBytes()));
  const v1::BackwardResponse response = RunOne(stub(), request);
  EXPECT_EQ(response.error().code(), grpc::StatusCode::INVALID_ARGUMENT)
      << response.error().message();
}

}  // namespace
}  // namespace attngrad::server::testing
