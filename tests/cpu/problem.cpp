#include "problem.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <sstream>

namespace attngrad_test {
namespace {

std::vector<float> RandomNormal(std::mt19937_64& rng, std::size_t count, double scale) {
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<float> values(count);
  for (float& v : values) v = static_cast<float>(normal(rng) * scale);
  return values;
}

std::vector<double> Widen(const std::vector<float>& v) {
  return std::vector<double>(v.begin(), v.end());
}

}  // namespace

attngrad::BackwardInputs Problem::Inputs() const {
  attngrad::BackwardInputs in;
  in.grad_output = grad_output.data();
  in.hidden_states = hidden_states.data();
  in.cos = cos.data();
  in.sin = sin.data();
  in.weights = attngrad::DataOf(weights);
  return in;
}

Inputs64 Problem::Widened() const {
  Inputs64 in;
  in.config = config;
  in.batch = batch;
  in.seq_len = seq_len;
  in.scaling = scalars.scaling;
  in.softcap = scalars.softcap;
  in.eps = scalars.eps;
  in.sliding_window = scalars.sliding_window;
  in.grad_output = Widen(grad_output);
  in.hidden_states = Widen(hidden_states);
  in.cos = Widen(cos);
  in.sin = Widen(sin);
  for (attngrad::Weight weight : attngrad::kAllWeights) in.weights[weight] = Widen(weights[weight]);
  return in;
}

Problem MakeProblem(const attngrad::LayerConfig& config, int batch, int seq_len,
                    const attngrad::Scalars& scalars, std::uint64_t seed,
                    const ProblemOptions& options) {
  Problem p;
  p.config = config;
  p.batch = batch;
  p.seq_len = seq_len;
  p.scalars = scalars;
  std::mt19937_64 rng(seed);
  const auto sizes = GradientSizes(config, batch, seq_len);
  const double hidden = config.hidden_size;
  const double weight_scale = std::sqrt(2.0 / hidden);
  p.hidden_states = RandomNormal(rng, sizes[0], 1.0 / std::sqrt(hidden));
  p.grad_output = RandomNormal(rng, sizes[0], 1.0);
  for (attngrad::Weight weight : attngrad::kAllWeights) {
    const bool is_norm = weight == attngrad::Weight::kQNorm || weight == attngrad::Weight::kKNorm;
    p.weights[weight] = RandomNormal(rng, attngrad::WeightElements(config, weight),
                                     is_norm ? options.norm_weight_std : weight_scale);
  }

  if (options.zero_token >= 0) {
    const std::size_t row = static_cast<std::size_t>(options.zero_token) * config.hidden_size;
    std::fill(p.hidden_states.begin() + static_cast<std::ptrdiff_t>(row),
              p.hidden_states.begin() + static_cast<std::ptrdiff_t>(row + config.hidden_size),
              0.0f);
  }

  const int dim = config.head_dim;
  const int half = dim / 2;
  // RoPE only sees position differences, so a shifted 0..S-1 per sequence would give the same
  // gradients as shared cos/sin: distinct sequences get a random start AND random gaps (1..4).
  std::uniform_int_distribution<int> start_position(0, 8191);
  std::uniform_int_distribution<int> gap(1, 4);
  p.cos.resize(static_cast<std::size_t>(batch) * seq_len * dim);
  p.sin.resize(p.cos.size());
  for (int b = 0; b < batch; ++b) {
    double position = options.distinct_positions ? start_position(rng) : 0;
    for (int s = 0; s < seq_len; ++s) {
      if (s > 0) position += options.distinct_positions ? gap(rng) : 1;
      for (int i = 0; i < half; ++i) {
        const double inv_freq = std::pow(options.rope_theta, -2.0 * i / dim);
        const double angle = position * inv_freq;
        const std::size_t base = (static_cast<std::size_t>(b) * seq_len + s) * dim;
        p.cos[base + i] = p.cos[base + i + half] = static_cast<float>(std::cos(angle));
        p.sin[base + i] = p.sin[base + i + half] = static_cast<float>(std::sin(angle));
      }
    }
  }
  return p;
}

Gradients<float> MakeOutputBuffers(const attngrad::LayerConfig& config, int batch, int seq_len,
                                   float fill) {
  Gradients<float> g;
  const auto sizes = GradientSizes(config, batch, seq_len);
  for (int i = 0; i < kNumGradients; ++i) g[i].assign(sizes[static_cast<std::size_t>(i)], fill);
  return g;
}

attngrad::BackwardOutputs OutputsOf(Gradients<float>& buffers) {
  attngrad::BackwardOutputs out;
  out.grad_hidden_states = buffers[0].data();
  for (attngrad::Weight weight : attngrad::kAllWeights) {
    out.weight_gradients[weight] = buffers[kFirstWeightGradient + attngrad::IndexOf(weight)].data();
  }
  return out;
}

attngrad_status RunHost(const Problem& problem, bool accumulate, Gradients<float>& out,
                        int num_threads) {
  return attngrad::BackwardHost(problem.config, problem.batch, problem.seq_len, problem.scalars,
                                accumulate, problem.Inputs(), OutputsOf(out), num_threads)
      .code;
}

attngrad::Status RunForwardHost(const Problem& problem, std::vector<float>& output,
                                int num_threads) {
  return attngrad::ForwardHost(problem.config, problem.batch, problem.seq_len, problem.scalars,
                               attngrad::ForwardInputs::Of(problem.Inputs()), output.data(),
                               num_threads);
}

std::uint64_t SeedOf(const std::string& name) {
  std::uint64_t h = 1469598103934665603ULL;
  for (unsigned char ch : name) h = (h ^ ch) * 1099511628211ULL;
  return h;
}

attngrad::Scalars DefaultScalarsFor(int head_dim) {
  attngrad::Scalars s;
  s.scaling = static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)));
  return s;
}

Tolerance ConditionedTolerance(double max_abs_score) {
  constexpr double kUnitRoundoff = 0x1p-24;
  const double score_error = 2.0 * kUnitRoundoff * max_abs_score;
  Tolerance tolerance;
  const double scale = 1.0 + score_error / tolerance.rel_norm;
  tolerance.rel_norm *= scale;
  tolerance.rtol *= scale;
  tolerance.atol_rms *= scale;
  return tolerance;
}

::testing::AssertionResult MeetsSpecBar(const std::string& what, const std::vector<float>& got,
                                        const std::vector<double>& ref, double atol) {
  if (got.size() != ref.size()) {
    return ::testing::AssertionFailure()
           << what << ": " << got.size() << " elements, expected " << ref.size();
  }
  std::size_t misses = 0;
  double worst = 0.0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    const double g = static_cast<double>(got[i]);
    if (!std::isfinite(g)) {
      return ::testing::AssertionFailure() << what << "[" << i << "] = " << g << " is not finite";
    }
    const double error = std::fabs(g - ref[i]);
    worst = std::max(worst, error);
    if (error > atol + 1e-3 * std::fabs(ref[i])) ++misses;
  }
  if (misses * 100 > ref.size()) {
    return ::testing::AssertionFailure() << what << ": " << misses << " of " << ref.size()
                                         << " elements miss SPEC section 4's bar (more than 1%); "
                                            "worst |error| "
                                         << worst;
  }
  return ::testing::AssertionSuccess();
}

template <typename T>
::testing::AssertionResult Matches(const std::string& what, const std::vector<T>& got,
                                   const std::vector<double>& ref, const Tolerance& tolerance,
                                   MatchStats* stats) {
  if (got.size() != ref.size()) {
    return ::testing::AssertionFailure()
           << what << ": " << got.size() << " elements, expected " << ref.size();
  }
  double sum_sq_ref = 0.0, sum_sq_err = 0.0, max_abs_ref = 0.0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    const double g = static_cast<double>(got[i]);
    if (!std::isfinite(g)) {
      return ::testing::AssertionFailure()
             << what << "[" << i << "] = " << g << " is not finite (expected " << ref[i] << ")";
    }
    sum_sq_ref += ref[i] * ref[i];
    sum_sq_err += (g - ref[i]) * (g - ref[i]);
    max_abs_ref = std::max(max_abs_ref, std::fabs(ref[i]));
  }
  MatchStats s;
  s.rms_ref = ref.empty() ? 0.0 : std::sqrt(sum_sq_ref / static_cast<double>(ref.size()));
  s.rel_norm_error = sum_sq_ref > 0 ? std::sqrt(sum_sq_err / sum_sq_ref) : std::sqrt(sum_sq_err);
  // An identically zero reference (e.g. the q/k gradients at S = 1, where P = 1 makes dS = 0) has
  // no scale of its own: then every element must be within zero_atol of 0.
  const double atol = s.rms_ref > 0 ? tolerance.atol_rms * s.rms_ref : tolerance.zero_atol;
  std::size_t misses = 0, worst = 0;
  double worst_excess = -1.0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    const double err = std::fabs(static_cast<double>(got[i]) - ref[i]);
    s.max_abs_error = std::max(s.max_abs_error, err);
    const double allowed = atol + tolerance.rtol * std::fabs(ref[i]);
    if (err > allowed) ++misses;
    const double excess = err / std::max(allowed, 1e-300);
    if (excess > worst_excess) {
      worst_excess = excess;
      worst = i;
    }
  }
  s.max_abs_error_over_rms = s.rms_ref > 0 ? s.max_abs_error / s.rms_ref : s.max_abs_error;
  if (stats) *stats = s;
  if (misses > 0 || (s.rms_ref > 0 && s.rel_norm_error > tolerance.rel_norm)) {
    return ::testing::AssertionFailure()
           << what << ": " << misses << " of " << ref.size() << " elements outside "
           << (s.rms_ref > 0 ? tolerance.atol_rms : tolerance.zero_atol)
           << (s.rms_ref > 0 ? "*rms(ref) + " : " (reference all zero) + ") << tolerance.rtol
           << "*|ref|; worst [" << worst << "] got " << static_cast<double>(got[worst]) << " ref "
           << ref[worst] << "; ||err||/||ref|| = " << s.rel_norm_error << " (allowed "
           << tolerance.rel_norm << "); max|err| = " << s.max_abs_error
           << ", rms(ref) = " << s.rms_ref << ", max|ref| = " << max_abs_ref;
  }
  return ::testing::AssertionSuccess();
}

template <typename T>
::testing::AssertionResult AllMatch(const std::string& context, const Gradients<T>& got,
                                    const Gradients<double>& ref, const Tolerance& tolerance) {
  const bool verbose = std::getenv("ATTNGRAD_TEST_VERBOSE") != nullptr;
  ::testing::AssertionResult result = ::testing::AssertionSuccess();
  std::ostringstream failures;
  bool failed = false;
  for (int i = 0; i < kNumGradients; ++i) {
    MatchStats stats;
    const auto r =
        Matches(kGradientNames[static_cast<std::size_t>(i)], got[i], ref[i], tolerance, &stats);
    if (verbose) {
      std::printf("[stats] %s %-18s rel_norm_err %.3e max_err/rms %.3e rms %.3e\n", context.c_str(),
                  kGradientNames[static_cast<std::size_t>(i)], stats.rel_norm_error,
                  stats.max_abs_error_over_rms, stats.rms_ref);
    }
    if (!r) {
      failed = true;
      failures << "\n  " << r.message();
    }
  }
  if (failed) return ::testing::AssertionFailure() << context << ":" << failures.str();
  return result;
}

template ::testing::AssertionResult Matches<float>(const std::string&, const std::vector<float>&,
                                                   const std::vector<double>&, const Tolerance&,
                                                   MatchStats*);
template ::testing::AssertionResult Matches<double>(const std::string&, const std::vector<double>&,
                                                    const std::vector<double>&, const Tolerance&,
                                                    MatchStats*);
template ::testing::AssertionResult AllMatch<float>(const std::string&, const Gradients<float>&,
                                                    const Gradients<double>&, const Tolerance&);
template ::testing::AssertionResult AllMatch<double>(const std::string&, const Gradients<double>&,
                                                     const Gradients<double>&, const Tolerance&);

std::string Describe(const attngrad::LayerConfig& config, int batch, int seq_len,
                     const attngrad::Scalars& scalars) {
  std::ostringstream os;
  os << "hidden " << config.hidden_size << ", heads " << config.num_heads << "/"
     << config.num_kv_heads << ", head_dim " << config.head_dim << ", B " << batch << ", S "
     << seq_len << ", scaling " << scalars.scaling << ", softcap " << scalars.softcap << ", eps "
     << scalars.eps;
  return os.str();
}

}  // namespace attngrad_test
