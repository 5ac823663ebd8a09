// BackwardStream: one bidirectional attngrad.v1 Backward stream with many batches in flight. Submit
// splits a batch along B when it exceeds the server's limits, writes the parts, and a reader thread
// matches the responses to their parts by batch_id, reassembles grad_hidden_states and sums the
// weight gradients of RETURN-mode parts. Requests and answers travel as grpc::ByteBuffers: a
// request's activations are encoded once, into a pooled buffer that goes out as its own slices
// (the rest of the message serialized by protobuf around them: wire::SerializeWithPayloads), and
// an answer's tensors are decoded straight from the received slices (wire::WalkMessage), so that
// no protobuf message ever holds the big bytes fields.
#include <algorithm>
#include <deque>
#include <functional>
#include <memory>
#include <set>
#include <thread>
#include <unordered_map>

#include <grpcpp/client_context.h>
#include <grpcpp/impl/rpc_method.h>
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/sync_stream.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "attngrad/client.h"
#include "attngrad/common/host_memory.h"
#include "attngrad/common/parallel_tasks.h"
#include "attngrad/common/status_macros.h"
#include "attngrad/wire/backward_messages.h"
#include "attngrad/wire/dtype.h"
#include "attngrad/wire/layer.h"
#include "attngrad/wire/tensor.h"
#include "client_impl.h"

namespace attngrad {
namespace {

uint64_t Mix64(uint64_t x) {  // splitmix64 finaliser
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// The wire id of part `index` of `parts` of batch `batch_id`: the batch id itself when it is not
// split, else a deterministic id with the top bit set (so a retried split batch reuses its part
// ids, and the server's dedup in ACCUMULATE mode still holds part by part).
uint64_t PartId(uint64_t batch_id, int64_t index, int64_t parts) {
  if (parts == 1) return batch_id;
  return Mix64(batch_id ^
               Mix64((static_cast<uint64_t>(parts) << 32) | static_cast<uint64_t>(index))) |
         (uint64_t{1} << 63);
}

void AddTimings(const v1::StageTimings& part, v1::StageTimings* sum) {
  sum->set_queue_seconds(sum->queue_seconds() + part.queue_seconds());
  sum->set_copy_in_seconds(sum->copy_in_seconds() + part.copy_in_seconds());
  sum->set_compute_seconds(sum->compute_seconds() + part.compute_seconds());
  sum->set_copy_out_seconds(sum->copy_out_seconds() + part.copy_out_seconds());
  sum->set_total_seconds(sum->total_seconds() + part.total_seconds());
}

// The method the generated stub calls; this stream calls it with grpc::ByteBuffer messages.
constexpr char kBackwardMethod[] = "/attngrad.v1.AttentionGradient/Backward";

using ReceivedAnswer = wire::ReceivedBackwardResponse;

// The element count of a tensor of the server's answer (its dtype, shape and raw_data `payload`
// checked against `expected`); a bad one is INTERNAL (the server's fault), naming `what`.
absl::StatusOr<int64_t> AnswerElements(const v1::Tensor& tensor,
                                       const std::vector<absl::string_view>& payload,
                                       const std::vector<int64_t>& expected,
                                       absl::string_view what) {
  std::size_t bytes = 0;
  for (absl::string_view piece : payload) bytes += piece.size();
  absl::StatusOr<std::vector<int64_t>> shape = wire::CheckTensor(
      tensor.dtype(), std::vector<int64_t>(tensor.shape().begin(), tensor.shape().end()), bytes,
      what, expected);
  if (!shape.ok()) {
    return absl::InternalError(
        absl::StrCat("server sent a bad ", what, ": ", shape.status().message()));
  }
  return wire::NumElements(*shape);
}

// Decodes (part of) a checked answer tensor into `out`: `payload` holds exactly its elements.
absl::Status DecodeAnswer(const v1::Tensor& tensor, absl::Span<const absl::string_view> payload,
                          absl::string_view what, absl::Span<float> out) {
  absl::Status status = wire::DecodePiecesToFloat(payload, tensor.dtype(), what, out);
  if (status.ok()) return status;
  return absl::InternalError(absl::StrCat("server sent a bad ", what, ": ", status.message()));
}

// One checked tensor of an answer: its payload decoded into `out` (as many elements as it holds),
// or, with `add`, added to what `out` holds (a later part of a split RETURN batch); or, a 16-bit
// answer, its bits copied into `out_16bit` as they are.
struct AnswerDecode {
  const v1::Tensor* tensor = nullptr;
  const std::vector<absl::string_view>* payload = nullptr;
  std::string what;
  absl::Span<float> out;
  bool add = false;
  absl::Span<uint16_t> out_16bit;

  std::size_t elements() const { return out_16bit.empty() ? out.size() : out_16bit.size(); }
};

// From this many bytes on, an answer tensor copied as it is (an fp32 answer into floats, a 16-bit
// one into 16-bit memory) goes with non-temporal stores: beyond what the caches keep of it, the
// copy then neither reads its destination first nor evicts other data (development machine, fp32
// from 64 KiB pieces into a reused buffer: 48 MB 0.20-0.23 -> 0.15 CPU s/GB, 12 MB 0.21 -> 0.17,
// 8 MB equal, 4 MB 0.14 -> 0.15: a loss).
constexpr std::size_t kStreamedAnswerBytes = std::size_t{8} << 20;

// Decodes `decodes` in parts of common::ParallelTasks::kCopyPartBytes (of fp32 output) on `threads`
// and the calling thread; the first failure in part order, or OK.
absl::Status DecodeAnswers(const std::vector<AnswerDecode>& decodes,
                           common::ParallelTasks& threads) {
  struct Part {
    std::size_t decode, first, count;  // elements [first, first + count) of decodes[decode]
  };
  constexpr std::size_t kPartElements = common::ParallelTasks::kCopyPartBytes / sizeof(float);
  std::vector<Part> parts;
  for (std::size_t d = 0; d < decodes.size(); ++d) {
    const std::size_t elements = decodes[d].elements();
    for (std::size_t first = 0; first < elements; first += kPartElements) {
      parts.push_back(Part{d, first, std::min(kPartElements, elements - first)});
    }
  }
  std::vector<absl::Status> statuses(parts.size());
  threads.Run(parts.size(), [&](std::size_t index) {
    const Part& part = parts[index];
    const AnswerDecode& decode = decodes[part.decode];
    const std::size_t element_size = wire::DTypeSize(decode.tensor->dtype());
    const std::vector<absl::string_view> range =
        wire::PiecesRange(*decode.payload, part.first * element_size, part.count * element_size);
    const bool streaming = decode.elements() * element_size >= kStreamedAnswerBytes;
    if (!decode.out_16bit.empty()) {  // a 16-bit answer into 16-bit memory (its dtype checked)
      wire::CopyPieces(range, reinterpret_cast<char*>(&decode.out_16bit[part.first]), streaming);
      return;
    }
    const absl::Span<float> out = decode.out.subspan(part.first, part.count);
    if (!decode.add && decode.tensor->dtype() == v1::DTYPE_FLOAT32) {  // its size checked
      wire::CopyPieces(range, reinterpret_cast<char*>(out.data()), streaming);
      return;
    }
    if (!decode.add) {
      statuses[index] = DecodeAnswer(*decode.tensor, range, decode.what, out);
      return;
    }
    std::vector<float> piece;
    common::ResizeForOverwrite(&piece, part.count);
    statuses[index] = DecodeAnswer(*decode.tensor, range, decode.what, absl::MakeSpan(piece));
    if (!statuses[index].ok()) return;
    for (std::size_t i = 0; i < part.count; ++i) out[i] += piece[i];
  });
  for (absl::Status& status : statuses) {
    if (!status.ok()) return status;
  }
  return absl::OkStatus();
}

// The bytes of `values`' elements.
template <typename T>
absl::string_view BytesOf(absl::Span<const T> values) {
  return absl::string_view(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(T));
}

// The caller's memory that a batch's requests were sent from (BackwardBatch::borrow_inputs):
// released once gRPC has let go of every slice of it.
class InputLoan {
 public:
  // What the slices keep: releases the loan when the last of them goes.
  static std::shared_ptr<const void> Token(const std::shared_ptr<InputLoan>& loan) {
    return std::shared_ptr<const void>(loan.get(), [loan](const void*) { loan->Release(); });
  }
  void WaitReleased() {
    absl::MutexLock lock(&mu_);
    while (!released_) released_changed_.Wait(&mu_);
  }

 private:
  void Release() {
    absl::MutexLock lock(&mu_);
    released_ = true;
    released_changed_.SignalAll();
  }

  absl::Mutex mu_;
  absl::CondVar released_changed_;
  bool released_ ABSL_GUARDED_BY(mu_) = false;
};

// What Submit derives from a batch before it sends it: its sizes, how its inputs and rotary
// positions are given, and how it is cut into parts.
struct PreparedBatch {
  int64_t B = 0, S = 0, H = 0, D = 0;
  bool tables = false;             // cos/sin tables, else position ids
  std::vector<int64_t> positions;  // the position ids (0..S-1 when neither ids nor tables are set)
  bool per_sequence_positions = false;  // B*S position ids, a row per sequence
  v1::DType input_dtype = v1::DTYPE_FLOAT32;
  bool inputs_16bit = false;     // the *_16bit spans hold the inputs
  int64_t response_element = 4;  // bytes of one element of the answer's tensors
  bool weights_out = false;      // the caller's weight_gradients_out are set
  SplitPlan plan;

  int64_t parts() const { return static_cast<int64_t>(plan.size()); }
};

// The inputs' dtype against the spans that hold them: a known dtype, 16-bit spans only for a
// 16-bit dtype, and one pair of spans.
absl::Status CheckInputForm(const BackwardBatch& batch, const PreparedBatch& prepared) {
  const int64_t input_element = wire::DTypeSize(prepared.input_dtype);
  if (input_element == 0 || !wire::IsSupportedDType(prepared.input_dtype)) {
    return absl::InvalidArgumentError(absl::StrCat("input_dtype: unknown dtype ",
                                                   static_cast<int>(batch.input_dtype),
                                                   " (float32, float16 or bfloat16)"));
  }
  if (prepared.inputs_16bit && input_element != 2) {
    return absl::InvalidArgumentError(absl::StrCat(
        "hidden_states_16bit / grad_output_16bit: input_dtype must be float16 or bfloat16 (the "
        "spans' 16-bit elements), got ",
        wire::DTypeName(prepared.input_dtype)));
  }
  if (prepared.inputs_16bit && (!batch.hidden_states.empty() || !batch.grad_output.empty())) {
    return absl::InvalidArgumentError(
        "hidden_states / grad_output and hidden_states_16bit / grad_output_16bit: set one pair, "
        "not both");
  }
  return absl::OkStatus();
}

// The request and response sizes of one part of the batch, for PlanSplit.
MessageSizes MessageSizesOf(const BackwardBatch& batch, const PreparedBatch& prepared,
                            const LayerConfig& config) {
  const int64_t S = prepared.S, H = prepared.H, D = prepared.D;
  const int64_t input_element = wire::DTypeSize(prepared.input_dtype);
  MessageSizes sizes;
  sizes.request_fixed = 4096 + (prepared.tables || prepared.per_sequence_positions ? 0 : 10 * S);
  sizes.request_per_sequence =
      S * H * input_element * 2 +
      (prepared.tables ? S * D * 4 * 2 : (prepared.per_sequence_positions ? 10 * S : 0)) + 64;
  sizes.response_fixed = 4096;
  if (batch.mode != v1::GRADIENT_MODE_ACCUMULATE) {
    sizes.response_fixed +=
        (2 * int64_t{config.q_out()} * H + 2 * int64_t{config.kv_out()} * H + 2 * D) *
        prepared.response_element;
  }
  sizes.response_per_sequence = S * H * prepared.response_element;
  return sizes;
}

// Splitting slices the inputs, so they must be complete (a single request is checked by the
// server, whose message names the field).
absl::Status CheckSplitInputs(const BackwardBatch& batch, const PreparedBatch& prepared) {
  const int64_t B = prepared.B, S = prepared.S, H = prepared.H, D = prepared.D;
  auto check = [&](std::size_t size, int64_t expected, absl::string_view name) {
    if (static_cast<int64_t>(size) == expected) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat(name, ": expected ", expected,
                                                   " elements for shape [", B, ",", S, ",",
                                                   expected / (B * S), "], got ", size));
  };
  const bool inputs_16bit = prepared.inputs_16bit;
  const std::size_t hidden_count =
      inputs_16bit ? batch.hidden_states_16bit.size() : batch.hidden_states.size();
  const std::size_t grad_count =
      inputs_16bit ? batch.grad_output_16bit.size() : batch.grad_output.size();
  const absl::string_view suffix = inputs_16bit ? "_16bit" : "";
  const bool tables = prepared.tables;
  for (absl::Status s : {check(hidden_count, B * S * H, absl::StrCat("hidden_states", suffix)),
                         check(grad_count, B * S * H, absl::StrCat("grad_output", suffix)),
                         tables ? check(batch.cos.size(), B * S * D, "cos") : absl::OkStatus(),
                         tables ? check(batch.sin.size(), B * S * D, "sin") : absl::OkStatus()}) {
    if (!s.ok()) return s;
  }
  const int64_t positions = static_cast<int64_t>(prepared.positions.size());
  if (!tables && positions != S && positions != B * S) {
    return absl::InvalidArgumentError(
        absl::StrCat("position_ids: expected ", S, " or ", B * S, " values, got ", positions));
  }
  return absl::OkStatus();
}

// The caller's grad_hidden_states outputs: fp32 or 16-bit (in a 16-bit response_dtype), one or
// neither, of the batch's full size.
absl::Status CheckGradHiddenOutputs(const BackwardBatch& batch, const PreparedBatch& prepared) {
  const int64_t B = prepared.B, S = prepared.S, H = prepared.H;
  if (!batch.grad_hidden_states_out.empty() &&
      static_cast<int64_t>(batch.grad_hidden_states_out.size()) != B * S * H) {
    return absl::InvalidArgumentError(absl::StrCat("grad_hidden_states_out: expected ", B * S * H,
                                                   " floats for shape [", B, ",", S, ",", H,
                                                   "], got ", batch.grad_hidden_states_out.size()));
  }
  if (batch.grad_hidden_states_16bit_out.empty()) return absl::OkStatus();
  if (!batch.grad_hidden_states_out.empty()) {
    return absl::InvalidArgumentError(
        "grad_hidden_states_out and grad_hidden_states_16bit_out: set one or neither");
  }
  if (prepared.response_element != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("grad_hidden_states_16bit_out: response_dtype must be float16 or bfloat16 "
                     "(the span's 16-bit elements), got ",
                     wire::DTypeName(batch.response_dtype)));
  }
  if (static_cast<int64_t>(batch.grad_hidden_states_16bit_out.size()) != B * S * H) {
    return absl::InvalidArgumentError(
        absl::StrCat("grad_hidden_states_16bit_out: expected ", B * S * H, " elements for shape [",
                     B, ",", S, ",", H, "], got ", batch.grad_hidden_states_16bit_out.size()));
  }
  return absl::OkStatus();
}

// The caller's weight_gradients_out, when set: all six, of their weights' shapes, in RETURN mode.
absl::Status CheckWeightGradientOutputs(const BackwardBatch& batch, const PreparedBatch& prepared,
                                        const LayerConfig& config) {
  if (!prepared.weights_out) return absl::OkStatus();
  if (batch.mode != v1::GRADIENT_MODE_RETURN) {
    return absl::InvalidArgumentError(
        "weight_gradients_out: only with mode GRADIENT_MODE_RETURN (ACCUMULATE adds the weight "
        "gradients on the server)");
  }
  for (Weight weight : kAllWeights) {
    const std::vector<int64_t> shape = WeightShape(config, weight);
    const std::size_t expected = WeightElements(config, weight);
    if (batch.weight_gradients_out[weight].size() != expected) {
      return absl::InvalidArgumentError(
          absl::StrCat("weight_gradients_out.", WeightModuleName(weight), ": expected ", expected,
                       " floats for shape [", absl::StrJoin(shape, ","), "], got ",
                       batch.weight_gradients_out[weight].size(), " (set all six or none)"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

class BackwardStream::Impl {
 public:
  Impl(std::shared_ptr<Client::Impl> client, absl::Duration deadline,
       std::function<void()> on_result)
      : client_(std::move(client)),
        layer_config_(wire::LayerConfigFromWire(client_->cached_info().config())),
        on_result_(std::move(on_result)),
        end_marker_(client_->cached_info().backward_end_marker()) {
    PrepareContext(&context_, client_->options(), deadline);
    if (end_marker_) context_.AddMetadata(wire::kEndMarkerMetadata, wire::kEndMarkerDeclared);
  }

  ~Impl() {
    if (reader_.joinable()) {
      context_.TryCancel();
      reader_.join();
    }
  }

  static absl::StatusOr<std::unique_ptr<BackwardStream>> Open(std::shared_ptr<Client::Impl> client,
                                                              absl::Duration deadline,
                                                              std::function<void()> on_result) {
    auto impl = std::make_unique<Impl>(std::move(client), deadline, std::move(on_result));
    // The generated stub's own call (ClientReaderWriterFactory is how it opens a bidirectional
    // stream), with grpc::ByteBuffer as the message type on both sides.
    const std::shared_ptr<grpc::Channel>& channel = impl->client_->NextStreamChannel();
    impl->stream_.reset(
        grpc::internal::ClientReaderWriterFactory<grpc::ByteBuffer, grpc::ByteBuffer>::Create(
            channel.get(),
            grpc::internal::RpcMethod(kBackwardMethod, grpc::internal::RpcMethod::BIDI_STREAMING),
            &impl->context_));
    if (impl->stream_ == nullptr) return absl::InternalError("Backward: could not open the stream");
    impl->reader_ = std::thread([raw = impl.get()]() { raw->ReadLoop(); });
    return std::unique_ptr<BackwardStream>(new BackwardStream(std::move(impl)));
  }

  absl::StatusOr<uint64_t> Submit(const BackwardBatch& batch);
  absl::StatusOr<BackwardResult> Next(absl::Duration timeout);
  absl::StatusOr<BackwardResult> Await(uint64_t batch_id, absl::Duration timeout);
  int64_t outstanding() const {
    absl::MutexLock lock(&mu_);
    return static_cast<int64_t>(pending_.size() + completed_.size());
  }
  absl::Status Finish();
  void Cancel() { context_.TryCancel(); }

 private:
  struct Part {
    uint64_t batch_id;
    int64_t index;
    int64_t first_sequence;
    int64_t sequences;
  };
  struct Pending {
    BackwardResult result;
    int64_t parts_left = 0;
    int64_t batch = 0;
    int64_t seq_len = 0;
    v1::GradientMode mode = v1::GRADIENT_MODE_RETURN;
    absl::Time start;
    std::set<std::string> devices;
    absl::Span<float> grad_hidden_out;  // BackwardBatch::grad_hidden_states_out (may be empty)
    // BackwardBatch::grad_hidden_states_16bit_out (may be empty), in response_dtype.
    absl::Span<uint16_t> grad_hidden_out_16bit;
    v1::DType response_dtype = v1::DTYPE_UNSPECIFIED;
    PerWeight<absl::Span<float>> weights_out;  // BackwardBatch::weight_gradients_out (or empty)
  };

  // The result taken out of completed_ (under mu_), and then (without it) waits until gRPC has
  // let go of the batch's borrowed inputs, unless the stream has ended (no byte is read then).
  BackwardResult TakeCompleted(std::deque<BackwardResult>::iterator it,
                               absl::ReleasableMutexLock* lock) ABSL_UNLOCK_FUNCTION(mu_);
  // Submit's steps: the batch checked and planned; its pending entry; the entry and its parts
  // registered once the stream has room; each part's request encoded and written.
  absl::StatusOr<PreparedBatch> PrepareBatch(const BackwardBatch& batch) const;
  static std::unique_ptr<Pending> NewPending(const BackwardBatch& batch,
                                             const PreparedBatch& prepared, uint64_t batch_id);
  absl::Status AddPending(uint64_t batch_id, const SplitPlan& plan,
                          std::unique_ptr<Pending> pending, std::shared_ptr<InputLoan> loan);
  absl::StatusOr<grpc::ByteBuffer> EncodePart(const BackwardBatch& batch,
                                              const PreparedBatch& prepared, uint64_t batch_id,
                                              int64_t index,
                                              const std::shared_ptr<const void>& loan_token);
  absl::Status WriteParts(const BackwardBatch& batch, const PreparedBatch& prepared,
                          uint64_t batch_id, const std::shared_ptr<const void>& loan_token);
  void ReadLoop();
  void HandleResponse(const ReceivedAnswer& answer);
  absl::Status MergePart(const ReceivedAnswer& answer, const Part& part, Pending* pending);
  // A RETURN-mode answer's six weight gradients: checked, and added to `decodes` (decoded into
  // the caller's weight_gradients_out or the result, or added to them for a later part).
  absl::Status AddWeightGradientDecodes(const ReceivedAnswer& answer, const Part& part,
                                        Pending* pending, std::vector<AnswerDecode>* decodes);
  absl::Status BrokenStatusLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Writes one request and counts it for the end marker; false when the stream is broken.
  bool WriteRequest(const grpc::ByteBuffer& bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(write_mu_) {
    if (!stream_->Write(bytes)) return false;
    ++requests_written_;
    return true;
  }

  std::shared_ptr<Client::Impl> client_;
  const LayerConfig layer_config_;         // from the model info when the stream opened
  const std::function<void()> on_result_;  // may be empty
  // The stream ends with an end marker (BackwardRequest.end), declared when it opened: the server
  // then tells a stream that lost its last request (it ended inside that message) from a clean end.
  const bool end_marker_;
  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>> stream_;
  std::thread reader_;

  absl::Mutex write_mu_;
  bool writes_done_ ABSL_GUARDED_BY(write_mu_) = false;
  uint64_t requests_written_ ABSL_GUARDED_BY(write_mu_) = 0;  // what the end marker counts

  mutable absl::Mutex mu_;
  absl::CondVar changed_;
  std::unordered_map<uint64_t, Part> parts_ ABSL_GUARDED_BY(mu_);  // wire id -> part
  // batch id -> pending batch; the Pending objects are stable (unique_ptr) and only the reader
  // thread touches their results after Submit has registered them.
  std::unordered_map<uint64_t, std::unique_ptr<Pending>> pending_ ABSL_GUARDED_BY(mu_);
  std::deque<BackwardResult> completed_ ABSL_GUARDED_BY(mu_);
  // batch id -> the loan of its borrowed inputs (BackwardBatch::borrow_inputs), until its result
  // is taken.
  std::unordered_map<uint64_t, std::shared_ptr<InputLoan>> loans_ ABSL_GUARDED_BY(mu_);
  bool stream_done_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status stream_status_ ABSL_GUARDED_BY(mu_);
  // An answer that was not a BackwardResponse: the stream was cancelled, and this is why.
  absl::Status bad_answer_ ABSL_GUARDED_BY(mu_);
};

absl::Status BackwardStream::Impl::BrokenStatusLocked() const {
  if (!stream_status_.ok()) return stream_status_;
  return absl::FailedPreconditionError("Backward stream: already finished");
}

absl::StatusOr<PreparedBatch> BackwardStream::Impl::PrepareBatch(const BackwardBatch& batch) const {
  const v1::GetModelInfoResponse info = client_->cached_info();
  PreparedBatch prepared;
  prepared.B = batch.batch;
  prepared.S = batch.seq_len;
  prepared.H = layer_config_.hidden_size;
  prepared.D = layer_config_.head_dim;
  const int64_t B = prepared.B, S = prepared.S;
  if (B < 1 || S < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("batch and seq_len must be >= 1, got batch=", B, " seq_len=", S));
  }
  if (batch.batch_id >> 63) {
    return absl::InvalidArgumentError(
        absl::StrCat("batch_id ", batch.batch_id,
                     " >= 2^63: ids with the top bit set are reserved "
                     "for the parts of split batches"));
  }
  prepared.tables = !batch.cos.empty() || !batch.sin.empty();
  prepared.positions = batch.position_ids;
  if (!prepared.tables && prepared.positions.empty()) {
    for (int64_t s = 0; s < S; ++s) prepared.positions.push_back(s);
  }
  prepared.per_sequence_positions =
      !prepared.tables && static_cast<int64_t>(prepared.positions.size()) == B * S && B > 1;
  prepared.response_element = wire::DTypeSize(
      batch.response_dtype == v1::DTYPE_UNSPECIFIED ? v1::DTYPE_FLOAT32 : batch.response_dtype);
  prepared.input_dtype =
      batch.input_dtype == v1::DTYPE_UNSPECIFIED ? v1::DTYPE_FLOAT32 : batch.input_dtype;
  prepared.inputs_16bit = !batch.hidden_states_16bit.empty() || !batch.grad_output_16bit.empty();
  ATTNGRAD_RETURN_IF_ERROR(CheckInputForm(batch, prepared));

  // Split plan from the server's limits and the client's own message limit. The server's
  // max_message_bytes bounds what it receives and what it sends.
  int64_t max_message = client_->options().max_message_bytes;
  if (info.max_message_bytes() > 0) max_message = std::min(max_message, info.max_message_bytes());
  ATTNGRAD_ASSIGN_OR_RETURN(
      prepared.plan, PlanSplit(B, S, MessageSizesOf(batch, prepared, layer_config_), max_message,
                               max_message, info.max_batch_tokens()));
  if (prepared.parts() > 1) ATTNGRAD_RETURN_IF_ERROR(CheckSplitInputs(batch, prepared));
  ATTNGRAD_RETURN_IF_ERROR(CheckGradHiddenOutputs(batch, prepared));
  for (absl::Span<float> out : batch.weight_gradients_out) {
    prepared.weights_out = prepared.weights_out || !out.empty();
  }
  ATTNGRAD_RETURN_IF_ERROR(CheckWeightGradientOutputs(batch, prepared, layer_config_));
  return prepared;
}

std::unique_ptr<BackwardStream::Impl::Pending> BackwardStream::Impl::NewPending(
    const BackwardBatch& batch, const PreparedBatch& prepared, uint64_t batch_id) {
  auto pending = std::make_unique<Pending>();
  pending->result.batch_id = batch_id;
  pending->result.parts = static_cast<int>(prepared.parts());
  pending->result.shape = {prepared.B, prepared.S, prepared.H};
  pending->parts_left = prepared.parts();
  pending->batch = prepared.B;
  pending->seq_len = prepared.S;
  pending->mode = batch.mode;
  pending->grad_hidden_out = batch.grad_hidden_states_out;
  pending->grad_hidden_out_16bit = batch.grad_hidden_states_16bit_out;
  pending->response_dtype = batch.response_dtype;
  if (prepared.weights_out) pending->weights_out = batch.weight_gradients_out;
  return pending;
}

// Waits until the stream has room for one more batch (options.max_in_flight), then registers the
// batch, its parts' wire ids and the loan of its borrowed inputs (kept until its result is taken).
absl::Status BackwardStream::Impl::AddPending(uint64_t batch_id, const SplitPlan& plan,
                                              std::unique_ptr<Pending> pending,
                                              std::shared_ptr<InputLoan> loan) {
  const int64_t parts = static_cast<int64_t>(plan.size());
  absl::MutexLock lock(&mu_);
  auto room = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return stream_done_ ||
           static_cast<int64_t>(pending_.size()) < std::max(1, client_->options().max_in_flight);
  };
  while (!room()) changed_.Wait(&mu_);
  if (stream_done_) return BrokenStatusLocked();
  if (pending_.count(batch_id)) {
    return absl::AlreadyExistsError(
        absl::StrCat("batch_id ", batch_id, " is already in flight on this stream"));
  }
  for (int64_t p = 0; p < parts; ++p) {
    const uint64_t wire_id = PartId(batch_id, p, parts);
    if (parts_.count(wire_id)) {
      return absl::AlreadyExistsError(
          absl::StrCat("batch_id ", batch_id, " collides with a part id in flight"));
    }
  }
  for (int64_t p = 0; p < parts; ++p) {
    parts_[PartId(batch_id, p, parts)] = Part{batch_id, p, plan[p].first, plan[p].second};
  }
  pending->start = absl::Now();  // latency starts once the batch has room to be in flight
  pending_[batch_id] = std::move(pending);
  if (loan != nullptr) loans_[batch_id] = std::move(loan);
  return absl::OkStatus();
}

// The request of part `index` of the batch. The activations' dtype and shape are in the message,
// their bytes encoded once into a pooled buffer that gRPC sends as it is (or, borrowed, sent from
// the caller's memory).
absl::StatusOr<grpc::ByteBuffer> BackwardStream::Impl::EncodePart(
    const BackwardBatch& batch, const PreparedBatch& prepared, uint64_t batch_id, int64_t index,
    const std::shared_ptr<const void>& loan_token) {
  const int64_t parts = prepared.parts(), S = prepared.S, H = prepared.H, D = prepared.D;
  const int64_t first = prepared.plan[index].first, count = prepared.plan[index].second;
  v1::BackwardRequest request;
  request.set_batch_id(PartId(batch_id, index, parts));
  request.set_mode(batch.mode);
  request.set_precision(batch.precision);
  request.set_expected_weights_version(batch.expected_weights_version);
  request.set_accumulation_window_id(batch.accumulation_window_id);
  request.set_response_dtype(batch.response_dtype);
  auto slice = [&](auto span, int64_t width) {
    return parts == 1 ? span : span.subspan(first * S * width, count * S * width);
  };
  v1::Tensor* described[2] = {request.mutable_hidden_states(), request.mutable_grad_output()};
  for (v1::Tensor* tensor : described) {
    tensor->set_dtype(prepared.input_dtype);
    for (int64_t dimension : {count, S, H}) tensor->add_shape(dimension);
  }
  if (prepared.tables) {
    wire::EncodeTensor(slice(batch.cos, D), {count, S, D}, v1::DTYPE_FLOAT32,
                       request.mutable_rotary_tables()->mutable_cos());
    wire::EncodeTensor(slice(batch.sin, D), {count, S, D}, v1::DTYPE_FLOAT32,
                       request.mutable_rotary_tables()->mutable_sin());
  } else {
    v1::RotaryPositions* rotary = request.mutable_positions();
    rotary->set_rope_theta(batch.rope_theta);
    const std::vector<int64_t>& positions = prepared.positions;
    if (prepared.per_sequence_positions) {
      rotary->mutable_position_ids()->Add(positions.begin() + first * S,
                                          positions.begin() + (first + count) * S);
    } else {
      rotary->mutable_position_ids()->Add(positions.begin(), positions.end());
    }
  }
  if (batch.scaling) request.set_scaling(*batch.scaling);
  if (batch.softcap) request.set_softcap(*batch.softcap);
  if (batch.eps) request.set_eps(*batch.eps);
  if (batch.layer) request.set_layer(*batch.layer);
  if (batch.sliding_window) request.set_sliding_window(*batch.sliding_window);
  if (prepared.inputs_16bit) {
    return wire::EncodeBackwardRequestBytes(request, BytesOf(slice(batch.hidden_states_16bit, H)),
                                            BytesOf(slice(batch.grad_output_16bit, H)),
                                            client_->request_pool(), loan_token);
  }
  return wire::EncodeBackwardRequest(request, slice(batch.hidden_states, H),
                                     slice(batch.grad_output, H), prepared.input_dtype,
                                     client_->request_pool(), loan_token);
}

// Writes the batch's parts, one request built at a time. A broken stream is answered with why it
// broke, which the reader thread learns from Finish.
absl::Status BackwardStream::Impl::WriteParts(const BackwardBatch& batch,
                                              const PreparedBatch& prepared, uint64_t batch_id,
                                              const std::shared_ptr<const void>& loan_token) {
  absl::MutexLock write_lock(&write_mu_);
  if (writes_done_) {
    return absl::FailedPreconditionError("Backward stream: Submit after Finish");
  }
  for (int64_t p = 0; p < prepared.parts(); ++p) {
    ATTNGRAD_ASSIGN_OR_RETURN(grpc::ByteBuffer bytes,
                              EncodePart(batch, prepared, batch_id, p, loan_token));
    {
      absl::MutexLock lock(&mu_);
      auto it = pending_.find(batch_id);
      if (it != pending_.end()) {
        it->second->result.request_bytes += static_cast<int64_t>(bytes.Length());
      }
    }
    if (!WriteRequest(bytes)) {
      absl::MutexLock lock(&mu_);
      while (!stream_done_) changed_.Wait(&mu_);
      return BrokenStatusLocked();
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> BackwardStream::Impl::Submit(const BackwardBatch& batch) {
  if (absl::Status restart = client_->RestartStatus(); !restart.ok()) return restart;
  ATTNGRAD_ASSIGN_OR_RETURN(const PreparedBatch prepared, PrepareBatch(batch));
  const uint64_t batch_id = batch.batch_id != 0 ? batch.batch_id : client_->NewBatchId();
  std::unique_ptr<Pending> pending = NewPending(batch, prepared, batch_id);
  std::shared_ptr<InputLoan> loan;
  std::shared_ptr<const void> loan_token;
  if (batch.borrow_inputs && (prepared.inputs_16bit || prepared.input_dtype == v1::DTYPE_FLOAT32)) {
    loan = std::make_shared<InputLoan>();
    loan_token = InputLoan::Token(loan);
  }
  ATTNGRAD_RETURN_IF_ERROR(AddPending(batch_id, prepared.plan, std::move(pending), loan));
  ATTNGRAD_RETURN_IF_ERROR(WriteParts(batch, prepared, batch_id, loan_token));
  return batch_id;
}

void BackwardStream::Impl::ReadLoop() {
  grpc::ByteBuffer bytes;
  while (stream_->Read(&bytes)) {
    absl::StatusOr<ReceivedAnswer> answer = wire::ReadBackwardResponse(bytes);
    bytes.Clear();
    if (!answer.ok()) {
      // Not a BackwardResponse: nothing more on this stream can be trusted.
      {
        absl::MutexLock lock(&mu_);
        bad_answer_ = absl::InternalError(absl::StrCat(
            "Backward stream: the server sent a bad answer: ", answer.status().message()));
      }
      context_.TryCancel();
      break;
    }
    HandleResponse(*answer);
  }
  const grpc::Status finished = stream_->Finish();
  absl::ReleasableMutexLock lock(&mu_);
  stream_done_ = true;
  stream_status_ = bad_answer_.ok() ? FromGrpc(finished, "Backward stream") : bad_answer_;
  if (stream_status_.ok() && !pending_.empty()) {
    stream_status_ =
        absl::InternalError(absl::StrCat("Backward stream: the server closed the stream with ",
                                         pending_.size(), " batches unanswered"));
  }
  for (auto& [id, pending] : pending_) {
    pending->result.status = stream_status_;
    pending->result.latency = absl::Now() - pending->start;
    completed_.push_back(std::move(pending->result));
  }
  pending_.clear();
  parts_.clear();
  changed_.SignalAll();
  lock.Release();
  if (on_result_) on_result_();
}

void BackwardStream::Impl::HandleResponse(const ReceivedAnswer& answer) {
  const v1::BackwardResponse& response = answer.response;
  Part part;
  Pending* pending = nullptr;
  {
    absl::MutexLock lock(&mu_);
    auto it = parts_.find(response.batch_id());
    if (it == parts_.end()) return;  // not ours (e.g. answered after a local failure): ignore
    part = it->second;
    parts_.erase(it);
    pending = pending_.at(part.batch_id).get();
  }
  absl::Status status = MergePart(answer, part, pending);
  if (!status.ok() && pending->result.status.ok()) {
    if (pending->result.parts > 1) {
      status = absl::Status(
          status.code(),
          absl::StrCat("part ", part.index + 1, "/", pending->result.parts, " (sequences ",
                       part.first_sequence, "..", part.first_sequence + part.sequences - 1,
                       "): ", status.message()));
    }
    pending->result.status = status;
  }
  absl::ReleasableMutexLock lock(&mu_);
  pending->result.response_bytes += answer.bytes;
  if (--pending->parts_left > 0) return;
  BackwardResult& result = pending->result;
  result.latency = absl::Now() - pending->start;
  result.device = absl::StrJoin(pending->devices, ",");
  if (!result.status.ok()) {
    result.grad_hidden_states.clear();
    result.weight_gradients.reset();
  }
  completed_.push_back(std::move(result));
  pending_.erase(part.batch_id);
  changed_.SignalAll();
  lock.Release();
  if (on_result_) on_result_();
}

absl::Status BackwardStream::Impl::MergePart(const ReceivedAnswer& answer, const Part& part,
                                             Pending* pending) {
  const v1::BackwardResponse& response = answer.response;
  BackwardResult& result = pending->result;
  if (response.has_error() && response.error().code() != 0) {
    return absl::Status(static_cast<absl::StatusCode>(response.error().code()),
                        absl::StrCat("batch ", part.batch_id, ": ", response.error().message()));
  }
  if (absl::Status restart = client_->CheckInstance(response.server_instance_id()); !restart.ok()) {
    return restart;
  }
  if (!result.status.ok()) return absl::OkStatus();  // an earlier part failed: skip the data
  if (!response.device().empty()) pending->devices.insert(response.device());
  if (result.weights_version != 0 && response.weights_version() != result.weights_version) {
    return absl::AbortedError(absl::StrCat(
        "batch ", part.batch_id, ": its parts were computed with different weights versions (",
        result.weights_version, " and ", response.weights_version(),
        "); set expected_weights_version to pin one"));
  }
  result.weights_version = response.weights_version();
  result.layer = response.layer();
  result.accumulation_window_id = response.accumulation_window_id();
  result.duplicate = result.duplicate || response.duplicate();
  AddTimings(response.timings(), &result.timings);

  const int64_t S = pending->seq_len, H = layer_config_.hidden_size;
  const std::vector<int64_t> part_shape = {part.sequences, S, H};
  ATTNGRAD_ASSIGN_OR_RETURN(const int64_t elements,
                            AnswerElements(response.grad_hidden_states(), answer.payloads[0],
                                           part_shape, "grad_hidden_states"));
  // Straight into the caller's memory or the batch's result: the whole of it, or the part's
  // sequences. Every tensor checked first, then all decoded at once in parts (~50 MB of
  // grad_hidden_states and ~100 MB of weight gradients for a 4x1024 RETURN batch of a Gemma-3
  // layer).
  const size_t offset = static_cast<size_t>(result.parts == 1 ? 0 : part.first_sequence * S * H);
  std::vector<AnswerDecode> decodes(1);
  decodes.back().tensor = &response.grad_hidden_states();
  decodes.back().payload = &answer.payloads[0];
  decodes.back().what = "grad_hidden_states";
  if (!pending->grad_hidden_out_16bit.empty()) {
    if (response.grad_hidden_states().dtype() != pending->response_dtype) {
      return absl::InternalError(absl::StrCat(
          "server sent grad_hidden_states as ",
          wire::DTypeName(response.grad_hidden_states().dtype()), ", not the response_dtype ",
          wire::DTypeName(pending->response_dtype), " asked for"));
    }
    decodes.back().out_16bit =
        pending->grad_hidden_out_16bit.subspan(offset, static_cast<size_t>(elements));
  } else {
    absl::Span<float> grad_hidden = pending->grad_hidden_out;
    if (grad_hidden.empty()) {
      common::ResizeForOverwrite(
          &result.grad_hidden_states,
          static_cast<size_t>(result.parts == 1 ? elements : pending->batch * S * H));
      grad_hidden = absl::Span<float>(result.grad_hidden_states);
    }
    decodes.back().out = grad_hidden.subspan(offset, static_cast<size_t>(elements));
  }

  if (pending->mode != v1::GRADIENT_MODE_ACCUMULATE) {
    ATTNGRAD_RETURN_IF_ERROR(AddWeightGradientDecodes(answer, part, pending, &decodes));
  }
  return DecodeAnswers(decodes, client_->decode_threads());
}

absl::Status BackwardStream::Impl::AddWeightGradientDecodes(const ReceivedAnswer& answer,
                                                            const Part& part, Pending* pending,
                                                            std::vector<AnswerDecode>* decodes) {
  const v1::BackwardResponse& response = answer.response;
  BackwardResult& result = pending->result;
  if (!response.has_weight_gradients()) {
    return absl::InternalError(
        absl::StrCat("batch ", part.batch_id, ": a RETURN-mode answer without weight_gradients"));
  }
  const bool first = !result.weight_gradients.has_value();
  if (first) result.weight_gradients.emplace();
  for (std::size_t w = 0; w < kAllWeights.size(); ++w) {
    const Weight weight = kAllWeights[w];
    HostTensor& sum = (*result.weight_gradients)[weight];
    const std::vector<int64_t> shape = WeightShape(layer_config_, weight);
    std::string what = absl::StrCat("weight_gradients.", WeightModuleName(weight));
    const v1::Tensor& tensor = wire::GradientTensor(response.weight_gradients(), weight);
    const std::vector<absl::string_view>& payload = answer.payloads[w + 1];
    ATTNGRAD_ASSIGN_OR_RETURN(const int64_t count, AnswerElements(tensor, payload, shape, what));
    absl::Span<float> out = pending->weights_out[weight];
    if (first) {
      sum.shape = shape;
      if (out.empty()) {
        common::ResizeForOverwrite(&sum.data, static_cast<size_t>(count));
        out = absl::Span<float>(sum.data);
      }
    } else if (out.empty()) {
      out = absl::Span<float>(sum.data);
    }
    decodes->push_back(AnswerDecode{&tensor, &payload, std::move(what), out, /*add=*/!first, {}});
  }
  return absl::OkStatus();
}

absl::StatusOr<BackwardResult> BackwardStream::Impl::Next(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  absl::ReleasableMutexLock lock(&mu_);
  while (completed_.empty() && !pending_.empty()) {
    if (changed_.WaitWithDeadline(&mu_, deadline) && completed_.empty()) {
      return absl::DeadlineExceededError(absl::StrCat("Backward stream: no batch completed within ",
                                                      absl::FormatDuration(timeout)));
    }
  }
  if (completed_.empty()) {
    return absl::OutOfRangeError("Backward stream: no batches outstanding");
  }
  return TakeCompleted(completed_.begin(), &lock);
}

BackwardResult BackwardStream::Impl::TakeCompleted(std::deque<BackwardResult>::iterator it,
                                                   absl::ReleasableMutexLock* lock) {
  BackwardResult result = std::move(*it);
  completed_.erase(it);
  changed_.SignalAll();
  std::shared_ptr<InputLoan> loan;
  if (auto found = loans_.find(result.batch_id); found != loans_.end()) {
    if (!stream_done_) loan = std::move(found->second);
    loans_.erase(found);
  }
  lock->Release();
  if (loan != nullptr) loan->WaitReleased();
  return result;
}

absl::StatusOr<BackwardResult> BackwardStream::Impl::Await(uint64_t batch_id,
                                                           absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  absl::ReleasableMutexLock lock(&mu_);
  while (true) {
    for (auto it = completed_.begin(); it != completed_.end(); ++it) {
      if (it->batch_id != batch_id) continue;
      BackwardResult result = TakeCompleted(it, &lock);
      if (!result.status.ok()) return result.status;
      return result;
    }
    if (!pending_.count(batch_id)) {
      return absl::NotFoundError(
          absl::StrCat("Backward stream: batch ", batch_id, " is not outstanding"));
    }
    if (changed_.WaitWithDeadline(&mu_, deadline)) {
      bool done = false;
      for (const BackwardResult& r : completed_) done = done || r.batch_id == batch_id;
      if (!done) {
        return absl::DeadlineExceededError(absl::StrCat("Backward stream: batch ", batch_id,
                                                        " not answered within ",
                                                        absl::FormatDuration(timeout)));
      }
    }
  }
}

absl::Status BackwardStream::Impl::Finish() {
  {
    absl::MutexLock write_lock(&write_mu_);
    if (!writes_done_) {
      writes_done_ = true;
      if (end_marker_) {  // the last request: every one before it arrived whole
        v1::BackwardRequest marker;
        marker.mutable_end()->set_requests(requests_written_);
        grpc::Slice slice(marker.SerializeAsString());
        grpc::ByteBuffer bytes(&slice, 1);
        stream_->Write(bytes);  // a broken stream: the reader learns why from Finish
      }
      stream_->WritesDone();
    }
  }
  if (reader_.joinable()) reader_.join();
  absl::MutexLock lock(&mu_);
  return stream_status_;
}

absl::StatusOr<std::unique_ptr<BackwardStream>> OpenBackwardStream(
    std::shared_ptr<Client::Impl> client, absl::Duration deadline,
    std::function<void()> on_result) {
  if (absl::Status restart = client->RestartStatus(); !restart.ok()) return restart;
  return BackwardStream::Impl::Open(std::move(client), deadline, std::move(on_result));
}

// ---------------------------------------------------------------------------------------------

BackwardStream::BackwardStream(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
BackwardStream::~BackwardStream() = default;

absl::StatusOr<uint64_t> BackwardStream::Submit(const BackwardBatch& batch) {
  return impl_->Submit(batch);
}
absl::StatusOr<BackwardResult> BackwardStream::Next(absl::Duration timeout) {
  return impl_->Next(timeout);
}
absl::StatusOr<BackwardResult> BackwardStream::Await(uint64_t batch_id, absl::Duration timeout) {
  return impl_->Await(batch_id, timeout);
}
int64_t BackwardStream::outstanding() const { return impl_->outstanding(); }
absl::Status BackwardStream::Finish() { return impl_->Finish(); }
void BackwardStream::Cancel() { impl_->Cancel(); }

}  // namespace attngrad
