#!/usr/bin/env bash
# Makes the TLS material of a ddprpc job with Debian's openssl: a CA (once)
# and a certificate + key per host, valid for the host's names and addresses
# (gRPC checks the address a worker dials against them).
#
#   tools/make_certs.sh DIR host1 [host2 ...]     # a host: a name or an IPv4 address
#
# gives DIR/ca.pem, DIR/ca.key (keep it off the hosts) and, for each host,
# DIR/<host>.pem and DIR/<host>.key. On each host set
#   DDPRPC_TLS_CA=ca.pem DDPRPC_TLS_CERT=<host>.pem DDPRPC_TLS_KEY=<host>.key
# (every process of the job needs a certificate: TLS is mutual). Add
# 127.0.0.1 to a host's names to run several ranks of it on loopback.
set -euo pipefail
[ $# -ge 2 ] || { sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
dir=$1
shift
mkdir -p "$dir"
umask 077
if [ ! -f "$dir/ca.pem" ]; then
  openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj "/CN=ddprpc job CA" \
    -keyout "$dir/ca.key" -out "$dir/ca.pem" 2>/dev/null
fi
for host in "$@"; do
  san="DNS:localhost,IP:127.0.0.1"
  if [ "$host" = 127.0.0.1 ] || [ "$host" = localhost ]; then :
  elif [[ $host =~ ^[0-9]+(\.[0-9]+){3}$ ]]; then san="$san,IP:$host"
  else san="$san,DNS:$host"; fi
  openssl req -newkey rsa:2048 -nodes -subj "/CN=$host" \
    -keyout "$dir/$host.key" -out "$dir/$host.csr" 2>/dev/null
  openssl x509 -req -in "$dir/$host.csr" -CA "$dir/ca.pem" -CAkey "$dir/ca.key" -CAcreateserial \
    -days 3650 -out "$dir/$host.pem" \
    -extfile <(printf "subjectAltName=%s\nextendedKeyUsage=serverAuth,clientAuth\n" "$san") 2>/dev/null
  rm -f "$dir/$host.csr"
  echo "$dir/$host.pem, $dir/$host.key ($san)"
done
