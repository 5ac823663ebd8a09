// SPEC section 2 steps 1, 5 and 9 on the CPU: the projection GEMMs (through OpenBLAS when present).
#include "cpu/gemm_host.h"

#include <algorithm>
#include <vector>

#include "cpu/parallel.h"

#if defined(ATTNGRAD_HAVE_OPENBLAS)
#include <cblas.h>
#endif

namespace attngrad::cpu {

#if defined(ATTNGRAD_HAVE_OPENBLAS)

void GemmRowMajor(Transpose trans_a, Transpose trans_b, int m, int n, int k, float alpha,
                  const float* a, int lda, const float* b, int ldb, float beta, float* c, int ldc,
                  int /*num_threads: OpenBLAS keeps its own*/) {
  cblas_sgemm(CblasRowMajor, trans_a == Transpose::kYes ? CblasTrans : CblasNoTrans,
              trans_b == Transpose::kYes ? CblasTrans : CblasNoTrans, m, n, k, alpha, a, lda, b,
              ldb, beta, c, ldc);
}

#else

void GemmRowMajor(Transpose trans_a, Transpose trans_b, int m, int n, int k, float alpha,
                  const float* a, int lda, const float* b, int ldb, float beta, float* c, int ldc,
                  int num_threads) {
  // Pack op(B) as [k, n] contiguous once, then each row of C is a sum of scaled rows of op(B).
  std::vector<float> packed_b(static_cast<std::size_t>(k) * n);
  for (int p = 0; p < k; ++p)
    for (int j = 0; j < n; ++j)
      packed_b[static_cast<std::size_t>(p) * n + j] =
          trans_b == Transpose::kNo ? b[static_cast<std::size_t>(p) * ldb + j]
                                    : b[static_cast<std::size_t>(j) * ldb + p];
  ParallelFor(m, num_threads, [&](long long row) {
    const int i = static_cast<int>(row);
    std::vector<float> accumulator(n, 0.f);
    for (int p = 0; p < k; ++p) {
      const float a_ip = trans_a == Transpose::kNo ? a[static_cast<std::size_t>(i) * lda + p]
                                                   : a[static_cast<std::size_t>(p) * lda + i];
      const float* b_row = packed_b.data() + static_cast<std::size_t>(p) * n;
      for (int j = 0; j < n; ++j) accumulator[j] += a_ip * b_row[j];
    }
    float* c_row = c + static_cast<std::size_t>(i) * ldc;
    for (int j = 0; j < n; ++j)
      c_row[j] = alpha * accumulator[j] + (beta == 0.f ? 0.f : beta * c_row[j]);
  });
}

#endif

}  // namespace attngrad::cpu
