#!/bin/bash
# make-dev-certificates: a throw-away CA, a server certificate and a client certificate for trying
# TLS and mutual TLS locally (compose.secure.yaml), plus a tokens file with one trainer and one
# admin token. Not for production: the CA key sits next to the certificates, unencrypted.
#
#   deploy/tls/make-dev-certificates.sh [OUTPUT_DIR [SERVER_NAME...]]
#
# OUTPUT_DIR defaults to deploy/secrets (ignored by git); server names default to localhost,
# attngrad and 127.0.0.1. Writes ca.crt, tls.crt/tls.key (server; usable as a client certificate
# too, which the health checks do), client.crt/client.key, tokens.txt, trainer.token, admin.token.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${1:-$here/../secrets}"
shift || true
names=("$@")
[[ ${#names[@]} -eq 0 ]] && names=(localhost attngrad 127.0.0.1)
mkdir -p "$out"
cd "$out"
umask 077
san=""
for name in "${names[@]}"; do
  if [[ "$name" =~ ^[0-9.]+$ ]]; then san+="IP:$name,"; else san+="DNS:$name,"; fi
done
key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1"; }
key ca.key
openssl req -x509 -new -key ca.key -out ca.crt -days 365 -subj /CN=attngrad-dev-ca
printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth,clientAuth\n' "${san%,}" > server.ext
key tls.key
openssl req -new -key tls.key -out tls.csr -subj "/CN=${names[0]}"
openssl x509 -req -in tls.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out tls.crt -days 365 \
  -extfile server.ext
printf 'extendedKeyUsage=clientAuth\n' > client.ext
key client.key
openssl req -new -key client.key -out client.csr -subj /CN=attngrad-dev-client
openssl x509 -req -in client.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out client.crt \
  -days 365 -extfile client.ext
rm -f ./*.csr ./*.ext ca.srl
trainer="$(openssl rand -hex 24)"
admin="$(openssl rand -hex 24)"
printf '# token role [client_id]\n%s trainer trainer-1\n%s admin ops\n' "$trainer" "$admin" > tokens.txt
printf '%s\n' "$trainer" > trainer.token
printf '%s\n' "$admin" > admin.token
# The server runs as uid 10001 in the image: let it read what compose mounts.
chmod 0644 ca.crt tls.crt client.crt
chmod 0644 tls.key tokens.txt
echo "make-dev-certificates: wrote $(pwd): ca.crt tls.crt tls.key client.crt client.key tokens.txt trainer.token admin.token"
