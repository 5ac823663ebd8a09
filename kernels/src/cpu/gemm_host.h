// Row-major single-precision GEMM on the CPU, C = alpha * op(A) op(B) + beta * C: OpenBLAS when the
// build found it, otherwise a cache-blocked loop nest parallel over rows of C.
#ifndef ATTNGRAD_KERNELS_CPU_GEMM_HOST_H_
#define ATTNGRAD_KERNELS_CPU_GEMM_HOST_H_

namespace attngrad::cpu {

enum class Transpose { kNo, kYes };

// op(A) is [m, k], op(B) is [k, n], C is [m, n]; lda/ldb/ldc are the row strides of A, B, C as
// stored. beta == 0 overwrites C without reading it.
void GemmRowMajor(Transpose trans_a, Transpose trans_b, int m, int n, int k, float alpha,
                  const float* a, int lda, const float* b, int ldb, float beta, float* c, int ldc,
                  int num_threads);

}  // namespace attngrad::cpu

#endif  // ATTNGRAD_KERNELS_CPU_GEMM_HOST_H_
