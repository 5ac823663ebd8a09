// The Hopper wgmma building blocks (kernels/src/cuda/hopper_wgmma.cuh) on their own: a 128 x N x K
// product C = A B^T by two warpgroups with both operands K-major in swizzled shared memory (each
// warpgroup its 64 rows of A), then E = fp16(C) V with C as the register A operand and V [N][N2]
// MN-major, against a float64 CPU evaluation. Skipped without a CUDA device, on a device other than
// compute capability 9.0, or when the binary holds no sm_90a code.
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "attngrad/cuda_resources.h"
#include "cuda/hopper_wgmma.cuh"

namespace attngrad::cuda::hopper {
namespace {

constexpr int kRowsA = 128;  // two warpgroups of 64 rows
constexpr int kThreads = 256;

template <int N, int K, int N2>
struct Shapes {
  using TileA = SwizzledTile<kRowsA, K>;
  using TileB = SwizzledTile<N, K>;
  using TileV = SwizzledTile<N, N2>;
  static constexpr int kSharedBytes = TileA::kBytes + TileB::kBytes + TileV::kBytes + 1024;
};

// a [128][K], b [N][K], v [N][N2] row-major fp16; c [128][N] and e [128][N2] fp32. *compiled = 1
// when this is the sm_90a code.
template <int N, int K, int N2>
__global__ void __launch_bounds__(kThreads)
    ProductKernel(const __half* a, const __half* b, const __half* v, float* c, float* e,
                  int* compiled) {
#if defined(ATTNGRAD_HOPPER_WGMMA)
  using S = Shapes<N, K, N2>;
  extern __shared__ unsigned char shared_raw[];
  const std::uint32_t base = (SharedAddress(shared_raw) + 1023u) & ~1023u;
  const std::uint32_t tile_a = base, tile_b = tile_a + S::TileA::kBytes,
                      tile_v = tile_b + S::TileB::kBytes;
  LoadSwizzledTileAsync<kRowsA, K, kThreads>(tile_a, a, K, 0, kRowsA, threadIdx.x);
  LoadSwizzledTileAsync<N, K, kThreads>(tile_b, b, K, 0, N, threadIdx.x);
  LoadSwizzledTileAsync<N, N2, kThreads>(tile_v, v, N2, 0, N, threadIdx.x);
  asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;\n" ::: "memory");
  FenceProxyAsync();
  __syncthreads();

  const int warpgroup = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const int row_a = 64 * warpgroup + 16 * warp + lane / 4, column = 2 * (lane % 4);

  float acc[N / 8][4];
  WgmmaFence();
#pragma unroll
  for (int k = 0; k < K / 16; ++k) {
    Wgmma<N>::template SharedShared<0, 0>(acc,
                                          KMajorDescriptor<kRowsA, K>(tile_a, 64 * warpgroup, k),
                                          KMajorDescriptor<N, K>(tile_b, 0, k), k > 0);
  }
  WgmmaCommit();
  WgmmaWait<0>();
  FenceAccumulators(acc);
#pragma unroll
  for (int n = 0; n < N / 8; ++n) {
    c[row_a * N + 8 * n + column] = acc[n][0];
    c[row_a * N + 8 * n + column + 1] = acc[n][1];
    c[(row_a + 8) * N + 8 * n + column] = acc[n][2];
    c[(row_a + 8) * N + 8 * n + column + 1] = acc[n][3];
  }

  std::uint32_t operand[N / 16][4];
  AccumulatorToOperand(acc, 1.f, operand);
  float out[N2 / 8][4];
  ClearAccumulator(out);
  WgmmaFence();
#pragma unroll
  for (int k = 0; k < N / 16; ++k) {
    Wgmma<N2>::template RegisterShared<1>(out, operand[k], MnMajorDescriptor<N, N2>(tile_v, k), 1);
  }
  WgmmaCommit();
  WgmmaWait<0>();
  FenceAccumulators(out);
#pragma unroll
  for (int n = 0; n < N2 / 8; ++n) {
    e[row_a * N2 + 8 * n + column] = out[n][0];
    e[row_a * N2 + 8 * n + column + 1] = out[n][1];
    e[(row_a + 8) * N2 + 8 * n + column] = out[n][2];
    e[(row_a + 8) * N2 + 8 * n + column + 1] = out[n][3];
  }
  if (threadIdx.x == 0) *compiled = 1;
#else
  if (threadIdx.x == 0) *compiled = 0;
#endif
}

bool IsHopper() {
  int count = 0, device = 0, major = 0, minor = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0 &&
         cudaGetDevice(&device) == cudaSuccess &&
         cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess &&
         cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) == cudaSuccess &&
         major == 9 && minor == 0;
}

template <class T>
DeviceBuffer<T> Upload(const std::vector<T>& host) {
  DeviceBuffer<T> buffer;
  EXPECT_EQ(DeviceBuffer<T>::Create(host.size(), &buffer), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(buffer.get(), host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice),
            cudaSuccess);
  return buffer;
}

template <class T>
std::vector<T> Download(const DeviceBuffer<T>& buffer, std::size_t size) {
  std::vector<T> host(size);
  EXPECT_EQ(cudaMemcpy(host.data(), buffer.get(), size * sizeof(T), cudaMemcpyDeviceToHost),
            cudaSuccess);
  return host;
}

template <int N, int K, int N2>
void CheckProduct(std::uint64_t seed) {
  if (!IsHopper()) GTEST_SKIP() << "needs a compute-capability-9.0 GPU";
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> uniform(-1.f, 1.f);
  auto random_half = [&](std::size_t size) {
    std::vector<__half> values(size);
    for (auto& x : values) x = __float2half_rn(uniform(rng));
    return values;
  };
  const std::vector<__half> a = random_half(kRowsA * K), b = random_half(N * K),
                            v = random_half(N * N2);
  const DeviceBuffer<__half> a_d = Upload(a), b_d = Upload(b), v_d = Upload(v);
  DeviceBuffer<float> c_d, e_d;
  DeviceBuffer<int> compiled_d;
  ASSERT_EQ(DeviceBuffer<float>::Create(kRowsA * N, &c_d), cudaSuccess);
  ASSERT_EQ(DeviceBuffer<float>::Create(kRowsA * N2, &e_d), cudaSuccess);
  ASSERT_EQ(DeviceBuffer<int>::Create(1, &compiled_d), cudaSuccess);
  ASSERT_EQ(cudaMemset(compiled_d.get(), 0xff, sizeof(int)), cudaSuccess);
  constexpr int kShared = Shapes<N, K, N2>::kSharedBytes;
  ASSERT_EQ(cudaFuncSetAttribute(ProductKernel<N, K, N2>,
                                 cudaFuncAttributeMaxDynamicSharedMemorySize, kShared),
            cudaSuccess);
  ProductKernel<N, K, N2><<<1, kThreads, kShared>>>(a_d.get(), b_d.get(), v_d.get(), c_d.get(),
                                                    e_d.get(), compiled_d.get());
  const cudaError_t launch = cudaGetLastError();
  if (launch == cudaErrorNoKernelImageForDevice) GTEST_SKIP() << "no sm_90a code in this build";
  ASSERT_EQ(launch, cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  if (Download(compiled_d, 1)[0] != 1) GTEST_SKIP() << "no sm_90a code in this build";

  const std::vector<float> c = Download(c_d, kRowsA * N), e = Download(e_d, kRowsA * N2);
  double worst_c = 0, worst_e = 0;
  for (int i = 0; i < kRowsA; ++i) {
    for (int j = 0; j < N; ++j) {
      double exact = 0;
      for (int k = 0; k < K; ++k) {
        exact += static_cast<double>(__half2float(a[i * K + k])) * __half2float(b[j * K + k]);
      }
      worst_c = std::fmax(worst_c, std::fabs(c[i * N + j] - exact) / (1.0 + std::fabs(exact)));
    }
    // E from the kernel's own C rounded to fp16 (the operand it used).
    for (int j = 0; j < N2; ++j) {
      double exact = 0;
      for (int k = 0; k < N; ++k) {
        exact += static_cast<double>(__half2float(__float2half_rn(c[i * N + k]))) *
                 __half2float(v[k * N2 + j]);
      }
      worst_e = std::fmax(worst_e, std::fabs(e[i * N2 + j] - exact) / (1.0 + std::fabs(exact)));
    }
  }
  EXPECT_LT(worst_c, 1e-4) << "A B^T (both K-major, from shared memory)";
  EXPECT_LT(worst_e, 1e-4) << "fp16(C) V (A from registers, V MN-major)";
}

TEST(HopperWgmmaTest, Product128x128x128) { CheckProduct<128, 128, 128>(1); }
TEST(HopperWgmmaTest, Product64x256x256) { CheckProduct<64, 256, 256>(2); }
TEST(HopperWgmmaTest, Product256x128x64) { CheckProduct<256, 128, 64>(3); }
TEST(HopperWgmmaTest, Product32x64x192) { CheckProduct<32, 64, 192>(4); }

// AccumulatorToSaturatedOperand on one thread's 4 x 4 accumulator: the same fp16 bits as
// AccumulatorToOperand's round to nearest for values in range (the halves in the same order), and
// +-65504 for values beyond fp16's range and infinities (AccumulatorToOperand gives +-inf there).
__global__ void SaturatedOperandKernel(const float* values, std::uint32_t* saturated,
                                       std::uint32_t* plain) {
  float c[4][4];
  for (int i = 0; i < 16; ++i) c[i / 4][i % 4] = values[i];
  std::uint32_t a[2][4], b[2][4];
  AccumulatorToSaturatedOperand(c, a);
  AccumulatorToOperand(c, 1.f, b);
  for (int i = 0; i < 8; ++i) {
    saturated[i] = a[i / 4][i % 4];
    plain[i] = b[i / 4][i % 4];
  }
}

TEST(HopperWgmmaTest, SaturatedOperandClampsToTheHalfRange) {
  if (!IsHopper()) GTEST_SKIP() << "needs a compute-capability-9.0 GPU";
  const float inf = INFINITY;
  const std::vector<float> values = {1.f,  -2.5f, 0.1f, 65504.f, 65519.f,  1e6f, -1e6f, inf,
                                     -inf, 3e-8f, -7.f, 1234.5f, -65536.f, 0.f,  4e4f,  -0.3333f};
  const DeviceBuffer<float> values_d = Upload(values);
  DeviceBuffer<std::uint32_t> saturated_d, plain_d;
  ASSERT_EQ(DeviceBuffer<std::uint32_t>::Create(8, &saturated_d), cudaSuccess);
  ASSERT_EQ(DeviceBuffer<std::uint32_t>::Create(8, &plain_d), cudaSuccess);
  SaturatedOperandKernel<<<1, 1>>>(values_d.get(), saturated_d.get(), plain_d.get());
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<std::uint32_t> saturated = Download(saturated_d, 8);
  const std::vector<std::uint32_t> plain = Download(plain_d, 8);
  // Operand word w holds accumulator elements (tile 2k + w / 2, elements 2 (w % 2), + 1) of k-step
  // k = word / 4: the value pairs in `values` order are (0,1) (2,3) (4,5) (6,7) | (8,9) ...
  for (int word = 0; word < 8; ++word) {
    for (int half = 0; half < 2; ++half) {
      const float value = values[2 * word + half];
      const auto bits = [half](std::uint32_t packed) {
        const std::uint16_t raw = static_cast<std::uint16_t>(packed >> (16 * half));
        __half h;
        std::memcpy(&h, &raw, 2);
        return __half2float(h);
      };
      const float expected = std::fabs(value) > 65504.f ? std::copysign(65504.f, value)
                                                        : __half2float(__float2half_rn(value));
      if (std::fabs(value) >= 65520.f) {  // beyond the rounding: only the saturated form clamps
        EXPECT_EQ(bits(saturated[word]), expected) << value;
        EXPECT_TRUE(std::isinf(bits(plain[word]))) << value;
      } else {
        EXPECT_EQ(bits(saturated[word]), bits(plain[word])) << value;
        EXPECT_EQ(bits(saturated[word]), expected) << value;
      }
    }
  }
}

}  // namespace
}  // namespace attngrad::cuda::hopper
