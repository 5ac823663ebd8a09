#include "test_certificates.h"

namespace attngrad::testing {

std::string TestCertificatesScript(const std::string& directory) {
  return "set -e; cd '" + directory + "'\n" +
         "key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out \"$1\"; }\n"
         "key ca.key; openssl req -x509 -new -key ca.key -out ca.pem -days 2 -subj "
         "/CN=attngrad-test-ca\n"
         "key other-ca.key; openssl req -x509 -new -key other-ca.key -out other-ca.pem -days 2 "
         "-subj /CN=attngrad-other-ca\n"
         "printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\\n' > server.ext\n"
         "key server.key; openssl req -new -key server.key -out server.csr -subj /CN=localhost\n"
         "openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out server.pem "
         "-days 2 -extfile server.ext\n"
         "printf 'extendedKeyUsage=clientAuth\\n' > client.ext\n"
         "key client.key; openssl req -new -key client.key -out client.csr -subj /CN=trainer-a\n"
         "openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out client.pem "
         "-days 2 -extfile client.ext\n"
         "key renewed.key; openssl req -new -key renewed.key -out renewed.csr -subj /CN=localhost\n"
         "openssl x509 -req -in renewed.csr -CA other-ca.pem -CAkey other-ca.key -CAcreateserial "
         "-out renewed.pem -days 2 -extfile server.ext\n"
         "key stranger.key; openssl req -new -key stranger.key -out stranger.csr -subj "
         "/CN=stranger\n"
         "openssl x509 -req -in stranger.csr -CA other-ca.pem -CAkey other-ca.key -CAcreateserial "
         "-out stranger.pem -days 2 -extfile client.ext\n";
}

}  // namespace attngrad::testing
