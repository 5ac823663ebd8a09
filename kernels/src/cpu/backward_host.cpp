// The CPU reference backend: all of SPEC section 2 (steps 1-9), and the layer's forward output
// A Wo^T (ForwardHost, forward.h) from the same forward recomputation, in fp32 storage, with the
// projections in OpenBLAS (gemm_host), the attention rows accumulated in double and spread over
// threads, and every reduction in a fixed order, so the result is deterministic and independent of
// the thread count. It is the oracle of the GPU backend and the engine of the server on machines
// without one.
#include <cmath>
#include <cstddef>
#include <vector>

#include "attngrad/backward.h"
#include "attngrad/forward.h"
#include "cpu/gemm_host.h"
#include "cpu/parallel.h"
#include "validate.h"

namespace attngrad {
namespace {

using cpu::GemmRowMajor;
using cpu::ParallelFor;
using cpu::Transpose;

// Tokens per task of the element-wise stages; fixed, so that the norm-weight partial sums (one per
// chunk, added in chunk order) do not depend on the thread count.
constexpr int kTokensPerChunk = 64;

// Everything a call shares: sizes, scalars and the thread count.
struct Problem {
  LayerConfig config;
  int batch;
  int seq_len;
  long long tokens;
  Scalars scalars;
  int threads;
};

// Steps 2-3 for one projection (q or k): per token and head, RMSNorm with (1 + weight), then
// rotate-half RoPE. Keeps x_hat = x * r and r for the backward.
void NormRopeForward(const Problem& p, int heads, const float* projected, const float* norm_weight,
                     const float* cos, const float* sin, float* normalized, float* inv_rms,
                     float* rotated) {
  const int head_dim = p.config.head_dim;
  const int half = head_dim / 2;
  const int width = heads * head_dim;
  ParallelFor(p.tokens, p.threads, [&](long long token) {
    const float* cos_row = cos + token * head_dim;
    const float* sin_row = sin + token * head_dim;
    for (int h = 0; h < heads; ++h) {
      const std::size_t base = static_cast<std::size_t>(token) * width + h * head_dim;
      double square_sum = 0.0;
      for (int d = 0; d < head_dim; ++d)
        square_sum += double(projected[base + d]) * projected[base + d];
      const double r = 1.0 / std::sqrt(square_sum / head_dim + double(p.scalars.eps));
      inv_rms[token * heads + h] = static_cast<float>(r);
      for (int d = 0; d < head_dim; ++d)
        normalized[base + d] = static_cast<float>(projected[base + d] * r);
      for (int d = 0; d < head_dim; ++d) {
        const double scaled = double(normalized[base + d]) * (1.0 + double(norm_weight[d]));
        const int partner = d < half ? d + half : d - half;
        const double partner_scaled =
            double(normalized[base + partner]) * (1.0 + double(norm_weight[partner]));
        const double rotated_half = d < half ? -partner_scaled : partner_scaled;
        rotated[base + d] = static_cast<float>(scaled * cos_row[d] + rotated_half * sin_row[d]);
      }
    }
  });
}

// Capped score of SPEC step 4 for one (query, key) pair: returns c and sets tanh_out = t. Without
// soft-capping (softcap <= 0) c = s and t = 0, so the backward's factor (1 - t^2) is 1.
inline double CappedScore(const float* q_row, const float* k_row, int head_dim, double scaling,
                          double softcap, double* tanh_out) {
  double dot = 0.0;
  for (int d = 0; d < head_dim; ++d) dot += double(q_row[d]) * k_row[d];
  if (softcap <= 0.0) {
    *tanh_out = 0.0;
    return dot * scaling;
  }
  const double t = std::tanh(dot * scaling / softcap);
  *tanh_out = t;
  return softcap * t;
}

// The first key a query at position i sees: 0 (causal) or i - window + 1 (sliding window).
inline int FirstKey(int i, int sliding_window) {
  return sliding_window > 0 && i >= sliding_window ? i - sliding_window + 1 : 0;
}

// Step 4: causal soft-capped attention per (sequence, query head); writes A and the row
// log-sum-exp.
void AttentionForward(const Problem& p, const float* q_rot, const float* k_rot, const float* v,
                      float* attention_out, std::vector<double>& lse) {
  const LayerConfig& c = p.config;
  const int q_width = c.q_out(), kv_width = c.kv_out(), head_dim = c.head_dim, seq = p.seq_len;
  ParallelFor(static_cast<long long>(p.batch) * c.num_heads, p.threads, [&](long long task) {
    const int b = static_cast<int>(task / c.num_heads), h = static_cast<int>(task % c.num_heads);
    const int kv_head = h / c.group_size();
    std::vector<double> scores(seq), out_row(head_dim);
    for (int i = 0; i < seq; ++i) {
      const std::size_t qi = static_cast<std::size_t>(b * seq + i);
      const float* q_row = q_rot + qi * q_width + h * head_dim;
      double max_score = -INFINITY;
      const int first = FirstKey(i, p.scalars.sliding_window);
      for (int j = first; j <= i; ++j) {
        const float* k_row =
            k_rot + static_cast<std::size_t>(b * seq + j) * kv_width + kv_head * head_dim;
        double t;
        scores[j] = CappedScore(q_row, k_row, head_dim, p.scalars.scaling, p.scalars.softcap, &t);
        if (scores[j] > max_score) max_score = scores[j];
      }
      double sum = 0.0;
      for (int j = first; j <= i; ++j) sum += (scores[j] = std::exp(scores[j] - max_score));
      std::fill(out_row.begin(), out_row.end(), 0.0);
      for (int j = first; j <= i; ++j) {
        const float* v_row =
            v + static_cast<std::size_t>(b * seq + j) * kv_width + kv_head * head_dim;
        const double weight = scores[j] / sum;
        for (int d = 0; d < head_dim; ++d) out_row[d] += weight * v_row[d];
      }
      float* a_row = attention_out + qi * q_width + h * head_dim;
      for (int d = 0; d < head_dim; ++d) a_row[d] = static_cast<float>(out_row[d]);
      lse[(static_cast<std::size_t>(b) * c.num_heads + h) * seq + i] = max_score + std::log(sum);
    }
  });
}

// Step 6 per (sequence, key-value head): dq' of the group's query heads, and dk', dv summed over
// them. Each task owns its outputs, so no reduction crosses tasks.
void AttentionBackward(const Problem& p, const float* q_rot, const float* k_rot, const float* v,
                       const float* attention_out, const float* grad_attention,
                       const std::vector<double>& lse, float* grad_q_rot, float* grad_k_rot,
                       float* grad_v) {
  const LayerConfig& c = p.config;
  const int q_width = c.q_out(), kv_width = c.kv_out(), head_dim = c.head_dim, seq = p.seq_len;
  const double scaling = p.scalars.scaling, softcap = p.scalars.softcap;
  ParallelFor(static_cast<long long>(p.batch) * c.num_kv_heads, p.threads, [&](long long task) {
    const int b = static_cast<int>(task / c.num_kv_heads),
              g = static_cast<int>(task % c.num_kv_heads);
    std::vector<double> grad_k(static_cast<std::size_t>(seq) * head_dim, 0.0);
    std::vector<double> grad_v_acc(static_cast<std::size_t>(seq) * head_dim, 0.0);
    std::vector<double> grad_q(head_dim);
    auto kv_row = [&](const float* base, int j) {
      return base + static_cast<std::size_t>(b * seq + j) * kv_width + g * head_dim;
    };
    for (int h = g * c.group_size(); h < (g + 1) * c.group_size(); ++h) {
      for (int i = 0; i < seq; ++i) {
        const std::size_t qi = static_cast<std::size_t>(b * seq + i) * q_width + h * head_dim;
        const float* q_row = q_rot + qi;
        const float* o_row = attention_out + qi;
        const float* do_row = grad_attention + qi;
        const double row_lse = lse[(static_cast<std::size_t>(b) * c.num_heads + h) * seq + i];
        double delta = 0.0;
        for (int d = 0; d < head_dim; ++d) delta += double(do_row[d]) * o_row[d];
        std::fill(grad_q.begin(), grad_q.end(), 0.0);
        for (int j = FirstKey(i, p.scalars.sliding_window); j <= i; ++j) {
          const float* k_row = kv_row(k_rot, j);
          const float* v_row = kv_row(v, j);
          double t;
          const double prob =
              std::exp(CappedScore(q_row, k_row, head_dim, scaling, softcap, &t) - row_lse);
          double grad_prob = 0.0;
          for (int d = 0; d < head_dim; ++d) grad_prob += double(do_row[d]) * v_row[d];
          const double grad_score = prob * (grad_prob - delta) * (1.0 - t * t) * scaling;
          double* grad_k_row = grad_k.data() + static_cast<std::size_t>(j) * head_dim;
          double* grad_v_row = grad_v_acc.data() + static_cast<std::size_t>(j) * head_dim;
          for (int d = 0; d < head_dim; ++d) {
            grad_q[d] += grad_score * k_row[d];
            grad_k_row[d] += grad_score * q_row[d];
            grad_v_row[d] += prob * do_row[d];
          }
        }
        for (int d = 0; d < head_dim; ++d) grad_q_rot[qi + d] = static_cast<float>(grad_q[d]);
      }
    }
    for (int j = 0; j < seq; ++j) {
      const std::size_t offset = static_cast<std::size_t>(b * seq + j) * kv_width + g * head_dim;
      for (int d = 0; d < head_dim; ++d) {
        grad_k_rot[offset + d] =
            static_cast<float>(grad_k[static_cast<std::size_t>(j) * head_dim + d]);
        grad_v[offset + d] =
            static_cast<float>(grad_v_acc[static_cast<std::size_t>(j) * head_dim + d]);
      }
    }
  });
}

// Steps 7-8 for q or k: RoPE backward, then RMSNorm backward, in place (grad of the rotated tensor
// in, grad of the projection out), and the norm-weight gradient summed in a fixed chunk order.
void RopeNormBackward(const Problem& p, int heads, const float* normalized, const float* inv_rms,
                      const float* norm_weight, const float* cos, const float* sin, float* grad,
                      float* grad_norm_weight, bool accumulate) {
  const int head_dim = p.config.head_dim, half = head_dim / 2, width = heads * head_dim;
  const long long chunks = (p.tokens + kTokensPerChunk - 1) / kTokensPerChunk;
  std::vector<double> partials(static_cast<std::size_t>(chunks) * head_dim, 0.0);
  ParallelFor(chunks, p.threads, [&](long long chunk) {
    double* partial = partials.data() + static_cast<std::size_t>(chunk) * head_dim;
    std::vector<double> grad_normed(head_dim);
    const long long end = std::min<long long>(p.tokens, (chunk + 1) * kTokensPerChunk);
    for (long long token = chunk * kTokensPerChunk; token < end; ++token) {
      const float* cos_row = cos + token * head_dim;
      const float* sin_row = sin + token * head_dim;
      for (int h = 0; h < heads; ++h) {
        const std::size_t base = static_cast<std::size_t>(token) * width + h * head_dim;
        float* g = grad + base;
        // dqn = dq' * cos + rot^T(dq' * sin), rot^T(x) = [x[half:], -x[:half]].
        for (int d = 0; d < head_dim; ++d) {
          const double rotated_part = d < half ? double(g[d + half]) * sin_row[d + half]
                                               : -double(g[d - half]) * sin_row[d - half];
          grad_normed[d] = double(g[d]) * cos_row[d] + rotated_part;
        }
        double mean_product = 0.0;
        for (int d = 0; d < head_dim; ++d) {
          partial[d] += grad_normed[d] * normalized[base + d];
          grad_normed[d] *= 1.0 + double(norm_weight[d]);  // now g = dqn * (1 + w)
          mean_product += grad_normed[d] * normalized[base + d];
        }
        mean_product /= head_dim;
        const double r = inv_rms[token * heads + h];
        for (int d = 0; d < head_dim; ++d)
          g[d] = static_cast<float>(r *
                                    (grad_normed[d] - double(normalized[base + d]) * mean_product));
      }
    }
  });
  for (int d = 0; d < head_dim; ++d) {
    double total = 0.0;
    for (long long chunk = 0; chunk < chunks; ++chunk) total += partials[chunk * head_dim + d];
    grad_norm_weight[d] =
        static_cast<float>((accumulate ? double(grad_norm_weight[d]) : 0.0) + total);
  }
}

// Steps 1-4 recomputed from the inputs: A, and everything the backward reads afterwards.
struct ForwardState {
  std::vector<float> q, k, v;               // step 1: the projections [T, q_out] / [T, kv_out]
  std::vector<float> q_hat, k_hat;          // steps 2-3: x * r, kept for the RMSNorm backward
  std::vector<float> q_inv_rms, k_inv_rms;  // r = 1/rms per token and head
  std::vector<float> q_rot, k_rot;          // q', k': the attention's operands
  std::vector<float> attention_out;         // step 4: A [T, q_out]
  std::vector<double> lse;                  // the log-sum-exp of each attention row
};

Problem ProblemOf(const LayerConfig& config, int batch, int seq_len, const Scalars& scalars,
                  int num_threads) {
  return Problem{config,  batch,
                 seq_len, static_cast<long long>(batch) * seq_len,
                 scalars, cpu::ResolveThreadCount(num_threads)};
}

// The forward of SPEC section 2 (steps 1-4), shared by ForwardHost and BackwardHost.
ForwardState RecomputeForward(const Problem& p, const ForwardInputs& in) {
  const LayerConfig& config = p.config;
  const int tokens = static_cast<int>(p.tokens);
  const int hidden = config.hidden_size, q_width = config.q_out(), kv_width = config.kv_out();
  const std::size_t q_elems = static_cast<std::size_t>(tokens) * q_width;
  const std::size_t kv_elems = static_cast<std::size_t>(tokens) * kv_width;
  ForwardState f;

  // Step 1: the projections.
  f.q.resize(q_elems);
  f.k.resize(kv_elems);
  f.v.resize(kv_elems);
  GemmRowMajor(Transpose::kNo, Transpose::kYes, tokens, q_width, hidden, 1.f, in.hidden_states,
               hidden, in.weights[Weight::kQProj], hidden, 0.f, f.q.data(), q_width, p.threads);
  GemmRowMajor(Transpose::kNo, Transpose::kYes, tokens, kv_width, hidden, 1.f, in.hidden_states,
               hidden, in.weights[Weight::kKProj], hidden, 0.f, f.k.data(), kv_width, p.threads);
  GemmRowMajor(Transpose::kNo, Transpose::kYes, tokens, kv_width, hidden, 1.f, in.hidden_states,
               hidden, in.weights[Weight::kVProj], hidden, 0.f, f.v.data(), kv_width, p.threads);

  // Steps 2-3: RMSNorm + RoPE (q and k keep x_hat and 1/rms for the backward).
  f.q_hat.resize(q_elems);
  f.k_hat.resize(kv_elems);
  f.q_rot.resize(q_elems);
  f.k_rot.resize(kv_elems);
  f.q_inv_rms.resize(static_cast<std::size_t>(tokens) * config.num_heads);
  f.k_inv_rms.resize(static_cast<std::size_t>(tokens) * config.num_kv_heads);
  NormRopeForward(p, config.num_heads, f.q.data(), in.weights[Weight::kQNorm], in.cos, in.sin,
                  f.q_hat.data(), f.q_inv_rms.data(), f.q_rot.data());
  NormRopeForward(p, config.num_kv_heads, f.k.data(), in.weights[Weight::kKNorm], in.cos, in.sin,
                  f.k_hat.data(), f.k_inv_rms.data(), f.k_rot.data());

  // Step 4: attention forward (A and the row log-sum-exp).
  f.attention_out.resize(q_elems);
  f.lse.resize(static_cast<std::size_t>(p.batch) * config.num_heads * p.seq_len);
  AttentionForward(p, f.q_rot.data(), f.k_rot.data(), f.v.data(), f.attention_out.data(), f.lse);
  return f;
}

}  // namespace

Status ForwardHost(const LayerConfig& config, int batch, int seq_len, const Scalars& scalars,
                   const ForwardInputs& in, float* output, int num_threads) {
  const Status status = CheckForwardArguments(config, batch, seq_len, scalars, in, output);
  if (!status.ok()) return status;
  const Problem p = ProblemOf(config, batch, seq_len, scalars, num_threads);
  const ForwardState f = RecomputeForward(p, in);
  // The layer output Y = A Wo^T.
  const int q_width = config.q_out();
  GemmRowMajor(Transpose::kNo, Transpose::kYes, static_cast<int>(p.tokens), config.hidden_size,
               q_width, 1.f, f.attention_out.data(), q_width, in.weights[Weight::kOProj], q_width,
               0.f, output, config.hidden_size, p.threads);
  return Status{};
}

Status BackwardHost(const LayerConfig& config, int batch, int seq_len, const Scalars& scalars,
                    bool accumulate, const BackwardInputs& in, const BackwardOutputs& out,
                    int num_threads) {
  const Status status = CheckBackwardArguments(config, batch, seq_len, scalars, in, out);
  if (!status.ok()) return status;
  const Problem p = ProblemOf(config, batch, seq_len, scalars, num_threads);
  const int tokens = static_cast<int>(p.tokens);
  const int hidden = config.hidden_size, q_width = config.q_out(), kv_width = config.kv_out();
  const std::size_t q_elems = static_cast<std::size_t>(tokens) * q_width;
  const std::size_t kv_elems = static_cast<std::size_t>(tokens) * kv_width;
  const float weight_beta = accumulate ? 1.f : 0.f;

  // Steps 1-4: the forward recomputed.
  ForwardState f = RecomputeForward(p, ForwardInputs::Of(in));
  const float* attention_out = f.attention_out.data();

  // Step 5: dWo = dY^T A, dA = dY Wo.
  GemmRowMajor(Transpose::kYes, Transpose::kNo, hidden, q_width, tokens, 1.f, in.grad_output,
               hidden, attention_out, q_width, weight_beta, out.weight_gradients[Weight::kOProj],
               q_width, p.threads);
  std::vector<float> grad_attention(q_elems);
  GemmRowMajor(Transpose::kNo, Transpose::kNo, tokens, q_width, hidden, 1.f, in.grad_output, hidden,
               in.weights[Weight::kOProj], q_width, 0.f, grad_attention.data(), q_width, p.threads);

  // Step 6: attention backward. dq' and dk' reuse the storage of q and k (no longer needed).
  float* grad_q = f.q.data();
  float* grad_k = f.k.data();
  std::vector<float> grad_v_storage(kv_elems);
  float* grad_v = grad_v_storage.data();
  AttentionBackward(p, f.q_rot.data(), f.k_rot.data(), f.v.data(), attention_out,
                    grad_attention.data(), f.lse, grad_q, grad_k, grad_v);

  // Steps 7-8: RoPE + RMSNorm backward, norm-weight gradients.
  RopeNormBackward(p, config.num_heads, f.q_hat.data(), f.q_inv_rms.data(),
                   in.weights[Weight::kQNorm], in.cos, in.sin, grad_q,
                   out.weight_gradients[Weight::kQNorm], accumulate);
  RopeNormBackward(p, config.num_kv_heads, f.k_hat.data(), f.k_inv_rms.data(),
                   in.weights[Weight::kKNorm], in.cos, in.sin, grad_k,
                   out.weight_gradients[Weight::kKNorm], accumulate);

  // Step 9: grad_hidden_states = dq Wq + dk Wk + dv Wv; dW = d^T X.
  GemmRowMajor(Transpose::kNo, Transpose::kNo, tokens, hidden, q_width, 1.f, grad_q, q_width,
               in.weights[Weight::kQProj], hidden, 0.f, out.grad_hidden_states, hidden, p.threads);
  GemmRowMajor(Transpose::kNo, Transpose::kNo, tokens, hidden, kv_width, 1.f, grad_k, kv_width,
               in.weights[Weight::kKProj], hidden, 1.f, out.grad_hidden_states, hidden, p.threads);
  GemmRowMajor(Transpose::kNo, Transpose::kNo, tokens, hidden, kv_width, 1.f, grad_v, kv_width,
               in.weights[Weight::kVProj], hidden, 1.f, out.grad_hidden_states, hidden, p.threads);
  GemmRowMajor(Transpose::kYes, Transpose::kNo, q_width, hidden, tokens, 1.f, grad_q, q_width,
               in.hidden_states, hidden, weight_beta, out.weight_gradients[Weight::kQProj], hidden,
               p.threads);
  GemmRowMajor(Transpose::kYes, Transpose::kNo, kv_width, hidden, tokens, 1.f, grad_k, kv_width,
               in.hidden_states, hidden, weight_beta, out.weight_gradients[Weight::kKProj], hidden,
               p.threads);
  GemmRowMajor(Transpose::kYes, Transpose::kNo, kv_width, hidden, tokens, 1.f, grad_v, kv_width,
               in.hidden_states, hidden, weight_beta, out.weight_gradients[Weight::kVProj], hidden,
               p.threads);
  return Status{};
}

}  // namespace attngrad
