#!/usr/bin/env bash
# Installs the real servers the test suite talks to: Ceph (mon, osd, RADOS
# Gateway: the S3 server of tests/storage, started by tools/ceph/start_rgw.sh)
# and Prometheus, from Debian's packages.
#
# - root on Debian/Ubuntu (CI, `make test`): installs what is missing and
#   FAILS (exit 1) if a server still cannot be found afterwards, so CI never
#   quietly skips the real-server tests;
# - elsewhere: prints why nothing is installed and exits 0; the fixtures then
#   skip those tests with that reason (BYTECP_REQUIRE_CEPH=1 turns the skip
#   into a failure).
#
# Env: APT_RETRIES (3), APT_LOCK_TIMEOUT seconds (300).
set -u

log() { echo "install-test-servers: $*" >&2; }

ceph_bins=(ceph-mon ceph-osd radosgw radosgw-admin ceph)
missing_bins() {
  local b
  for b in "${ceph_bins[@]}" prometheus; do command -v "$b" >/dev/null 2>&1 || echo "$b"; done
  # start_rgw.sh creates the RGW pools through librados' Python binding
  /usr/bin/python3 -c 'import rados' >/dev/null 2>&1 || echo "python3-rados"
}

missing=$(missing_bins)
if [ -z "$missing" ]; then
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  log "not root on Debian; missing: $(echo $missing); the tests needing them will be skipped"
  exit 0
fi

export DEBIAN_FRONTEND=noninteractive
retries=${APT_RETRIES:-3}
lock=(-o "DPkg::Lock::Timeout=${APT_LOCK_TIMEOUT:-300}")
pkgs=(radosgw ceph-mon ceph-osd ceph-common python3 python3-rados prometheus)

# keep package scripts from starting services (prometheus would bind :9090)
policy=/usr/sbin/policy-rc.d
own_policy=0
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod +x "$policy" && own_policy=1
fi
cleanup() { if [ "$own_policy" = 1 ]; then rm -f "$policy"; fi; }
trap cleanup EXIT

ok=0
for attempt in $(seq 1 "$retries"); do
  log "apt-get install ${pkgs[*]} (attempt $attempt/$retries)"
  if apt-get "${lock[@]}" update -qq >/tmp/bytecp-apt.log 2>&1 \
     && apt-get "${lock[@]}" install -y -qq --no-install-recommends "${pkgs[@]}" >>/tmp/bytecp-apt.log 2>&1; then
    ok=1
    break
  fi
  tail -n 15 /tmp/bytecp-apt.log >&2
  sleep $((attempt * 5))
done

missing=$(missing_bins)
if [ "$ok" != 1 ] || [ -n "$missing" ]; then
  log "FAILED: still missing: $(echo $missing) (log: /tmp/bytecp-apt.log)"
  exit 1
fi
log "installed: $(radosgw --version 2>/dev/null | head -n1); $(prometheus --version 2>&1 | head -n1)"
