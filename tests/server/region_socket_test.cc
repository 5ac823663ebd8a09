// The region socket (rpc/region_socket.h, attngrad/wire/region_socket.h): a client of this host
// registers host memory by passing a memfd sealed against shrinking. Hostile clients cannot fault
// the server (a shrunk object used to end it with SIGBUS) or reach memory they do not hold
// (RegisterRegion by name is refused before anything is opened, with one answer whether the name
// exists or not); every bad descriptor or request is refused naming what is wrong.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "attngrad/client.h"
#include "attngrad/shared_memory_region.h"
#include "attngrad/wire/region_socket.h"
#include "child_process.h"
#include "rpc/region_socket_listener.h"
#include "server.h"
#include "server_test_util.h"

namespace attngrad::server::testing {
namespace {

using wire::ParseRegionReply;
using wire::ParseRegionRequest;

TEST(RegionSocketProtocolTest, RequestsAndRepliesRoundTrip) {
  wire::RegionSocketRequest request;
  request.byte_size = 1 << 20;
  request.token = "abcdefghijklmnop0123";
  request.client_id = "trainer-7";
  const absl::StatusOr<wire::RegionSocketRequest> parsed =
      ParseRegionRequest(wire::FormatRegionRequest(request));
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->byte_size, 1 << 20);
  EXPECT_EQ(parsed->token, request.token);
  EXPECT_EQ(parsed->client_id, request.client_id);

  EXPECT_EQ(*ParseRegionReply(wire::FormatRegionReply(std::uint64_t{42})), 42u);
  const absl::Status refused =
      ParseRegionReply(wire::FormatRegionReply(absl::InvalidArgumentError("fd: not\na memfd")))
          .status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(refused.message(), "fd: not a memfd");
  const std::string long_message(10000, 'x');
  EXPECT_LE(wire::FormatRegionReply(absl::InternalError(long_message)).size(),
            wire::kMaxRegionMessageBytes);
}

TEST(RegionSocketProtocolTest, EveryMalformedRequestIsRefusedNamingWhatIsWrong) {
  const std::string head = std::string(wire::kRegionProtocolLine) + "\n";
  const std::pair<std::string, std::string> cases[] = {
      {"", "last line"},
      {"attngrad-region-v2\nbyte_size 1\n", "first line"},
      {head, "byte_size: missing"},
      {head + "byte_size 0\n", "byte_size"},
      {head + "byte_size -5\n", "byte_size"},
      {head + "byte_size 99999999999999999999\n", "byte_size"},
      {head + "byte_size 12\nbyte_size 12\n", "byte_size: given twice"},
      {head + "byte_size 12\ntoken a b\n", "line 3"},
      {head + "byte_size 12\ntoken\n", "line 3"},
      {head + "byte_size 12\nclient_id \x01x\n", "line 3"},
      {head + "byte_size 12\nname /dev/shm/x\n", "unknown key"},
      {head + "byte_size 12\n\n", "line 3"},
      {head + "byte_size 12", "last line"},
      {head + "byte_size 12\n" + std::string(5000, 'x') + "\n", "bytes"},
  };
  for (const auto& [message, expected] : cases) {
    const absl::StatusOr<wire::RegionSocketRequest> parsed = ParseRegionRequest(message);
    ASSERT_FALSE(parsed.ok()) << message;
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument) << message;
    EXPECT_NE(parsed.status().message().find(expected), std::string::npos)
        << message << " -> " << parsed.status();
  }
  EXPECT_EQ(ParseRegionReply("garbage").status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(ParseRegionReply(head + "ok 0\n").status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(ParseRegionReply(head + "error 99 x\n").status().code(), absl::StatusCode::kDataLoss);
}

TEST(RegionSocketProtocolTest, TheDefaultPathFollowsTheTargetsPort) {
  EXPECT_EQ(wire::TargetPort("127.0.0.1:50051"), 50051);
  EXPECT_EQ(wire::TargetPort("ipv6:[::1]:7"), 7);
  EXPECT_EQ(wire::TargetPort("dns:///localhost:9000"), 9000);
  EXPECT_EQ(wire::TargetPort("unix:/run/attngrad.sock"), std::nullopt);
  EXPECT_EQ(wire::TargetPort("localhost"), std::nullopt);
  EXPECT_EQ(DefaultRegionSocketPath("localhost:50051"), wire::DefaultRegionSocketPath(50051));
  EXPECT_NE(wire::DefaultRegionSocketPath(50051).find("regions-50051.sock"), std::string::npos);
}

// A memfd the test makes with the given seals (none: unsealed), `size` bytes.
int Memfd(std::size_t size, int seals) {
  const int fd = memfd_create("attngrad-region-test", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  EXPECT_GE(fd, 0) << std::strerror(errno);
  EXPECT_EQ(ftruncate(fd, static_cast<off_t>(size)), 0);
  if (seals != 0) {
    EXPECT_EQ(fcntl(fd, F_ADD_SEALS, seals), 0) << std::strerror(errno);
  }
  return fd;
}

class RegionSocketTest : public ServerTest {
 protected:
  absl::StatusOr<std::uint64_t> RegisterFd(int fd, std::int64_t size,
                                           const std::string& client_id = "") {
    RegionCredentials credentials;
    credentials.client_id = client_id;
    return RegisterRegionDescriptor(server().region_socket_path(), fd, size, credentials);
  }
  // One raw message with `fds` attached, and the server's reply.
  absl::StatusOr<std::uint64_t> SendRaw(const std::string& message, const std::vector<int>& fds) {
    const int socket_fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    sockaddr_un address{};
    address.sun_family = AF_UNIX;
    std::strncpy(address.sun_path, server().region_socket_path().c_str(),
                 sizeof(address.sun_path) - 1);
    EXPECT_EQ(connect(socket_fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
    std::vector<char> control(CMSG_SPACE(sizeof(int) * std::max<std::size_t>(fds.size(), 1)));
    iovec vector{const_cast<char*>(message.data()), message.size()};
    msghdr header{};
    header.msg_iov = &vector;
    header.msg_iovlen = 1;
    if (!fds.empty()) {
      header.msg_control = control.data();
      header.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
      cmsghdr* rights = CMSG_FIRSTHDR(&header);
      rights->cmsg_level = SOL_SOCKET;
      rights->cmsg_type = SCM_RIGHTS;
      rights->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
      std::memcpy(CMSG_DATA(rights), fds.data(), sizeof(int) * fds.size());
    }
    EXPECT_GE(sendmsg(socket_fd, &header, MSG_NOSIGNAL), 0) << std::strerror(errno);
    char reply[wire::kMaxRegionMessageBytes];
    const ssize_t received = recv(socket_fd, reply, sizeof(reply), 0);
    close(socket_fd);
    return ParseRegionReply(absl::string_view(reply, received > 0 ? received : 0));
  }
  void ExpectRefused(const absl::StatusOr<std::uint64_t>& result, absl::StatusCode code,
                     const std::string& field) {
    ASSERT_FALSE(result.ok()) << "registered as " << *result;
    EXPECT_EQ(result.status().code(), code) << result.status();
    EXPECT_NE(result.status().message().find(field), std::string::npos) << result.status();
  }
  grpc::Status RegisterByName(const std::string& name, std::int64_t size) {
    grpc::ClientContext context;
    v1::RegisterRegionRequest request;
    request.set_name(name);
    request.set_byte_size(size);
    v1::RegisterRegionResponse response;
    return stub().RegisterRegion(&context, request, &response);
  }
};

TEST_F(RegionSocketTest, TheSocketIsTheOwnersOnly) {
  struct stat status {};
  ASSERT_EQ(stat(server().region_socket_path().c_str(), &status), 0);
  EXPECT_TRUE(S_ISSOCK(status.st_mode));
  EXPECT_EQ(status.st_mode & 0777, 0600u);
  EXPECT_EQ(status.st_uid, geteuid());
}

// Only a memfd sealed against shrinking is mapped: an unsealed memfd, one sealed otherwise, a
// POSIX shared-memory object (which cannot be sealed), a regular file, a read-only descriptor and
// a pipe are refused naming `fd`; a size beyond the memfd names `byte_size`.
TEST_F(RegionSocketTest, OnlyMemfdsSealedAgainstShrinkingAreMapped) {
  const int unsealed = Memfd(4096, 0);
  ExpectRefused(RegisterFd(unsealed, 4096), absl::StatusCode::kInvalidArgument, "F_SEAL_SHRINK");
  const int grow_only = Memfd(4096, F_SEAL_GROW | F_SEAL_SEAL);
  ExpectRefused(RegisterFd(grow_only, 4096), absl::StatusCode::kInvalidArgument, "fd:");
  const std::string name = "/attngrad-region-socket-test-" + std::to_string(getpid());
  const int shm = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  ASSERT_GE(shm, 0);
  shm_unlink(name.c_str());
  ASSERT_EQ(ftruncate(shm, 4096), 0);
  ExpectRefused(RegisterFd(shm, 4096), absl::StatusCode::kInvalidArgument, "fd:");
  const int regular = open("/proc/self/exe", O_RDONLY | O_CLOEXEC);
  ExpectRefused(RegisterFd(regular, 4096), absl::StatusCode::kInvalidArgument, "fd:");
  const int sealed = Memfd(4096, F_SEAL_SHRINK | F_SEAL_SEAL);
  const int read_only =
      open(("/proc/self/fd/" + std::to_string(sealed)).c_str(), O_RDONLY | O_CLOEXEC);
  ExpectRefused(RegisterFd(read_only, 4096), absl::StatusCode::kInvalidArgument, "fd:");
  int pipe_fds[2];
  ASSERT_EQ(pipe(pipe_fds), 0);
  ExpectRefused(RegisterFd(pipe_fds[0], 4096), absl::StatusCode::kInvalidArgument, "fd:");
  ExpectRefused(RegisterFd(sealed, 8192), absl::StatusCode::kInvalidArgument, "byte_size");
  const absl::StatusOr<std::uint64_t> region = RegisterFd(sealed, 4096);
  EXPECT_TRUE(region.ok()) << region.status();
  EXPECT_EQ(server().region_socket_path().empty(), false);
  for (int fd : {unsealed, grow_only, shm, regular, sealed, read_only, pipe_fds[0], pipe_fds[1]}) {
    close(fd);
  }
}

TEST_F(RegionSocketTest, BadMessagesAndDescriptorCountsAreRefused) {
  const int sealed = Memfd(4096, F_SEAL_SHRINK);
  wire::RegionSocketRequest request;
  request.byte_size = 4096;
  const std::string good = wire::FormatRegionRequest(request);
  ExpectRefused(SendRaw(good, {}), absl::StatusCode::kInvalidArgument, "fd: 0 descriptors");
  ExpectRefused(SendRaw(good, {sealed, sealed}), absl::StatusCode::kInvalidArgument, "fd: 2");
  ExpectRefused(SendRaw("hello\n", {sealed}), absl::StatusCode::kInvalidArgument, "first line");
  ExpectRefused(SendRaw(good + "client_id bad/id\n", {sealed}), absl::StatusCode::kInvalidArgument,
                "client");
  ExpectRefused(SendRaw(std::string(6000, 'x'), {sealed}), absl::StatusCode::kInvalidArgument,
                "request: larger");
  EXPECT_TRUE(SendRaw(good, {sealed}).ok());
  close(sealed);
}

// The region belongs to the client id the request names (authentication off): another client's
// batches cannot name it.
TEST_F(RegionSocketTest, ARegionBelongsToTheClientThatPassedIt) {
  const int sealed = Memfd(4096, F_SEAL_SHRINK);
  const absl::StatusOr<std::uint64_t> region = RegisterFd(sealed, 4096, "someone");
  ASSERT_TRUE(region.ok()) << region.status();
  grpc::ClientContext context;  // "default"
  v1::UnregisterRegionRequest request;
  request.set_region_id(*region);
  v1::UnregisterRegionResponse response;
  EXPECT_EQ(stub().UnregisterRegion(&context, request, &response).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  grpc::ClientContext owner_context;
  owner_context.AddMetadata("attngrad-client-id", "someone");
  EXPECT_TRUE(stub().UnregisterRegion(&owner_context, request, &response).ok());
  close(sealed);
}

// attngrad::Client registers a SharedMemoryRegion over the default socket of its target; a batch
// computes from and into it with the bytes path's bits; UnregisterRegion removes it.
TEST_F(RegionSocketTest, TheCppClientRegistersSharedMemoryAndBatchesComputeThroughIt) {
  absl::StatusOr<std::unique_ptr<Client>> client =
      Client::Connect("127.0.0.1:" + std::to_string(server().port()));
  ASSERT_TRUE(client.ok()) << client.status();
  const Batch batch = MakeBatch(config(), 1, 8, 31);
  const v1::BackwardRequest bytes_request =
      MakeRequest(config(), batch, 1, v1::GRADIENT_MODE_RETURN);
  const std::string& hidden = bytes_request.hidden_states().raw_data();
  const std::string& grad = bytes_request.grad_output().raw_data();
  const std::int64_t bytes = static_cast<std::int64_t>(hidden.size());
  absl::StatusOr<std::unique_ptr<SharedMemoryRegion>> memory =
      SharedMemoryRegion::Create(static_cast<std::size_t>(3 * bytes));
  ASSERT_TRUE(memory.ok()) << memory.status();
  const absl::StatusOr<std::uint64_t> region = (*client)->RegisterRegion(**memory);
  ASSERT_TRUE(region.ok()) << region.status();
  std::memcpy((*memory)->data(), hidden.data(), hidden.size());
  std::memcpy((*memory)->data() + bytes, grad.data(), grad.size());

  v1::BackwardRequest request = bytes_request;
  request.set_batch_id(2);
  request.mutable_hidden_states()->clear_raw_data();
  request.mutable_grad_output()->clear_raw_data();
  v1::RegionSlice* slices[] = {request.mutable_hidden_states_region(),
                               request.mutable_grad_output_region(),
                               request.mutable_grad_hidden_states_region()};
  for (int index = 0; index < 3; ++index) {
    slices[index]->set_region_id(*region);
    slices[index]->set_offset(index * bytes);
    slices[index]->set_byte_size(bytes);
  }
  const v1::BackwardResponse expected = RunOne(stub(), bytes_request);
  const v1::BackwardResponse response = RunOne(stub(), request);
  ASSERT_FALSE(response.has_error()) << response.error().message();
  EXPECT_EQ(std::memcmp((*memory)->data() + 2 * bytes,
                        expected.grad_hidden_states().raw_data().data(), bytes),
            0);
  EXPECT_TRUE((*client)->UnregisterRegion(*region).ok());
  EXPECT_EQ((*client)->UnregisterRegion(*region).code(), absl::StatusCode::kInvalidArgument);
}

// RegisterRegion by name is refused before anything is opened: an existing object and a missing
// one get the same code and message, so the answer does not tell whether a name exists.
TEST_F(RegionSocketTest, RegistrationByNameIsRefusedAlikeForEveryName) {
  const std::string name = "attngrad-region-socket-name-" + std::to_string(getpid());
  const int shm = shm_open(("/" + name).c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  ASSERT_GE(shm, 0);
  ASSERT_EQ(ftruncate(shm, 4096), 0);
  const grpc::Status existing = RegisterByName(name, 4096);
  const grpc::Status missing = RegisterByName(name + "-missing", 4096);
  shm_unlink(("/" + name).c_str());
  close(shm);
  EXPECT_EQ(existing.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(existing.error_code(), missing.error_code());
  EXPECT_EQ(existing.error_message(), missing.error_message());
  EXPECT_NE(existing.error_message().find("name"), std::string::npos);
}

ServerOptions SmallServerOptions() {
  ServerOptions options;
  options.listen = "127.0.0.1:0";
  options.metrics_listen = "";
  options.devices = "cpu";
  options.cpu_threads = 1;
  return options;
}

// The default socket path is a convenience: a server that cannot create it serves everything but
// shared memory (and says so); a path the operator named must work, or the server does not start.
TEST(RegionSocketStartTest, AnUnusableDefaultTurnsRegionsOffAndAnUnusablePathIsAnError) {
  const char* saved = std::getenv("XDG_RUNTIME_DIR");
  const std::string saved_value = saved == nullptr ? "" : saved;
  setenv("XDG_RUNTIME_DIR", "/proc/version", 1);  // not a directory: mkdir fails
  absl::StatusOr<std::unique_ptr<GradientServer>> server =
      GradientServer::Start(SmallServerOptions());
  if (saved == nullptr) {
    unsetenv("XDG_RUNTIME_DIR");
  } else {
    setenv("XDG_RUNTIME_DIR", saved_value.c_str(), 1);
  }
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_TRUE((*server)->region_socket_path().empty());
  bool said = false;
  for (const std::string& line : (*server)->security_summary()) {
    said = said || line.find("shared-memory regions: off") != std::string::npos;
  }
  EXPECT_TRUE(said);
  server->reset();

  ServerOptions named = SmallServerOptions();
  named.region_socket = "/proc/version/regions.sock";
  const absl::StatusOr<std::unique_ptr<GradientServer>> refused = GradientServer::Start(named);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("--region_socket"), std::string::npos)
      << refused.status();

  ServerOptions off = SmallServerOptions();
  off.region_socket = "off";
  const absl::StatusOr<std::unique_ptr<GradientServer>> without = GradientServer::Start(off);
  ASSERT_TRUE(without.ok()) << without.status();
  EXPECT_TRUE((*without)->region_socket_path().empty());
}

// A socket file left by a server that was killed is replaced; a live server's is not taken over.
TEST(RegionSocketStartTest, AStaleSocketIsReplacedAndALiveOneIsNot) {
  const std::string path = "/tmp/attngrad-region-socket-test-" + std::to_string(getpid()) + ".sock";
  {
    const int stale = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    sockaddr_un address{};
    address.sun_family = AF_UNIX;
    std::strncpy(address.sun_path, path.c_str(), sizeof(address.sun_path) - 1);
    ASSERT_EQ(bind(stale, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
    close(stale);  // the file stays, nobody answers
  }
  ServerOptions options = SmallServerOptions();
  options.region_socket = path;
  absl::StatusOr<std::unique_ptr<GradientServer>> first = GradientServer::Start(options);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ((*first)->region_socket_path(), path);
  const absl::StatusOr<std::unique_ptr<GradientServer>> second = GradientServer::Start(options);
  ASSERT_FALSE(second.ok());
  EXPECT_NE(second.status().message().find("another server answers"), std::string::npos)
      << second.status();
  first->reset();
  struct stat status {};
  EXPECT_NE(stat(path.c_str(), &status), 0) << "the socket file was left behind";
}

// With tokens, the region socket authenticates the request's token as a call's metadata: the
// region belongs to that token's client id; no token or an unknown one is UNAUTHENTICATED and
// nothing is mapped.
TEST(RegionSocketTokenTest, TheTokenDecidesWhoseRegionItIs) {
  constexpr char kTrainerToken[] = "trainer-token-0123456789abcdef";
  const std::string tokens_file = "/tmp/attngrad-region-tokens-" + std::to_string(getpid());
  std::FILE* file = std::fopen(tokens_file.c_str(), "w");
  ASSERT_NE(file, nullptr);
  std::fprintf(file, "%s trainer trainer-a\n", kTrainerToken);
  std::fclose(file);
  ServerOptions options = SmallServerOptions();
  options.tokens_file = tokens_file;
  absl::StatusOr<std::unique_ptr<GradientServer>> server = GradientServer::Start(options);
  unlink(tokens_file.c_str());
  ASSERT_TRUE(server.ok()) << server.status();
  const int sealed = Memfd(4096, F_SEAL_SHRINK);
  const std::string path = (*server)->region_socket_path();
  const absl::StatusOr<std::uint64_t> anonymous = RegisterRegionDescriptor(path, sealed, 4096, {});
  EXPECT_EQ(anonymous.status().code(), absl::StatusCode::kUnauthenticated) << anonymous.status();
  RegionCredentials unknown;
  unknown.token = "not-a-token-of-this-server-000";
  EXPECT_EQ(RegisterRegionDescriptor(path, sealed, 4096, unknown).status().code(),
            absl::StatusCode::kUnauthenticated);
  RegionCredentials trainer;
  trainer.token = kTrainerToken;
  trainer.client_id = "someone-else";  // ignored with tokens: the token names the client
  const absl::StatusOr<std::uint64_t> region =
      RegisterRegionDescriptor(path, sealed, 4096, trainer);
  ASSERT_TRUE(region.ok()) << region.status();
  close(sealed);
  auto stub = v1::AttentionGradient::NewStub(grpc::CreateChannel(
      "127.0.0.1:" + std::to_string((*server)->port()), grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.AddMetadata("authorization", std::string("Bearer ") + kTrainerToken);
  v1::UnregisterRegionRequest request;
  request.set_region_id(*region);
  v1::UnregisterRegionResponse response;
  const grpc::Status unregistered = stub->UnregisterRegion(&context, request, &response);
  EXPECT_TRUE(unregistered.ok()) << unregistered.error_message();
}

// A hostile client, against the server binary: it registers its memory, shrinks it, unlinks it
// and maps it again, then sends batches that name it. The server must answer every batch (or
// refuse the registration) and still be serving at the end. A server that maps shared-memory
// objects by name dies of SIGBUS here: the shrunk object faults at the next batch's read.
TEST(RegionHostileClientTest, ShrinkingUnlinkingAndRemappingNeverFaultTheServer) {
  if (ServerBinary().empty()) GTEST_SKIP() << "built without ATTNGRAD_SERVER_BINARY";
  ServerProcess server({"--listen=127.0.0.1:0", "--metrics_listen=", "--devices=cpu"});
  const int port = server.WaitServing(120);
  ASSERT_NE(port, 0) << server.log();
  const std::string target = "127.0.0.1:" + std::to_string(port);
  grpc::ChannelArguments arguments;
  arguments.SetMaxReceiveMessageSize(-1);  // RETURN answers carry the weight gradients
  auto stub = v1::AttentionGradient::NewStub(
      grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), arguments));
  const LayerConfig config = LayerConfig::Gemma3_4B();
  const Batch batch = MakeBatch(config, 1, 8, 3);
  const v1::BackwardRequest bytes_request = MakeRequest(config, batch, 1, v1::GRADIENT_MODE_RETURN);
  const std::size_t bytes = bytes_request.hidden_states().raw_data().size();
  auto in_region = [&](std::uint64_t region, std::uint64_t batch_id) {
    v1::BackwardRequest request = bytes_request;
    request.set_batch_id(batch_id);
    request.mutable_hidden_states()->clear_raw_data();
    request.mutable_grad_output()->clear_raw_data();
    for (auto [slice, offset] : {std::pair{request.mutable_hidden_states_region(), 0},
                                 std::pair{request.mutable_grad_output_region(), 1},
                                 std::pair{request.mutable_grad_hidden_states_region(), 2}}) {
      slice->set_region_id(region);
      slice->set_offset(static_cast<std::int64_t>(offset * bytes));
      slice->set_byte_size(static_cast<std::int64_t>(bytes));
    }
    return request;
  };
  auto fill = [&](char* memory) {
    std::memcpy(memory, bytes_request.hidden_states().raw_data().data(), bytes);
    std::memcpy(memory + bytes, bytes_request.grad_output().raw_data().data(), bytes);
  };

  // 1. A POSIX shared-memory object by name, then shrunk and unlinked.
  const std::string name = "/attngrad-hostile-" + std::to_string(getpid());
  const int shm = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  ASSERT_GE(shm, 0);
  ASSERT_EQ(ftruncate(shm, static_cast<off_t>(3 * bytes)), 0);
  char* shm_data =
      static_cast<char*>(mmap(nullptr, 3 * bytes, PROT_READ | PROT_WRITE, MAP_SHARED, shm, 0));
  ASSERT_NE(shm_data, MAP_FAILED);
  fill(shm_data);
  munmap(shm_data, 3 * bytes);
  grpc::ClientContext context;
  v1::RegisterRegionRequest by_name;
  by_name.set_name(name);
  by_name.set_byte_size(static_cast<std::int64_t>(3 * bytes));
  v1::RegisterRegionResponse registered;
  const grpc::Status name_status = stub->RegisterRegion(&context, by_name, &registered);
  ASSERT_EQ(ftruncate(shm, 0), 0);
  shm_unlink(name.c_str());
  close(shm);
  if (name_status.ok()) RunOne(*stub, in_region(registered.region_id(), 2));

  // 2. A sealed memfd: it cannot shrink; unmapped, mapped again and closed by the client.
  auto memory = SharedMemoryRegion::Create(3 * bytes);
  ASSERT_TRUE(memory.ok()) << memory.status();
  fill((*memory)->data());
  const absl::StatusOr<std::uint64_t> region =
      (*memory)->Register(DefaultRegionSocketPath(target), {});
  EXPECT_TRUE(region.ok()) << region.status();
  EXPECT_NE(ftruncate((*memory)->fd(), 0), 0);  // sealed: EPERM
  const int fd = dup((*memory)->fd());
  memory->reset();  // the client's mapping and descriptor are gone
  char* again =
      static_cast<char*>(mmap(nullptr, 3 * bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
  ASSERT_NE(again, MAP_FAILED);
  close(fd);
  const v1::BackwardResponse expected = RunOne(*stub, bytes_request);
  if (region.ok() && server.WaitExit(0) == -1) {
    const v1::BackwardResponse response = RunOne(*stub, in_region(*region, 3));
    EXPECT_FALSE(response.has_error()) << response.error().message();
    EXPECT_EQ(
        std::memcmp(again + 2 * bytes, expected.grad_hidden_states().raw_data().data(), bytes), 0);
  }
  munmap(again, 3 * bytes);

  // 3. The server is alive and serving.
  EXPECT_EQ(server.WaitExit(0.5), -1) << "the server ended: " << server.log();
  grpc::ClientContext info_context;
  v1::GetModelInfoResponse info;
  EXPECT_TRUE(stub->GetModelInfo(&info_context, v1::GetModelInfoRequest(), &info).ok());
}

}  // namespace
}  // namespace attngrad::server::testing
