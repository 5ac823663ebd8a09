// Float64 loops of SPEC.md section 2, written from the SPEC alone (see reference.h). Indexing:
// token t = b*S + s; projection outputs are [tokens, heads*head_dim] (head-major within a token),
// exactly like A; "rot" and "rotᵀ" are SPEC step 3 and step 7.
#include "reference.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace attngrad_test {
namespace {

using std::size_t;

struct Dims {
  size_t batch, seq, tokens, hidden, heads, kv_heads, dim, half, group, q_out, kv_out;
};

Dims DimsOf(const Inputs64& in) {
  Dims d{};
  d.batch = static_cast<size_t>(in.batch);
  d.seq = static_cast<size_t>(in.seq_len);
  d.tokens = d.batch * d.seq;
  d.hidden = static_cast<size_t>(in.config.hidden_size);
  d.heads = static_cast<size_t>(in.config.num_heads);
  d.kv_heads = static_cast<size_t>(in.config.num_kv_heads);
  d.dim = static_cast<size_t>(in.config.head_dim);
  d.half = d.dim / 2;
  d.group = d.heads / d.kv_heads;
  d.q_out = d.heads * d.dim;
  d.kv_out = d.kv_heads * d.dim;
  return d;
}

// out[t][o] = sum_i x[t][i] * w[o][i]   (x [tokens, in_features], w [out_features, in_features])
std::vector<double> ProjectRows(const std::vector<double>& x, const std::vector<double>& w,
                                size_t tokens, size_t in_features, size_t out_features) {
  std::vector<double> out(tokens * out_features, 0.0);
  for (size_t t = 0; t < tokens; ++t) {
    const double* xt = &x[t * in_features];
    for (size_t o = 0; o < out_features; ++o) {
      const double* wo = &w[o * in_features];
      double sum[4] = {0.0, 0.0, 0.0, 0.0};  // four partial sums: same math, 4x fewer stalls
      size_t i = 0;
      for (; i + 4 <= in_features; i += 4)
        for (size_t lane = 0; lane < 4; ++lane) sum[lane] += xt[i + lane] * wo[i + lane];
      for (; i < in_features; ++i) sum[0] += xt[i] * wo[i];
      out[t * out_features + o] = (sum[0] + sum[1]) + (sum[2] + sum[3]);
    }
  }
  return out;
}

// Per-token, per-head state of steps 2-3 for q or k.
struct NormRope {
  std::vector<double> x_hat;    // [tokens, heads*dim]   q̂ = q·r
  std::vector<double> inv_rms;  // [tokens, heads]       r
  std::vector<double> rotated;  // [tokens, heads*dim]   q' = qn ⊙ cos + rot(qn) ⊙ sin
};

NormRope NormRopeForward(const Dims& d, const std::vector<double>& projected, size_t heads,
                         const std::vector<double>& norm_weight, const Inputs64& in) {
  NormRope r;
  r.x_hat.assign(d.tokens * heads * d.dim, 0.0);
  r.inv_rms.assign(d.tokens * heads, 0.0);
  r.rotated.assign(d.tokens * heads * d.dim, 0.0);
  std::vector<double> normed(d.dim);
  for (size_t t = 0; t < d.tokens; ++t) {
    const double* cos = &in.cos[t * d.dim];
    const double* sin = &in.sin[t * d.dim];
    for (size_t h = 0; h < heads; ++h) {
      const size_t base = (t * heads + h) * d.dim;
      double mean_square = 0.0;
      for (size_t e = 0; e < d.dim; ++e) mean_square += projected[base + e] * projected[base + e];
      mean_square /= static_cast<double>(d.dim);
      const double inv = 1.0 / std::sqrt(mean_square + in.eps);
      r.inv_rms[t * heads + h] = inv;
      for (size_t e = 0; e < d.dim; ++e) {
        r.x_hat[base + e] = projected[base + e] * inv;
        normed[e] = r.x_hat[base + e] * (1.0 + norm_weight[e]);
      }
      for (size_t e = 0; e < d.dim; ++e) {
        const double rot = e < d.half ? -normed[e + d.half] : normed[e - d.half];
        r.rotated[base + e] = normed[e] * cos[e] + rot * sin[e];
      }
    }
  }
  return r;
}

// Softmax row of step 4 for query i of head h: fills tanh values t[j] and probabilities p[j], j <=
// i. Without soft-capping (softcap <= 0) c = s and t = 0. Keys outside a sliding window (j <= i -
// window) are masked: c = -inf, so p = 0 and they add nothing anywhere.
void AttentionRow(const Dims& d, const Inputs64& in, const std::vector<double>& q_rot,
                  const std::vector<double>& k_rot, size_t b, size_t h, size_t i,
                  std::vector<double>& t_row, std::vector<double>& p_row) {
  const size_t kvh = h / d.group;
  const double* qi = &q_rot[((b * d.seq + i) * d.heads + h) * d.dim];
  double max_c = -std::numeric_limits<double>::infinity();
  for (size_t j = 0; j <= i; ++j) {
    const double* kj = &k_rot[((b * d.seq + j) * d.kv_heads + kvh) * d.dim];
    double dot = 0.0;
    for (size_t e = 0; e < d.dim; ++e) dot += qi[e] * kj[e];
    const double s = dot * in.scaling;
    t_row[j] = in.softcap > 0.0 ? std::tanh(s / in.softcap) : 0.0;
    const bool masked = in.sliding_window > 0 && i - j >= static_cast<size_t>(in.sliding_window);
    const double c = masked ? -std::numeric_limits<double>::infinity()
                            : (in.softcap > 0.0 ? in.softcap * t_row[j] : s);
    p_row[j] = c;
    if (c > max_c) max_c = c;
  }
  double sum = 0.0;
  for (size_t j = 0; j <= i; ++j) {
    p_row[j] = std::exp(p_row[j] - max_c);
    sum += p_row[j];
  }
  for (size_t j = 0; j <= i; ++j) p_row[j] /= sum;
}

struct Forward {
  Dims d;
  std::vector<double> v;  // [tokens, kv_out]
  NormRope q, k;
  std::vector<double> a;  // [tokens, q_out]  A
};

Forward RunForward(const Inputs64& in) {
  Forward f;
  const Dims& d = f.d = DimsOf(in);
  // Step 1.
  const std::vector<double> q = ProjectRows(in.hidden_states, in.weights[attngrad::Weight::kQProj],
                                            d.tokens, d.hidden, d.q_out);
  const std::vector<double> k = ProjectRows(in.hidden_states, in.weights[attngrad::Weight::kKProj],
                                            d.tokens, d.hidden, d.kv_out);
  f.v = ProjectRows(in.hidden_states, in.weights[attngrad::Weight::kVProj], d.tokens, d.hidden,
                    d.kv_out);
  // Steps 2-3.
  f.q = NormRopeForward(d, q, d.heads, in.weights[attngrad::Weight::kQNorm], in);
  f.k = NormRopeForward(d, k, d.kv_heads, in.weights[attngrad::Weight::kKNorm], in);
  // Step 4.
  f.a.assign(d.tokens * d.q_out, 0.0);
  std::vector<double> t_row(d.seq), p_row(d.seq);
  for (size_t b = 0; b < d.batch; ++b)
    for (size_t h = 0; h < d.heads; ++h)
      for (size_t i = 0; i < d.seq; ++i) {
        AttentionRow(d, in, f.q.rotated, f.k.rotated, b, h, i, t_row, p_row);
        double* out = &f.a[((b * d.seq + i) * d.heads + h) * d.dim];
        for (size_t j = 0; j <= i; ++j) {
          const double* vj = &f.v[((b * d.seq + j) * d.kv_heads + h / d.group) * d.dim];
          for (size_t e = 0; e < d.dim; ++e) out[e] += p_row[j] * vj[e];
        }
      }
  return f;
}

// Steps 7-8 for q or k: from d(rotated) to d(projected), accumulating the norm-weight gradient.
void NormRopeBackward(const Dims& d, const Inputs64& in, const NormRope& state, size_t heads,
                      const std::vector<double>& norm_weight, const std::vector<double>& d_rotated,
                      std::vector<double>& d_projected, std::vector<double>& grad_norm_weight) {
  d_projected.assign(d.tokens * heads * d.dim, 0.0);
  grad_norm_weight.assign(d.dim, 0.0);
  std::vector<double> scaled_sin(d.dim), d_normed(d.dim), g(d.dim);
  for (size_t t = 0; t < d.tokens; ++t) {
    const double* cos = &in.cos[t * d.dim];
    const double* sin = &in.sin[t * d.dim];
    for (size_t h = 0; h < heads; ++h) {
      const size_t base = (t * heads + h) * d.dim;
      // Step 7: dqn = dq' ⊙ cos + rotᵀ(dq' ⊙ sin), rotᵀ(g) = [g[half:], -g[:half]].
      for (size_t e = 0; e < d.dim; ++e) scaled_sin[e] = d_rotated[base + e] * sin[e];
      for (size_t e = 0; e < d.dim; ++e) {
        const double rot_t = e < d.half ? scaled_sin[e + d.half] : -scaled_sin[e - d.half];
        d_normed[e] = d_rotated[base + e] * cos[e] + rot_t;
      }
      // Step 8.
      double mean_g_xhat = 0.0;
      for (size_t e = 0; e < d.dim; ++e) {
        grad_norm_weight[e] += d_normed[e] * state.x_hat[base + e];
        g[e] = d_normed[e] * (1.0 + norm_weight[e]);
        mean_g_xhat += g[e] * state.x_hat[base + e];
      }
      mean_g_xhat /= static_cast<double>(d.dim);
      const double inv = state.inv_rms[t * heads + h];
      for (size_t e = 0; e < d.dim; ++e)
        d_projected[base + e] = inv * (g[e] - state.x_hat[base + e] * mean_g_xhat);
    }
  }
}

// grad_w[o][i] = sum_t dy[t][o] * x[t][i]
std::vector<double> WeightGradient(const std::vector<double>& dy, const std::vector<double>& x,
                                   size_t tokens, size_t out_features, size_t in_features) {
  std::vector<double> grad(out_features * in_features, 0.0);
  for (size_t t = 0; t < tokens; ++t)
    for (size_t o = 0; o < out_features; ++o) {
      const double g = dy[t * out_features + o];
      double* row = &grad[o * in_features];
      const double* xt = &x[t * in_features];
      for (size_t i = 0; i < in_features; ++i) row[i] += g * xt[i];
    }
  return grad;
}

// grad_x[t][i] += sum_o dy[t][o] * w[o][i]
void AddInputGradient(const std::vector<double>& dy, const std::vector<double>& w, size_t tokens,
                      size_t out_features, size_t in_features, std::vector<double>& grad_x) {
  for (size_t t = 0; t < tokens; ++t)
    for (size_t o = 0; o < out_features; ++o) {
      const double g = dy[t * out_features + o];
      const double* wo = &w[o * in_features];
      double* gx = &grad_x[t * in_features];
      for (size_t i = 0; i < in_features; ++i) gx[i] += g * wo[i];
    }
}

}  // namespace

std::array<std::size_t, kNumGradients> GradientSizes(const attngrad::LayerConfig& config, int batch,
                                                     int seq_len) {
  const size_t tokens = static_cast<size_t>(batch) * static_cast<size_t>(seq_len);
  const size_t hidden = static_cast<size_t>(config.hidden_size);
  const size_t q_out = static_cast<size_t>(config.num_heads) * static_cast<size_t>(config.head_dim);
  const size_t kv_out =
      static_cast<size_t>(config.num_kv_heads) * static_cast<size_t>(config.head_dim);
  const size_t dim = static_cast<size_t>(config.head_dim);
  return {
      tokens * hidden, q_out * hidden, kv_out * hidden, kv_out * hidden, hidden * q_out, dim, dim};
}

std::vector<double> ReferenceLayerOutput(const Inputs64& in) {
  const Forward f = RunForward(in);
  return ProjectRows(f.a, in.weights[attngrad::Weight::kOProj], f.d.tokens, f.d.q_out, f.d.hidden);
}

double ReferenceLoss(const Inputs64& in) {
  const std::vector<double> y = ReferenceLayerOutput(in);
  double loss = 0.0;
  for (size_t i = 0; i < y.size(); ++i) loss += in.grad_output[i] * y[i];
  return loss;
}

double ReferenceMaxAbsScore(const Inputs64& in) {
  const Forward f = RunForward(in);
  const Dims& d = f.d;
  double max_abs = 0.0;
  for (size_t b = 0; b < d.batch; ++b)
    for (size_t h = 0; h < d.heads; ++h)
      for (size_t i = 0; i < d.seq; ++i)
        for (size_t j = 0; j <= i; ++j) {
          const double* qi = &f.q.rotated[((b * d.seq + i) * d.heads + h) * d.dim];
          const double* kj = &f.k.rotated[((b * d.seq + j) * d.kv_heads + h / d.group) * d.dim];
          double dot = 0.0;
          for (size_t e = 0; e < d.dim; ++e) dot += qi[e] * kj[e];
          max_abs = std::max(max_abs, std::fabs(dot * in.scaling));
        }
  return max_abs;
}

Gradients<double> ReferenceBackward(const Inputs64& in) {
  const Forward f = RunForward(in);
  const Dims& d = f.d;
  Gradients<double> out;

  // Step 5: dWo = dYᵀ A; dA = dY Wo.
  out[4] = WeightGradient(in.grad_output, f.a, d.tokens, d.hidden, d.q_out);
  std::vector<double> d_a(d.tokens * d.q_out, 0.0);
  AddInputGradient(in.grad_output, in.weights[attngrad::Weight::kOProj], d.tokens, d.hidden,
                   d.q_out, d_a);

  // Step 6, per (batch, query head), with P and t recomputed row by row.
  std::vector<double> d_q_rot(d.tokens * d.q_out, 0.0);
  std::vector<double> d_k_rot(d.tokens * d.kv_out, 0.0);
  std::vector<double> d_v(d.tokens * d.kv_out, 0.0);
  std::vector<double> t_row(d.seq), p_row(d.seq), dp_row(d.seq);
  for (size_t b = 0; b < d.batch; ++b)
    for (size_t h = 0; h < d.heads; ++h) {
      const size_t kvh = h / d.group;
      for (size_t i = 0; i < d.seq; ++i) {
        AttentionRow(d, in, f.q.rotated, f.k.rotated, b, h, i, t_row, p_row);
        const size_t qi_base = ((b * d.seq + i) * d.heads + h) * d.dim;
        const double* d_o = &d_a[qi_base];
        const double* o = &f.a[qi_base];
        double delta = 0.0;  // Δ = rowsum(dO ⊙ O)
        for (size_t e = 0; e < d.dim; ++e) delta += d_o[e] * o[e];
        for (size_t j = 0; j <= i; ++j) {
          const size_t kj_base = ((b * d.seq + j) * d.kv_heads + kvh) * d.dim;
          double dp = 0.0;  // dP = dO vᵀ
          for (size_t e = 0; e < d.dim; ++e) dp += d_o[e] * f.v[kj_base + e];
          dp_row[j] = dp;
          for (size_t e = 0; e < d.dim; ++e) d_v[kj_base + e] += p_row[j] * d_o[e];  // dv += Pᵀ dO
        }
        for (size_t j = 0; j <= i; ++j) {
          const size_t kj_base = ((b * d.seq + j) * d.kv_heads + kvh) * d.dim;
          const double ds =
              p_row[j] * (dp_row[j] - delta) * (1.0 - t_row[j] * t_row[j]) * in.scaling;
          for (size_t e = 0; e < d.dim; ++e) {
            d_q_rot[qi_base + e] += ds * f.k.rotated[kj_base + e];  // dq' = dS k'
            d_k_rot[kj_base + e] += ds * f.q.rotated[qi_base + e];  // dk' += dSᵀ q'
          }
        }
      }
    }

  // Steps 7-8.
  std::vector<double> d_q, d_k;
  NormRopeBackward(d, in, f.q, d.heads, in.weights[attngrad::Weight::kQNorm], d_q_rot, d_q, out[5]);
  NormRopeBackward(d, in, f.k, d.kv_heads, in.weights[attngrad::Weight::kKNorm], d_k_rot, d_k,
                   out[6]);

  // Step 9.
  out[0].assign(d.tokens * d.hidden, 0.0);
  AddInputGradient(d_q, in.weights[attngrad::Weight::kQProj], d.tokens, d.q_out, d.hidden, out[0]);
  AddInputGradient(d_k, in.weights[attngrad::Weight::kKProj], d.tokens, d.kv_out, d.hidden, out[0]);
  AddInputGradient(d_v, in.weights[attngrad::Weight::kVProj], d.tokens, d.kv_out, d.hidden, out[0]);
  out[1] = WeightGradient(d_q, in.hidden_states, d.tokens, d.q_out, d.hidden);
  out[2] = WeightGradient(d_k, in.hidden_states, d.tokens, d.kv_out, d.hidden);
  out[3] = WeightGradient(d_v, in.hidden_states, d.tokens, d.kv_out, d.hidden);
  return out;
}

}  // namespace attngrad_test
