// FORWARD batches over CUDA IPC (same-host zero copy on the GPU): attngrad-server runs as a child
// process on GPU 0 (a process cannot open its own IPC handles), this test's GPU memory holds
// hidden_states, cos, sin and output_region. The output computed straight into that memory (fp32)
// or narrowed there (bf16) has the bits of the same batch sent as bytes; a stream-ordered batch
// (stream_order) waits for its ready word, then writes its done word behind the output. Label
// gpu: skips without a GPU (or, for stream_order, without the driver's stream memory operations).
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "child_process.h"
#include "server_test_util.h"

namespace attngrad::server::testing {
namespace {

// One cudaMalloc'd buffer of this process on GPU 0, freed at destruction.
class DeviceMemory {
 public:
  explicit DeviceMemory(std::size_t size) : size_(size) {
    EXPECT_EQ(cudaMalloc(&data_, size), cudaSuccess);
    EXPECT_EQ(cudaMemset(data_, 0, size), cudaSuccess);
  }
  ~DeviceMemory() { cudaFree(data_); }
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;
  char* data() const { return static_cast<char*>(data_); }
  std::size_t size() const { return size_; }

 private:
  void* data_ = nullptr;
  std::size_t size_;
};

class ServerForwardCudaIpcGpuTest : public ::testing::Test {
 protected:
  static constexpr int kBatch = 2, kSeqLen = 96;

  void SetUp() override {
    if (DeviceCount() < 1) GTEST_SKIP() << "needs a GPU";
    if (ServerBinary().empty()) GTEST_SKIP() << "built without ATTNGRAD_SERVER_BINARY";
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
    server_ = std::make_unique<ServerProcess>(std::vector<std::string>{
        "--listen=127.0.0.1:0", "--metrics_listen=", "--devices=0", "--weights=random",
        "--weights_seed=11",
        "--region_socket=/tmp/attngrad-forward-ipc-" + std::to_string(getpid()) + ".sock"});
    const int port = server_->WaitServing(120);
    ASSERT_NE(port, 0) << server_->log();
    grpc::ChannelArguments arguments;
    arguments.SetMaxReceiveMessageSize(-1);
    arguments.SetMaxSendMessageSize(-1);
    stub_ = v1::AttentionGradient::NewStub(grpc::CreateCustomChannel(
        "127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials(), arguments));
    batch_ = MakeBatch(config_, kBatch, kSeqLen, 950);
    // hidden_states | cos | sin | output | ready | done, each a multiple of 16 bytes.
    hidden_bytes_ = batch_.hidden_states.size() * sizeof(float);
    rotary_bytes_ = batch_.cos.size() * sizeof(float);
    memory_ = std::make_unique<DeviceMemory>(2 * hidden_bytes_ + 2 * rotary_bytes_ + 32);
    ASSERT_EQ(cudaMemcpy(memory_->data(), batch_.hidden_states.data(), hidden_bytes_,
                         cudaMemcpyHostToDevice),
              cudaSuccess);
    ASSERT_EQ(cudaMemcpy(memory_->data() + hidden_bytes_, batch_.cos.data(), rotary_bytes_,
                         cudaMemcpyHostToDevice),
              cudaSuccess);
    ASSERT_EQ(cudaMemcpy(memory_->data() + hidden_bytes_ + rotary_bytes_, batch_.sin.data(),
                         rotary_bytes_, cudaMemcpyHostToDevice),
              cudaSuccess);
    region_ = Register();
    ASSERT_NE(region_, 0u);
  }

  std::uint64_t Register() {
    cudaIpcMemHandle_t handle;
    EXPECT_EQ(cudaIpcGetMemHandle(&handle, memory_->data()), cudaSuccess);
    v1::RegisterRegionRequest request;
    request.set_byte_size(static_cast<std::int64_t>(memory_->size()));
    request.mutable_cuda_ipc()->set_handle(reinterpret_cast<const char*>(&handle), sizeof(handle));
    request.mutable_cuda_ipc()->set_device(0);
    request.set_owner_pid(getpid());
    v1::RegisterRegionResponse response;
    grpc::ClientContext context;
    const grpc::Status status = stub_->RegisterRegion(&context, request, &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return response.region_id();
  }

  v1::RegionSlice Slice(std::size_t offset, std::size_t bytes) const {
    v1::RegionSlice slice;
    slice.set_region_id(region_);
    slice.set_offset(static_cast<std::int64_t>(offset));
    slice.set_byte_size(static_cast<std::int64_t>(bytes));
    return slice;
  }
  std::size_t OutputOffset() const { return hidden_bytes_ + 2 * rotary_bytes_; }
  std::size_t ReadyOffset() const { return OutputOffset() + hidden_bytes_; }

  // The batch's request with its inputs and its output in this process's GPU memory.
  v1::BackwardRequest InGpuMemory(std::uint64_t batch_id, v1::DType response_dtype) const {
    v1::BackwardRequest request = MakeForwardRequest(config_, batch_, batch_id);
    request.set_precision(v1::PRECISION_AUTO);
    request.set_response_dtype(response_dtype);
    request.mutable_hidden_states()->clear_raw_data();
    request.mutable_rotary_tables()->mutable_cos()->clear_raw_data();
    request.mutable_rotary_tables()->mutable_sin()->clear_raw_data();
    *request.mutable_hidden_states_region() = Slice(0, hidden_bytes_);
    *request.mutable_cos_region() = Slice(hidden_bytes_, rotary_bytes_);
    *request.mutable_sin_region() = Slice(hidden_bytes_ + rotary_bytes_, rotary_bytes_);
    *request.mutable_output_region() =
        Slice(OutputOffset(),
              batch_.hidden_states.size() *
                  (response_dtype == v1::DTYPE_FLOAT32 ? sizeof(float) : sizeof(std::uint16_t)));
    return request;
  }

  // The same batch sent as bytes: the answer the GPU-memory path must equal bit for bit.
  std::string BytesPathOutput(v1::DType response_dtype) {
    v1::BackwardRequest request = MakeForwardRequest(config_, batch_, 1);
    request.set_precision(v1::PRECISION_AUTO);
    request.set_response_dtype(response_dtype);
    const v1::BackwardResponse response = RunOne(*stub_, request);
    EXPECT_FALSE(response.has_error()) << response.error().message();
    return response.output().raw_data();
  }

  std::string OutputInGpuMemory(std::size_t bytes) const {
    std::string output(bytes, '\0');
    EXPECT_EQ(
        cudaMemcpy(output.data(), memory_->data() + OutputOffset(), bytes, cudaMemcpyDeviceToHost),
        cudaSuccess);
    return output;
  }

  LayerConfig config_ = LayerConfig::Gemma3_4B();
  std::unique_ptr<ServerProcess> server_;
  std::unique_ptr<v1::AttentionGradient::Stub> stub_;
  Batch batch_;
  std::size_t hidden_bytes_ = 0, rotary_bytes_ = 0;
  std::unique_ptr<DeviceMemory> memory_;
  std::uint64_t region_ = 0;
};

TEST_F(ServerForwardCudaIpcGpuTest, OutputInGpuMemoryHasTheBitsOfTheBytesPath) {
  for (v1::DType dtype : {v1::DTYPE_FLOAT32, v1::DTYPE_BFLOAT16}) {
    const std::string expected = BytesPathOutput(dtype);
    ASSERT_FALSE(expected.empty());
    ASSERT_EQ(cudaMemset(memory_->data() + OutputOffset(), 0x7f, hidden_bytes_), cudaSuccess);
    const v1::BackwardResponse response = RunOne(*stub_, InGpuMemory(10 + dtype, dtype));
    ASSERT_FALSE(response.has_error()) << response.error().message();
    EXPECT_EQ(response.device(), "cuda:0");
    EXPECT_TRUE(response.output().raw_data().empty());
    EXPECT_EQ(response.output().dtype(), dtype);
    EXPECT_TRUE(OutputInGpuMemory(expected.size()) == expected)
        << v1::DType_Name(dtype) << ": the output in GPU memory differs from the bytes path's";
  }
}

TEST_F(ServerForwardCudaIpcGpuTest, StreamOrderedBatchWaitsForReadyAndWritesDone) {
  v1::GetModelInfoResponse info;
  {
    grpc::ClientContext context;
    ASSERT_TRUE(stub_->GetModelInfo(&context, v1::GetModelInfoRequest(), &info).ok());
  }
  ASSERT_GT(info.devices_size(), 0);
  if (!info.devices(0).stream_ordered_batches()) {
    GTEST_SKIP() << "the driver has no stream memory operations";
  }
  const std::string expected = BytesPathOutput(v1::DTYPE_FLOAT32);
  constexpr std::uint32_t kValue = 5;
  v1::BackwardRequest request = InGpuMemory(20, v1::DTYPE_FLOAT32);
  request.mutable_stream_order()->set_value(kValue);
  *request.mutable_stream_order()->mutable_ready() = Slice(ReadyOffset(), 4);
  *request.mutable_stream_order()->mutable_done() = Slice(ReadyOffset() + 16, 4);
  ASSERT_EQ(cudaMemset(memory_->data() + OutputOffset(), 0, hidden_bytes_ + 32), cudaSuccess);

  std::atomic<bool> answered{false};
  v1::BackwardResponse response;
  std::thread sender([&] {
    response = RunOne(*stub_, request);
    answered = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  EXPECT_FALSE(answered.load()) << "answered before its ready word was written";
  const std::uint32_t value = kValue;
  ASSERT_EQ(
      cudaMemcpy(memory_->data() + ReadyOffset(), &value, sizeof(value), cudaMemcpyHostToDevice),
      cudaSuccess);
  sender.join();
  ASSERT_FALSE(response.has_error()) << response.error().message();
  std::uint32_t done = 0;
  ASSERT_EQ(
      cudaMemcpy(&done, memory_->data() + ReadyOffset() + 16, sizeof(done), cudaMemcpyDeviceToHost),
      cudaSuccess);
  EXPECT_EQ(done, kValue);
  EXPECT_TRUE(OutputInGpuMemory(expected.size()) == expected);
}

// An output_region in GPU memory of the wrong size is INVALID_ARGUMENT naming it.
TEST_F(ServerForwardCudaIpcGpuTest, ShortOutputRegionIsRefusedNamingIt) {
  v1::BackwardRequest request = InGpuMemory(30, v1::DTYPE_FLOAT32);
  request.mutable_output_region()->set_byte_size(request.output_region().byte_size() - 16);
  const v1::BackwardResponse response = RunOne(*stub_, request);
  ASSERT_TRUE(response.has_error());
  EXPECT_EQ(response.error().code(), static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT));
  EXPECT_EQ(response.error().message().rfind("output_region", 0), 0u) << response.error().message();
}

}  // namespace
}  // namespace attngrad::server::testing
