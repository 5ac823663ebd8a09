// Who may call and how clients are kept apart, in-process on loopback with the CPU backend: TLS
// and mutual TLS with certificates made here by the openssl CLI, bearer tokens with roles
// (UNAUTHENTICATED / PERMISSION_DENIED), accumulation windows and batch-id deduplication per
// client, stream limits per client and idle streams ending.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <thread>

#include <grpcpp/grpcpp.h>
#include <grpcpp/security/credentials.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "attngrad/common/read_file.h"
#include "attngrad/wire/dtype.h"
#include "attngrad/wire/layer.h"
#include "attngrad/wire/tensor.h"
#include "rpc/auth.h"
#include "rpc/stream_registry.h"
#include "server.h"
#include "server_test_util.h"
#include "test_certificates.h"

namespace attngrad::server::testing {
namespace {

constexpr char kTrainerToken[] = "trainer-token-0123456789abcdef";
constexpr char kOtherTrainerToken[] = "trainer-token-fedcba9876543210";
constexpr char kAdminToken[] = "admin-token-0123456789abcdef0123";

// The file's bytes; "" when it cannot be read.
std::string ReadFile(const std::string& path) {
  return common::ReadFileToString(path).value_or("");
}

void WriteFile(const std::string& path, const std::string& contents) {
  std::ofstream file(path, std::ios::binary | std::ios::trunc);
  file << contents;
}

// A directory with a CA, a server certificate for localhost / 127.0.0.1, a client certificate
// signed by the CA and one signed by another CA, all made with the openssl CLI.
class Certificates {
 public:
  Certificates() {
    char pattern[] = "/tmp/attngrad-tls-XXXXXX";
    const char* made = mkdtemp(pattern);
    directory_ = made != nullptr ? made : "";
  }
  ~Certificates() {
    if (!directory_.empty()) {
      [[maybe_unused]] const int removed = std::system(("rm -rf '" + directory_ + "'").c_str());
    }
  }

  bool Make() {
    const std::string d = directory_;
    const std::string script = ::attngrad::testing::TestCertificatesScript(d);
    WriteFile(d + "/make.sh", script);
    return std::system(("sh '" + d + "/make.sh' > '" + d + "/make.log' 2>&1").c_str()) == 0;
  }

  std::string Path(const std::string& name) const { return directory_ + "/" + name; }
  std::string Log() const { return ReadFile(Path("make.log")); }

 private:
  std::string directory_;
};

// Per-call metadata: a bearer token and/or a client id (authentication off).
struct Identity {
  Identity() = default;
  Identity(std::string token_value, std::string client_id_value = "",
           std::string for_client_value = "")
      : token(std::move(token_value)),
        client_id(std::move(client_id_value)),
        for_client(std::move(for_client_value)) {}

  std::string token;
  std::string client_id;
  std::string for_client;  // admin: the window addressed
};

void Decorate(grpc::ClientContext& context, const Identity& identity) {
  if (!identity.token.empty()) context.AddMetadata("authorization", "Bearer " + identity.token);
  if (!identity.client_id.empty()) context.AddMetadata("attngrad-client-id", identity.client_id);
  if (!identity.for_client.empty()) context.AddMetadata("attngrad-for-client", identity.for_client);
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
}

struct FetchedWindow {
  grpc::Status status;
  v1::AccumulationState state;
  LayerTensors gradients;
};

FetchedWindow FetchWindow(v1::AttentionGradient::Stub& stub, const Identity& identity,
                          bool zero_after_fetch) {
  FetchedWindow fetched;
  grpc::ClientContext context;
  Decorate(context, identity);
  v1::FetchGradientsRequest request;
  request.set_zero_after_fetch(zero_after_fetch);
  auto reader = stub.FetchGradients(&context, request);
  v1::GradientChunk chunk;
  bool first = true;
  while (reader->Read(&chunk)) {
    if (first) fetched.state = chunk.state();
    first = false;
    const std::optional<Weight> weight = wire::WeightOfWireName(chunk.name());
    if (!weight.has_value()) continue;
    std::vector<float>& values = fetched.gradients[*weight];
    const std::size_t count = chunk.data().size() / sizeof(float);
    if (values.size() < chunk.offset() + count) values.resize(chunk.offset() + count);
    EXPECT_TRUE(wire::DecodeToFloat(chunk.data(), v1::DTYPE_FLOAT32, "chunk",
                                    absl::MakeSpan(values.data() + chunk.offset(), count))
                    .ok());
  }
  fetched.status = reader->Finish();
  return fetched;
}

// One request on its own stream; the status of the stream.
grpc::Status RunBackward(v1::AttentionGradient::Stub& stub, const Identity& identity,
                         const v1::BackwardRequest& request, v1::BackwardResponse* response) {
  grpc::ClientContext context;
  Decorate(context, identity);
  auto stream = stub.Backward(&context);
  stream->Write(request);
  stream->WritesDone();
  v1::BackwardResponse ignored;
  while (stream->Read(response != nullptr ? response : &ignored)) {
  }
  return stream->Finish();
}

grpc::Status GetInfo(v1::AttentionGradient::Stub& stub, const Identity& identity,
                     v1::GetModelInfoResponse* info = nullptr) {
  grpc::ClientContext context;
  Decorate(context, identity);
  v1::GetModelInfoResponse response;
  return stub.GetModelInfo(&context, {}, info != nullptr ? info : &response);
}

class SecurityTest : public ::testing::Test {
 protected:
  void StartServer(ServerOptions options) {
    options.listen = "127.0.0.1:0";
    options.metrics_listen = with_metrics_ ? "127.0.0.1:0" : "";
    options.devices = "cpu";
    options.weights = "random";
    options.weights_seed = 11;
    options.cpu_threads = 2;
    absl::StatusOr<std::unique_ptr<GradientServer>> server = GradientServer::Start(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    weights_ = std::make_unique<LayerWeights>(RandomLayerWeights(config_, 11));
  }

  std::unique_ptr<v1::AttentionGradient::Stub> Stub(
      std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::InsecureChannelCredentials()) {
    grpc::ChannelArguments arguments;
    arguments.SetMaxReceiveMessageSize(-1);
    arguments.SetMaxSendMessageSize(-1);
    arguments.SetSslTargetNameOverride("localhost");
    // A channel of its own, so that a refused handshake does not poison other tests' channels.
    arguments.SetInt("attngrad.test.channel", next_channel_++);
    return v1::AttentionGradient::NewStub(grpc::CreateCustomChannel(
        absl::StrCat("127.0.0.1:", server_->port()), credentials, arguments));
  }

  void TearDown() override {
    if (server_ != nullptr) server_->Shutdown(absl::Seconds(1));
  }

  // The server certificate and key copied to live.pem / live.key, which a test then changes, and
  // options that serve them and check them for changes every second.
  static ServerOptions LiveCertificateOptions(Certificates& certificates) {
    ServerOptions options;
    options.tls_cert = certificates.Path("live.pem");
    options.tls_key = certificates.Path("live.key");
    WriteFile(options.tls_cert, ReadFile(certificates.Path("server.pem")));
    WriteFile(options.tls_key, ReadFile(certificates.Path("server.key")));
    options.tls_reload_interval_seconds = 1;
    return options;
  }

  v1::BackwardRequest Accumulate(std::uint64_t batch_id, std::uint64_t seed, Batch* batch) {
    *batch = MakeBatch(config_, 1, 2, seed);
    return MakeRequest(config_, *batch, batch_id, v1::GRADIENT_MODE_ACCUMULATE);
  }

  // attngrad_tls_reloads_total{result="<result>"} from /metrics (with_metrics_ set).
  double TlsReloads(const std::string& result) {
    const std::string text = HttpGet(server_->metrics_port(), "/metrics");
    const std::string sample = "attngrad_tls_reloads_total{result=\"" + result + "\"} ";
    const std::size_t at = text.find(sample);
    return at == std::string::npos ? -1 : std::stod(text.substr(at + sample.size()));
  }

  bool with_metrics_ = false;  // StartServer serves /metrics on a free loopback port
  LayerConfig config_ = LayerConfig::Gemma3_4B();
  std::unique_ptr<LayerWeights> weights_;
  std::unique_ptr<GradientServer> server_;
  int next_channel_ = 0;
};

// ---------------------------------------------------------------------------------------------
// TLS and mutual TLS.

TEST_F(SecurityTest, TlsServesTlsClientsAndRefusesPlaintext) {
  Certificates certificates;
  ASSERT_TRUE(certificates.Make()) << certificates.Log();
  ServerOptions options;
  options.tls_cert = certificates.Path("server.pem");
  options.tls_key = certificates.Path("server.key");
  StartServer(options);
  ASSERT_NE(server_, nullptr);

  grpc::SslCredentialsOptions tls;
  tls.pem_root_certs = ReadFile(certificates.Path("ca.pem"));
  auto secure = Stub(grpc::SslCredentials(tls));
  const grpc::Status ok = GetInfo(*secure, {});
  EXPECT_TRUE(ok.ok()) << ok.error_code() << " " << ok.error_message();

  auto plaintext = Stub();
  const grpc::Status refused = GetInfo(*plaintext, {});
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::UNAVAILABLE) << refused.error_message();

  // A client that trusts another CA does not accept the server.
  grpc::SslCredentialsOptions wrong_ca;
  wrong_ca.pem_root_certs = ReadFile(certificates.Path("other-ca.pem"));
  auto untrusting = Stub(grpc::SslCredentials(wrong_ca));
  EXPECT_EQ(GetInfo(*untrusting, {}).error_code(), grpc::StatusCode::UNAVAILABLE);
}

TEST_F(SecurityTest, MutualTlsRequiresAClientCertificateOfTheCa) {
  Certificates certificates;
  ASSERT_TRUE(certificates.Make()) << certificates.Log();
  ServerOptions options;
  options.tls_cert = certificates.Path("server.pem");
  options.tls_key = certificates.Path("server.key");
  options.tls_client_ca = certificates.Path("ca.pem");
  StartServer(options);
  ASSERT_NE(server_, nullptr);

  grpc::SslCredentialsOptions with_certificate;
  with_certificate.pem_root_certs = ReadFile(certificates.Path("ca.pem"));
  with_certificate.pem_private_key = ReadFile(certificates.Path("client.key"));
  with_certificate.pem_cert_chain = ReadFile(certificates.Path("client.pem"));
  auto client = Stub(grpc::SslCredentials(with_certificate));
  const grpc::Status ok = GetInfo(*client, {});
  EXPECT_TRUE(ok.ok()) << ok.error_code() << " " << ok.error_message();

  grpc::SslCredentialsOptions without_certificate;
  without_certificate.pem_root_certs = with_certificate.pem_root_certs;
  auto anonymous = Stub(grpc::SslCredentials(without_certificate));
  EXPECT_EQ(GetInfo(*anonymous, {}).error_code(), grpc::StatusCode::UNAVAILABLE);

  grpc::SslCredentialsOptions stranger = without_certificate;
  stranger.pem_private_key = ReadFile(certificates.Path("stranger.key"));
  stranger.pem_cert_chain = ReadFile(certificates.Path("stranger.pem"));
  auto foreign = Stub(grpc::SslCredentials(stranger));
  EXPECT_EQ(GetInfo(*foreign, {}).error_code(), grpc::StatusCode::UNAVAILABLE);
}

TEST_F(SecurityTest, ChangedCertificateFilesAreServedWithoutARestart) {
  Certificates certificates;
  ASSERT_TRUE(certificates.Make()) << certificates.Log();
  const ServerOptions options = LiveCertificateOptions(certificates);
  const std::string& certificate = options.tls_cert;
  const std::string& key = options.tls_key;
  StartServer(options);
  ASSERT_NE(server_, nullptr);
  auto trusting = [&](const std::string& ca) {
    grpc::SslCredentialsOptions tls;
    tls.pem_root_certs = ReadFile(certificates.Path(ca));
    return Stub(grpc::SslCredentials(tls));
  };
  EXPECT_TRUE(GetInfo(*trusting("ca.pem"), {}).ok());
  EXPECT_FALSE(GetInfo(*trusting("other-ca.pem"), {}).ok());

  // A renewed certificate from another CA, moved in by rename (key first, as a Secret swap would
  // make both appear at once; the watcher reads the pair together).
  WriteFile(key + ".new", ReadFile(certificates.Path("renewed.key")));
  WriteFile(certificate + ".new", ReadFile(certificates.Path("renewed.pem")));
  ASSERT_EQ(std::rename((key + ".new").c_str(), key.c_str()), 0);
  ASSERT_EQ(std::rename((certificate + ".new").c_str(), certificate.c_str()), 0);
  bool renewed = false;
  for (int attempt = 0; attempt < 40 && !renewed; ++attempt) {
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
    renewed = GetInfo(*trusting("other-ca.pem"), {}).ok();
  }
  EXPECT_TRUE(renewed) << "the renewed certificate was not served within 10 s";
  EXPECT_FALSE(GetInfo(*trusting("ca.pem"), {}).ok());
}

TEST_F(SecurityTest, TlsFlagsAreChecked) {
  Certificates certificates;
  ASSERT_TRUE(certificates.Make()) << certificates.Log();
  ServerOptions options;
  options.listen = "127.0.0.1:0";
  options.metrics_listen = "";
  options.devices = "cpu";
  options.tls_cert = certificates.Path("server.pem");
  EXPECT_EQ(GradientServer::Start(options).status().code(), absl::StatusCode::kInvalidArgument);
  options.tls_key = certificates.Path("missing.key");
  EXPECT_EQ(GradientServer::Start(options).status().code(), absl::StatusCode::kNotFound);
  options.tls_key = certificates.Path("server.pem");  // no private key in it
  EXPECT_EQ(GradientServer::Start(options).status().code(), absl::StatusCode::kInvalidArgument);
  options.tls_cert = "";
  options.tls_key = "";
  options.tls_client_ca = certificates.Path("ca.pem");
  EXPECT_EQ(GradientServer::Start(options).status().code(), absl::StatusCode::kInvalidArgument);
}

// A certificate block whose contents are not a certificate: it has the PEM markers the old check
// looked for, and gRPC refused every handshake with it.
constexpr char kGarbageCertificate[] =
    "-----BEGIN CERTIFICATE-----\nbm90IGEgY2VydGlmaWNhdGU=\n-----END CERTIFICATE-----\n";

// Files that cannot serve a handshake stop the start, the error naming the flag: a key of another
// certificate, a garbage certificate, a garbage client CA (before, the server said "serving" and
// then every handshake failed).
TEST_F(SecurityTest, TlsFilesThatCannotServeAreRefusedAtStart) {
  Certificates certificates;
  ASSERT_TRUE(certificates.Make()) << certificates.Log();
  WriteFile(certificates.Path("garbage.pem"), kGarbageCertificate);
  ServerOptions options;
  options.listen = "127.0.0.1:0";
  options.metrics_listen = "";
  options.devices = "cpu";
  options.tls_cert = certificates.Path("server.pem");
  options.tls_key = certificates.Path("renewed.key");  // the key of another certificate
  absl::Status refused = GradientServer::Start(options).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
  EXPECT_NE(refused.message().find("--tls_key"), std::string::npos) << refused;

  options.tls_key = certificates.Path("server.key");
  options.tls_cert = certificates.Path("garbage.pem");
  refused = GradientServer::Start(options).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
  EXPECT_NE(refused.message().find("--tls_cert"), std::string::npos) << refused;

  options.tls_cert = certificates.Path("server.pem");
  options.tls_client_ca = certificates.Path("garbage.pem");
  refused = GradientServer::Start(options).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
  EXPECT_NE(refused.message().find("--tls_client_ca"), std::string::npos) << refused;

  // A client CA bundle with a good certificate followed by a garbage one is refused too.
  WriteFile(certificates.Path("mixed-ca.pem"),
            ReadFile(certificates.Path("ca.pem")) + kGarbageCertificate);
  options.tls_client_ca = certificates.Path("mixed-ca.pem");
  refused = GradientServer::Start(options).status();
  EXPECT_NE(refused.message().find("--tls_client_ca"), std::string::npos) << refused;

  options.tls_client_ca = certificates.Path("ca.pem");
  EXPECT_TRUE(GradientServer::Start(options).ok());
}

// Changed files that fail the checks are refused: the last good credentials keep serving, the
// refusal is counted; a good set after them is applied.
TEST_F(SecurityTest, BadTlsFilesAtReloadKeepTheLastGoodCredentials) {
  Certificates certificates;
  ASSERT_TRUE(certificates.Make()) << certificates.Log();
  const ServerOptions options = LiveCertificateOptions(certificates);
  const std::string& certificate = options.tls_cert;
  const std::string& key = options.tls_key;
  with_metrics_ = true;
  StartServer(options);
  ASSERT_NE(server_, nullptr);
  auto trusting = [&](const std::string& ca) {
    grpc::SslCredentialsOptions tls;
    tls.pem_root_certs = ReadFile(certificates.Path(ca));
    return Stub(grpc::SslCredentials(tls));
  };
  auto replace = [](const std::string& path, const std::string& contents) {
    WriteFile(path + ".new", contents);
    ASSERT_EQ(std::rename((path + ".new").c_str(), path.c_str()), 0);
  };
  auto wait_for_rejections = [&](double count) {
    for (int attempt = 0; attempt < 40 && TlsReloads("rejected") < count; ++attempt) {
      std::this_thread::sleep_for(std::chrono::milliseconds(250));
    }
    EXPECT_EQ(TlsReloads("rejected"), count);
  };
  ASSERT_TRUE(GetInfo(*trusting("ca.pem"), {}).ok());

  replace(certificate, kGarbageCertificate);
  wait_for_rejections(1);
  std::this_thread::sleep_for(std::chrono::seconds(2));  // more than gRPC's re-read of its files
  const grpc::Status after_garbage = GetInfo(*trusting("ca.pem"), {});
  EXPECT_TRUE(after_garbage.ok()) << after_garbage.error_message();
  EXPECT_EQ(TlsReloads("rejected"), 1) << "the same bad file was counted more than once";

  replace(certificate, ReadFile(certificates.Path("renewed.pem")));  // the key is still server.key
  wait_for_rejections(2);
  std::this_thread::sleep_for(std::chrono::seconds(2));
  const grpc::Status after_mismatch = GetInfo(*trusting("ca.pem"), {});
  EXPECT_TRUE(after_mismatch.ok()) << after_mismatch.error_message();
  EXPECT_EQ(TlsReloads("applied"), 0);

  replace(key, ReadFile(certificates.Path("renewed.key")));
  bool renewed = false;
  for (int attempt = 0; attempt < 40 && !renewed; ++attempt) {
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
    renewed = GetInfo(*trusting("other-ca.pem"), {}).ok();
  }
  EXPECT_TRUE(renewed) << "the good renewed pair was not served within 10 s";
  EXPECT_EQ(TlsReloads("applied"), 1);
}

// ---------------------------------------------------------------------------------------------
// Tokens and roles (without them any client could replace the weights, zero or take the sums).

class TokenTest : public SecurityTest {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/attngrad-tokens-XXXXXX";
    const int fd = mkstemp(pattern);
    ASSERT_GE(fd, 0);
    close(fd);
    tokens_file_ = pattern;
    WriteFile(tokens_file_, absl::StrCat("# token role client_id\n", kTrainerToken,
                                         " trainer trainer-a\n", kOtherTrainerToken,
                                         " trainer trainer-b\n", kAdminToken, " admin ops\n"));
    ServerOptions options;
    options.tokens_file = tokens_file_;
    StartServer(options);
  }
  void TearDown() override {
    SecurityTest::TearDown();
    unlink(tokens_file_.c_str());
  }
  std::string tokens_file_;
};

TEST_F(TokenTest, CallsWithoutAKnownTokenAreUnauthenticated) {
  auto stub = Stub();
  EXPECT_EQ(GetInfo(*stub, {}).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(GetInfo(*stub, {"not-a-token-of-this-server"}).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  // A client id does not stand in for a token.
  EXPECT_EQ(GetInfo(*stub, {"", "trainer-a"}).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  Batch batch;
  EXPECT_EQ(RunBackward(*stub, {}, Accumulate(1, 5, &batch), nullptr).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(FetchWindow(*stub, {}, true).status.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  grpc::ClientContext context;
  v1::LoadWeightsResponse response;
  auto upload = stub->LoadWeights(&context, &response);
  upload->WritesDone();
  EXPECT_EQ(upload->Finish().error_code(), grpc::StatusCode::UNAUTHENTICATED);
}

TEST_F(TokenTest, TrainersComputeAndFetchTheirOwnSumsOnly) {
  auto stub = Stub();
  const Identity trainer{kTrainerToken};
  EXPECT_TRUE(GetInfo(*stub, trainer).ok());
  Batch batch;
  v1::BackwardResponse response;
  const grpc::Status streamed = RunBackward(*stub, trainer, Accumulate(1, 5, &batch), &response);
  ASSERT_TRUE(streamed.ok()) << streamed.error_message();
  EXPECT_FALSE(response.has_error()) << response.error().message();
  const FetchedWindow own = FetchWindow(*stub, trainer, /*zero_after_fetch=*/false);
  EXPECT_TRUE(own.status.ok()) << own.status.error_message();
  EXPECT_EQ(own.state.batches(), 1);

  // LoadWeights, ZeroGradients and another client's window need the admin role.
  grpc::ClientContext context;
  Decorate(context, trainer);
  v1::LoadWeightsResponse loaded;
  auto upload = stub->LoadWeights(&context, &loaded);
  upload->WritesDone();
  const grpc::Status refused = upload->Finish();
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_NE(refused.error_message().find("admin"), std::string::npos) << refused.error_message();
  grpc::ClientContext zero_context;
  Decorate(zero_context, trainer);
  v1::ZeroGradientsResponse zeroed;
  EXPECT_EQ(stub->ZeroGradients(&zero_context, {}, &zeroed).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(FetchWindow(*stub, {kOtherTrainerToken, "", "trainer-a"}, true).status.error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  // The other trainer's own window is empty: trainer-a's batch is not in it.
  const FetchedWindow other = FetchWindow(*stub, {kOtherTrainerToken}, true);
  EXPECT_TRUE(other.status.ok());
  EXPECT_EQ(other.state.batches(), 0);
  EXPECT_EQ(FetchWindow(*stub, trainer, false).state.batches(), 1);
}

TEST_F(TokenTest, AdminsLoadWeightsZeroAndAddressAnyWindow) {
  auto stub = Stub();
  Batch batch;
  ASSERT_TRUE(RunBackward(*stub, {kTrainerToken}, Accumulate(1, 6, &batch), nullptr).ok());
  const Identity admin{kAdminToken};
  // LoadWeights passes authorization and reaches the upload's own checks.
  grpc::ClientContext context;
  Decorate(context, admin);
  v1::LoadWeightsResponse loaded;
  auto upload = stub->LoadWeights(&context, &loaded);
  upload->WritesDone();
  const grpc::Status incomplete = upload->Finish();
  EXPECT_EQ(incomplete.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
      << incomplete.error_message();
  // The admin fetches-and-zeroes trainer-a's window.
  const FetchedWindow taken = FetchWindow(*stub, {kAdminToken, "", "trainer-a"}, true);
  ASSERT_TRUE(taken.status.ok()) << taken.status.error_message();
  EXPECT_EQ(taken.state.batches(), 1);
  const Gradients reference = Reference(*weights_, batch);
  EXPECT_TRUE(
      Close(taken.gradients, reference.weights, 1e-4, "trainer-a's sums, fetched by admin"));
  EXPECT_EQ(FetchWindow(*stub, {kTrainerToken}, false).state.batches(), 0);
  grpc::ClientContext zero_context;
  Decorate(zero_context, {kAdminToken, "", "trainer-b"});
  v1::ZeroGradientsResponse zeroed;
  EXPECT_TRUE(stub->ZeroGradients(&zero_context, {}, &zeroed).ok());
}

TEST_F(SecurityTest, TokensOverMutualTlsEndToEnd) {
  Certificates certificates;
  ASSERT_TRUE(certificates.Make()) << certificates.Log();
  const std::string tokens = certificates.Path("tokens.txt");
  WriteFile(tokens, absl::StrCat(kTrainerToken, " trainer\n"));
  ServerOptions options;
  options.tls_cert = certificates.Path("server.pem");
  options.tls_key = certificates.Path("server.key");
  options.tls_client_ca = certificates.Path("ca.pem");
  options.tokens_file = tokens;
  StartServer(options);
  ASSERT_NE(server_, nullptr);
  grpc::SslCredentialsOptions tls;
  tls.pem_root_certs = ReadFile(certificates.Path("ca.pem"));
  tls.pem_private_key = ReadFile(certificates.Path("client.key"));
  tls.pem_cert_chain = ReadFile(certificates.Path("client.pem"));
  auto stub = Stub(grpc::SslCredentials(tls));
  EXPECT_EQ(GetInfo(*stub, {}).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  Batch batch;
  v1::BackwardResponse response;
  ASSERT_TRUE(RunBackward(*stub, {kTrainerToken}, Accumulate(3, 8, &batch), &response).ok());
  EXPECT_FALSE(response.has_error());
  EXPECT_EQ(FetchWindow(*stub, {kTrainerToken}, true).state.batches(), 1);
}

// ---------------------------------------------------------------------------------------------
// Per-client windows (batch ids were once deduplicated server-wide, one window for all).

class IsolationTest : public SecurityTest {
 protected:
  void SetUp() override { StartServer(ServerOptions()); }
};

TEST_F(IsolationTest, TwoClientsWithTheSameBatchIdsBothAccumulate) {
  auto stub = Stub();
  Batch batch_a, batch_b;
  v1::BackwardResponse response_a, response_b;
  ASSERT_TRUE(RunBackward(*stub, {"", "trainer-a"}, Accumulate(1, 21, &batch_a), &response_a).ok());
  ASSERT_TRUE(RunBackward(*stub, {"", "trainer-b"}, Accumulate(1, 22, &batch_b), &response_b).ok());
  EXPECT_FALSE(response_a.duplicate());
  EXPECT_FALSE(response_b.duplicate()) << "batch id 1 of trainer-b was taken for trainer-a's";
  EXPECT_NE(response_a.accumulation_window_id(), response_b.accumulation_window_id());
  // The same id again from trainer-a is a retry.
  v1::BackwardResponse retry;
  ASSERT_TRUE(RunBackward(*stub, {"", "trainer-a"}, Accumulate(1, 21, &batch_a), &retry).ok());
  EXPECT_TRUE(retry.duplicate());

  const FetchedWindow a = FetchWindow(*stub, {"", "trainer-a"}, false);
  const FetchedWindow b = FetchWindow(*stub, {"", "trainer-b"}, false);
  ASSERT_TRUE(a.status.ok() && b.status.ok());
  EXPECT_EQ(a.state.batches(), 1);
  EXPECT_EQ(b.state.batches(), 1);
  EXPECT_TRUE(Close(a.gradients, Reference(*weights_, batch_a).weights, 1e-4, "trainer-a"));
  EXPECT_TRUE(Close(b.gradients, Reference(*weights_, batch_b).weights, 1e-4, "trainer-b"));
}

TEST_F(IsolationTest, OneClientsFetchAndZeroLeavesTheOthersSums) {
  auto stub = Stub();
  Batch batch_a, batch_b;
  ASSERT_TRUE(RunBackward(*stub, {"", "trainer-a"}, Accumulate(1, 31, &batch_a), nullptr).ok());
  ASSERT_TRUE(RunBackward(*stub, {"", "trainer-b"}, Accumulate(2, 32, &batch_b), nullptr).ok());
  const FetchedWindow a = FetchWindow(*stub, {"", "trainer-a"}, /*zero_after_fetch=*/true);
  ASSERT_TRUE(a.status.ok());
  EXPECT_EQ(a.state.batches(), 1);
  EXPECT_TRUE(Close(a.gradients, Reference(*weights_, batch_a).weights, 1e-4, "trainer-a"));
  const FetchedWindow b = FetchWindow(*stub, {"", "trainer-b"}, false);
  ASSERT_TRUE(b.status.ok());
  EXPECT_EQ(b.state.batches(), 1) << "trainer-a's fetch-and-zero took trainer-b's sums";
  EXPECT_TRUE(Close(b.gradients, Reference(*weights_, batch_b).weights, 1e-4, "trainer-b"));
  // And the default client (no client id) has a window of its own, empty.
  EXPECT_EQ(FetchWindow(*stub, {}, false).state.batches(), 0);
}

class SumsLimitTest : public SecurityTest {
 protected:
  void SetUp() override {
    ServerOptions options;
    options.max_clients_with_sums = 1;
    StartServer(options);
  }
};

TEST_F(SumsLimitTest, ClientsHoldingSumsAreBoundedAndFreedByFetchAndZero) {
  auto stub = Stub();
  Batch batch;
  ASSERT_TRUE(RunBackward(*stub, {"", "trainer-a"}, Accumulate(1, 41, &batch), nullptr).ok());
  v1::BackwardResponse refused;
  ASSERT_TRUE(RunBackward(*stub, {"", "trainer-b"}, Accumulate(1, 42, &batch), &refused).ok());
  EXPECT_EQ(refused.error().code(), static_cast<int>(grpc::StatusCode::RESOURCE_EXHAUSTED));
  EXPECT_NE(refused.error().message().find("--max_clients_with_sums"), std::string::npos);
  ASSERT_TRUE(FetchWindow(*stub, {"", "trainer-a"}, true).status.ok());
  v1::BackwardResponse accepted;
  ASSERT_TRUE(RunBackward(*stub, {"", "trainer-b"}, Accumulate(1, 42, &batch), &accepted).ok());
  EXPECT_FALSE(accepted.has_error()) << accepted.error().message();
  const FetchedWindow b = FetchWindow(*stub, {"", "trainer-b"}, false);
  EXPECT_EQ(b.state.batches(), 1);
  EXPECT_TRUE(Close(b.gradients, Reference(*weights_, batch).weights, 1e-4,
                    "trainer-b in the set trainer-a gave back (zeroed)"));
}

// ---------------------------------------------------------------------------------------------
// Streams (64 idle streams of one client once locked every other client out).

class StreamShareTest : public SecurityTest {
 protected:
  void SetUp() override {
    ServerOptions options;
    options.max_concurrent_streams = 4;
    options.max_streams_per_client = 2;
    options.stream_idle_timeout_seconds = 2;
    StartServer(options);
  }

  // Opens a Backward stream and sends nothing.
  struct OpenStream {
    grpc::ClientContext context;
    std::unique_ptr<grpc::ClientReaderWriter<v1::BackwardRequest, v1::BackwardResponse>> stream;
  };
  std::unique_ptr<OpenStream> Open(v1::AttentionGradient::Stub& stub, const Identity& identity) {
    auto open = std::make_unique<OpenStream>();
    Decorate(open->context, identity);
    open->stream = stub.Backward(&open->context);
    return open;
  }
  // The status a stream ended with, once it has ended.
  static grpc::Status Ended(OpenStream& open) {
    v1::BackwardResponse response;
    while (open.stream->Read(&response)) {
    }
    return open.stream->Finish();
  }
};

TEST_F(StreamShareTest, OneClientsIdleStreamsDoNotLockOthersOut) {
  auto stub = Stub();
  std::vector<std::unique_ptr<OpenStream>> idle;
  for (int i = 0; i < 2; ++i) idle.push_back(Open(*stub, {"", "greedy"}));
  // Until the server has counted them (its reactor is made when the call's headers arrive).
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  auto third = Open(*stub, {"", "greedy"});
  const grpc::Status refused = Ended(*third);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(refused.error_message().find("--max_streams_per_client"), std::string::npos)
      << refused.error_message();
  // Another client still gets a stream and its batch computed.
  Batch batch;
  v1::BackwardResponse response;
  const grpc::Status other =
      RunBackward(*stub, {"", "patient"}, Accumulate(1, 51, &batch), &response);
  EXPECT_TRUE(other.ok()) << other.error_message();
  EXPECT_FALSE(response.has_error());
}

// Idle streams under several client ids fill the server; a client with fewer streams still gets
// one: the server closes an idle stream of a client holding the most (UNAVAILABLE, saying why).
// Before: RESOURCE_EXHAUSTED naming --max_concurrent_streams until the idle timeout.
TEST_F(StreamShareTest, IdleStreamsOfSeveralClientIdsDoNotLockOthersOut) {
  // Each client on a connection of its own (a connection carries --max_concurrent_streams
  // HTTP/2 streams at most, so a fourth stream on one would wait in the client).
  auto greedy_a = Stub();
  auto greedy_b = Stub();
  auto patient = Stub();
  std::vector<std::unique_ptr<OpenStream>> idle;
  for (int i = 0; i < 2; ++i) {
    idle.push_back(Open(*greedy_a, {"", "greedy-a"}));
    idle.push_back(Open(*greedy_b, {"", "greedy-b"}));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(500));  // counted by the server
  Batch batch;
  v1::BackwardResponse response;
  const grpc::Status other =
      RunBackward(*patient, {"", "patient"}, Accumulate(1, 52, &batch), &response);
  EXPECT_TRUE(other.ok()) << other.error_message();
  EXPECT_FALSE(response.has_error()) << response.error().message();
  int evicted = 0;
  for (auto& open : idle) {  // the others end when they idle out
    const grpc::Status ended = Ended(*open);
    if (ended.error_code() == grpc::StatusCode::UNAVAILABLE) {
      EXPECT_NE(ended.error_message().find("to make room"), std::string::npos)
          << ended.error_message();
      ++evicted;
    }
  }
  EXPECT_EQ(evicted, 1);
}

// The registry's rule alone, with scripted streams: when the server is full, the longest-idle
// stream of the client holding the most streams is closed for a client holding at least two
// fewer; busy streams never are, and no stream goes back and forth between two clients.
class ScriptedStream final : public IdleStream {
 public:
  explicit ScriptedStream(std::optional<std::chrono::steady_clock::time_point> idle_since)
      : idle_since_(idle_since) {}
  bool ExpireIfIdle(std::chrono::steady_clock::time_point,
                    std::chrono::steady_clock::duration) override {
    return false;
  }
  bool Drain() override { return false; }
  std::optional<std::chrono::steady_clock::time_point> IdleSince() override { return idle_since_; }
  bool EvictIfIdle() override {
    evicted_ = idle_since_.has_value();
    return evicted_;
  }
  void FinishIdle() override { finished_ = true; }
  bool evicted() const { return evicted_ && finished_; }

 private:
  const std::optional<std::chrono::steady_clock::time_point> idle_since_;
  bool evicted_ = false;
  bool finished_ = false;
};

TEST(StreamRegistryTest, AFullServerClosesAnIdleStreamOfTheBusiestClientForAClientWithFewer) {
  StreamLimits limits;
  limits.max_streams = 4;
  limits.max_streams_per_client = 4;
  limits.idle_timeout = std::chrono::steady_clock::duration::zero();  // no idle thread
  StreamRegistry registry(limits);
  const auto now = std::chrono::steady_clock::now();
  ScriptedStream a_old(now - std::chrono::seconds(9)), a_new(now - std::chrono::seconds(1));
  ScriptedStream a_busy(std::nullopt), b(now - std::chrono::seconds(20));
  ASSERT_TRUE(registry.Open("a", &a_busy).ok());
  ASSERT_TRUE(registry.Open("a", &a_new).ok());
  ASSERT_TRUE(registry.Open("a", &a_old).ok());
  ASSERT_TRUE(registry.Open("b", &b).ok());
  // c holds none: a holds three, so a's longest-idle stream makes room (not b's, idle longer).
  ScriptedStream c1(std::nullopt);
  ASSERT_TRUE(registry.Open("c", &c1).ok());
  EXPECT_TRUE(a_old.evicted());
  EXPECT_FALSE(a_new.evicted());
  EXPECT_FALSE(b.evicted());
  EXPECT_EQ(registry.open_streams(), 4);
  // a (2) may not take a slot back from anyone holding fewer than 4: refused, nothing closed.
  ScriptedStream a_again(std::nullopt);
  const absl::Status refused = registry.Open("a", &a_again);
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(refused.message().find("--max_concurrent_streams"), std::string::npos) << refused;
  // d holds none: a (2) is two ahead; its idle stream goes, its busy one never.
  ScriptedStream d(std::nullopt);
  ASSERT_TRUE(registry.Open("d", &d).ok());
  EXPECT_TRUE(a_new.evicted());
  EXPECT_FALSE(a_busy.evicted());
  // Now a, b, c and d hold one each: nobody is two ahead of e.
  ScriptedStream e(std::nullopt);
  EXPECT_EQ(registry.Open("e", &e).code(), absl::StatusCode::kResourceExhausted);
  for (IdleStream* stream : std::initializer_list<IdleStream*>{&a_busy, &b, &c1, &d}) {
    registry.Close(stream);
  }
  EXPECT_EQ(registry.open_streams(), 0);
}

TEST_F(StreamShareTest, IdleStreamsEnd) {
  auto stub = Stub();
  const auto start = std::chrono::steady_clock::now();
  auto idle = Open(*stub, {"", "sleepy"});
  const grpc::Status ended = Ended(*idle);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(ended.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << ended.error_message();
  EXPECT_NE(ended.error_message().find("--stream_idle_timeout_seconds"), std::string::npos);
  EXPECT_GE(seconds, 1.9);
  EXPECT_LT(seconds, 10.0);
  // A stream that keeps sending is not idle: three batches 1.2 s apart (3.6 s > the timeout).
  auto busy = Open(*stub, {"", "busy"});
  for (int i = 0; i < 3; ++i) {
    Batch batch;
    ASSERT_TRUE(busy->stream->Write(Accumulate(100 + i, 60 + i, &batch)));
    v1::BackwardResponse response;
    ASSERT_TRUE(busy->stream->Read(&response));
    EXPECT_FALSE(response.has_error());
    std::this_thread::sleep_for(std::chrono::milliseconds(1200));
  }
  busy->stream->WritesDone();
  EXPECT_TRUE(Ended(*busy).ok());
}

// ---------------------------------------------------------------------------------------------
// The tokens file and the comparison.

TEST(AuthenticatorTest, ReadsTokensRolesAndClientIds) {
  absl::StatusOr<Authenticator> table = Authenticator::FromText(
      absl::StrCat("# comment\n\n", kTrainerToken, " trainer\n", kAdminToken, "\tadmin  ops\n"),
      "test");
  ASSERT_TRUE(table.ok()) << table.status();
  EXPECT_TRUE(table->enabled());
  EXPECT_EQ(table->token_count(), 2u);
  std::multimap<grpc::string_ref, grpc::string_ref> metadata;
  const std::string bearer = absl::StrCat("Bearer ", kTrainerToken);
  metadata.emplace("authorization", bearer);
  absl::StatusOr<Caller> caller = table->AuthenticateMetadata(metadata);
  ASSERT_TRUE(caller.ok());
  EXPECT_EQ(caller->role, Role::kTrainer);
  EXPECT_EQ(caller->client_id, "trainer-line3");
  EXPECT_EQ(Authorize(*caller, Operation::kLoadWeights, "LoadWeights").code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(Authorize(*caller, Operation::kBackward, "Backward").ok());

  for (const char* bad :
       {"short trainer\n", "abcdefghijklmnopqrstuvwxyz root\n", "abcdefghijklmnopqrstuvwxyz\n",
        "abcdefghijklmnopqrstuvwxyz trainer bad/id\n",
        "abcdefghijklmnopqrstuvwxyz trainer\nabcdefghijklmnopqrstuvwxyz admin\n",
        "# only a comment\n"}) {
    absl::StatusOr<Authenticator> refused = Authenticator::FromText(bad, "test");
    EXPECT_FALSE(refused.ok()) << bad;
    if (!refused.ok()) {
      EXPECT_EQ(refused.status().message().find("abcdefghijklmnopqrstuvwxyz"), std::string::npos)
          << "an error message shows a token: " << refused.status();
    }
  }
  EXPECT_TRUE(ConstantTimeEquals("same-bytes", "same-bytes"));
  EXPECT_FALSE(ConstantTimeEquals("same-bytes", "same-bytez"));
  EXPECT_FALSE(ConstantTimeEquals("same", "same-bytes"));
}

// A line whose client id is another line's default id ("<role>-line<N>") would make the two tokens
// share one window: the file is refused, naming both lines, whichever line comes first.
TEST(AuthenticatorTest, AnExplicitClientIdEqualToAnotherLinesDefaultIsRefused) {
  const std::string token_a = "token-aaaaaaaaaaaaaaaa";
  const std::string token_b = "token-bbbbbbbbbbbbbbbb";
  const std::string later_named =
      absl::StrCat(token_a, " trainer\n", token_b, " trainer trainer-line1\n");
  const std::string earlier_named =
      absl::StrCat(token_a, " admin trainer-line2\n", token_b, " trainer\n");
  for (const std::string& text : {later_named, earlier_named}) {
    absl::StatusOr<Authenticator> refused = Authenticator::FromText(text, "tokens.txt");
    ASSERT_FALSE(refused.ok()) << text;
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
    const std::string message(refused.status().message());
    EXPECT_NE(message.find("line 1"), std::string::npos) << message;
    EXPECT_NE(message.find("line 2"), std::string::npos) << message;
    EXPECT_NE(message.find("tokens.txt"), std::string::npos) << message;
    EXPECT_EQ(message.find(token_a), std::string::npos) << message;
    EXPECT_EQ(message.find(token_b), std::string::npos) << message;
  }
  // Two lines that name the same client id share it on purpose (two tokens of one client).
  EXPECT_TRUE(Authenticator::FromText(
                  absl::StrCat(token_a, " trainer ops\n", token_b, " admin ops\n"), "tokens.txt")
                  .ok());
}

TEST(AuthenticatorTest, OpenServersTakeTheClientIdFromMetadata) {
  const Authenticator open = Authenticator::Open();
  std::multimap<grpc::string_ref, grpc::string_ref> metadata;
  EXPECT_EQ(open.AuthenticateMetadata(metadata)->client_id, "default");
  metadata.emplace("attngrad-client-id", "trainer-7");
  EXPECT_EQ(open.AuthenticateMetadata(metadata)->client_id, "trainer-7");
  std::multimap<grpc::string_ref, grpc::string_ref> bad;
  bad.emplace("attngrad-client-id", "has space");
  EXPECT_EQ(open.AuthenticateMetadata(bad).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(AuthenticatorTest, LoopbackPeersAreThisHostsCallers) {
  for (const char* peer :
       {"ipv4:127.0.0.1:5000", "ipv4:127.3.2.1:1", "ipv6:[::1]:5000", "ipv6:%5B::1%5D:5000",
        "ipv6:[::ffff:127.0.0.1]:80", "unix:/tmp/socket", "unix-abstract:attngrad"}) {
    EXPECT_TRUE(IsLoopbackPeer(peer)) << peer;
  }
  for (const char* peer :
       {"ipv4:10.0.0.7:5000", "ipv4:128.0.0.1:1", "ipv4:1.127.0.0:1", "ipv6:[2001:db8::1]:5000",
        "ipv6:[::2]:5000", "ipv6:[::ffff:10.0.0.1]:80", "", "127.0.0.1:5000"}) {
    EXPECT_FALSE(IsLoopbackPeer(peer)) << peer;
  }
}

// Protected mode: a server without tokens serves only its own host unless told otherwise; with
// tokens the bearer token decides, wherever the caller is.
TEST(AuthenticatorTest, WithoutTokensOnlyThisHostIsServedUnlessAllowed) {
  const Authenticator protected_mode = Authenticator::Open();
  EXPECT_TRUE(protected_mode.loopback_only());
  EXPECT_TRUE(protected_mode.CheckPeer("ipv4:127.0.0.1:4000").ok());
  const absl::Status refused = protected_mode.CheckPeer("ipv4:10.1.2.3:4000");
  EXPECT_EQ(refused.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_NE(refused.message().find("--tokens_file"), absl::string_view::npos) << refused;
  EXPECT_NE(refused.message().find("--allow_unauthenticated"), absl::string_view::npos) << refused;
  EXPECT_NE(refused.message().find("10.1.2.3"), absl::string_view::npos) << refused;
  const Authenticator open = Authenticator::Open(/*loopback_only=*/false);
  EXPECT_FALSE(open.loopback_only());
  EXPECT_TRUE(open.CheckPeer("ipv4:10.1.2.3:4000").ok());
  absl::StatusOr<Authenticator> with_tokens =
      Authenticator::FromText("0123456789abcdef0123 trainer\n", "test");
  ASSERT_TRUE(with_tokens.ok()) << with_tokens.status();
  EXPECT_FALSE(with_tokens->loopback_only());
  EXPECT_TRUE(with_tokens->CheckPeer("ipv4:10.1.2.3:4000").ok());
}

}  // namespace
}  // namespace attngrad::server::testing
