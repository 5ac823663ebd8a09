// The certificates the TLS tests use, made with the openssl CLI: shared by the in-process server
// tests (tests/server) and the tests against server processes (tests/integration).
#ifndef ATTNGRAD_TESTS_COMMON_TEST_CERTIFICATES_H_
#define ATTNGRAD_TESTS_COMMON_TEST_CERTIFICATES_H_

#include <string>

namespace attngrad::testing {

// A /bin/sh script that writes into `directory` (which exists): ca.pem/ca.key and
// other-ca.pem/other-ca.key (two CAs); server.pem/server.key for localhost and 127.0.0.1 signed by
// the CA; client.pem/client.key (CN trainer-a, clientAuth) signed by the CA; renewed.pem/renewed.key
// (a server certificate signed by the other CA, for reload tests); stranger.pem/stranger.key (a
// client certificate signed by the other CA). EC P-256 keys, valid two days. Exits non-zero on the
// first failing command.
std::string TestCertificatesScript(const std::string& directory);

}  // namespace attngrad::testing

#endif  // ATTNGRAD_TESTS_COMMON_TEST_CERTIFICATES_H_
