// The clients against a real attngrad-server with TLS, mutual TLS and tokens: attngrad::Client
// through TlsCredentialsFromFiles and ClientOptions::token, attngrad-cli through
// --tls_ca/--tls_cert/--tls_key/--token_file, the roles as each client sees them, and the server's
// start-up log saying whether it is open and where it listens.
#include <fstream>
#include <memory>

#include "absl/strings/str_cat.h"
#include "attngrad/client.h"
#include "attngrad/wire/layer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "random_tensors.h"
#include "test_support.h"

namespace attngrad {
namespace {

using ::attngrad::testing::CliBinary;
using ::attngrad::testing::MakeTestCertificates;
using ::attngrad::testing::RunCommand;
using ::attngrad::testing::TempDir;
using ::attngrad::testing::TestServer;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr char kTrainerToken[] = "e2e-trainer-token-0123456789";
constexpr char kAdminToken[] = "e2e-admin-token-0123456789ab";

void WriteFile(const std::string& path, const std::string& contents) {
  std::ofstream file(path, std::ios::trunc);
  file << contents;
}

class SecureServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const absl::Status made = MakeTestCertificates(dir_.path());
    ASSERT_TRUE(made.ok()) << made;
    WriteFile(Path("tokens.txt"),
              absl::StrCat(kTrainerToken, " trainer trainer-1\n", kAdminToken, " admin ops\n"));
    WriteFile(Path("trainer.token"), absl::StrCat(kTrainerToken, "\n"));
    WriteFile(Path("admin.token"), absl::StrCat(kAdminToken, "\n"));
    auto server = TestServer::Start(
        {"--tls_cert=" + Path("server.pem"), "--tls_key=" + Path("server.key"),
         "--tls_client_ca=" + Path("ca.pem"), "--tokens_file=" + Path("tokens.txt")},
        Options(kTrainerToken));
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
  }
  void TearDown() override {
    if (HasFailure() && server_) std::cerr << "server log (tail):\n" << server_->LogTail() << "\n";
  }

  std::string Path(const std::string& name) const { return dir_.path() + "/" + name; }

  ClientOptions Options(const std::string& token) const {
    ClientOptions options;
    auto credentials =
        TlsCredentialsFromFiles(Path("ca.pem"), Path("client.pem"), Path("client.key"));
    EXPECT_TRUE(credentials.ok()) << credentials.status();
    if (credentials.ok()) options.credentials = *credentials;
    options.tls_server_name = "localhost";
    options.token = token;
    options.max_attempts = 1;
    options.connect_timeout = absl::Seconds(5);
    return options;
  }

  int Cli(std::vector<std::string> args, std::string* output) {
    args.insert(args.begin(), CliBinary());
    args.push_back("--target=" + server_->target());
    args.push_back("--retries=1");
    return RunCommand(args, output);
  }

  TempDir dir_;
  std::unique_ptr<TestServer> server_;
};

TEST_F(SecureServerTest, CppClientWithCertificateAndTokenAccumulatesAndFetches) {
  auto client = Client::Connect(server_->target(), Options(kTrainerToken));
  ASSERT_TRUE(client.ok()) << client.status();
  const LayerConfig config = wire::LayerConfigFromWire((*client)->cached_info().config());
  const BatchInputs inputs = RandomBatchInputs(config, 1, 4, 3);
  BackwardBatch batch = inputs.View();
  batch.mode = v1::GRADIENT_MODE_ACCUMULATE;
  batch.batch_id = 7;
  auto result = (*client)->Backward(batch);
  ASSERT_TRUE(result.ok()) << result.status();
  auto fetched = (*client)->Fetch(/*zero_after=*/true);
  ASSERT_TRUE(fetched.ok()) << fetched.status();
  EXPECT_EQ(fetched->state.batches(), 1);
  // The trainer may not replace the weights.
  auto zeroed = (*client)->Zero();
  EXPECT_EQ(zeroed.status().code(), absl::StatusCode::kPermissionDenied) << zeroed.status();

  // Without a token the server answers UNAUTHENTICATED (Connect reads the model info).
  auto anonymous = Client::Connect(server_->target(), Options(""));
  EXPECT_EQ(anonymous.status().code(), absl::StatusCode::kUnauthenticated) << anonymous.status();
  // Without the client certificate the handshake fails.
  ClientOptions no_certificate = Options(kTrainerToken);
  no_certificate.credentials = *TlsCredentialsFromFiles(Path("ca.pem"), "", "");
  no_certificate.connect_timeout = absl::Seconds(2);
  EXPECT_FALSE(Client::Connect(server_->target(), no_certificate).ok());
}

TEST_F(SecureServerTest, CliTakesTheCaTheCertificateAndATokenFile) {
  const std::vector<std::string> tls = {
      "--tls_ca=" + Path("ca.pem"), "--tls_cert=" + Path("client.pem"),
      "--tls_key=" + Path("client.key"), "--tls_server_name=localhost"};
  auto with = [&](std::vector<std::string> args, const std::string& token_file) {
    args.insert(args.end(), tls.begin(), tls.end());
    if (!token_file.empty()) args.push_back("--token_file=" + Path(token_file));
    return args;
  };
  std::string output;
  EXPECT_EQ(Cli(with({"info"}, "trainer.token"), &output), 0) << output;
  EXPECT_NE(Cli(with({"info"}, ""), &output), 0);
  EXPECT_THAT(output, HasSubstr("UNAUTHENTICATED"));
  EXPECT_EQ(
      Cli(with({"backward", "--mode=accumulate", "--batch=1", "--seq_len=4"}, "trainer.token"),
          &output),
      0)
      << output;
  EXPECT_NE(Cli(with({"load-weights", "--weights_seed=3"}, "trainer.token"), &output), 0);
  EXPECT_THAT(output, HasSubstr("PERMISSION_DENIED"));
  // The admin takes trainer-1's window.
  EXPECT_EQ(Cli(with({"fetch", "--zero_after", "--for_client=trainer-1"}, "admin.token"), &output),
            0)
      << output;
  EXPECT_THAT(output, HasSubstr(": 1 batches"));
  // Plaintext to a TLS port fails.
  EXPECT_NE(Cli({"info", "--token_file=" + Path("trainer.token"), "--connect_timeout_seconds=2"},
                &output),
            0);
}

TEST(OpenServerTest, StartUpLogSaysAuthenticationIsOffAndWhereItListens) {
  auto server = TestServer::Start({"--allow_unauthenticated"});
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string log = (*server)->LogTail();
  EXPECT_THAT(log, HasSubstr("WARNING: authentication is OFF"));
  EXPECT_THAT(log, HasSubstr("gRPC transport: plaintext"));
  EXPECT_THAT(log, HasSubstr(absl::StrCat("gRPC listens on ", (*server)->target())));
}

// Without tokens and without --allow_unauthenticated the server is in protected mode: it says so,
// and serves its own host's clients (the tests' loopback client).
TEST(OpenServerTest, WithoutTokensTheStartUpLogSaysProtectedModeAndLoopbackIsServed) {
  auto server = TestServer::Start();
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string log = (*server)->LogTail();
  EXPECT_THAT(log, HasSubstr("protected mode"));
  EXPECT_THAT(log, Not(HasSubstr("WARNING: authentication is OFF")));
}

}  // namespace
}  // namespace attngrad
