#!/usr/bin/env bash
# Installs the real servers the test suite talks to, where this machine can.
# Each server's fixture skips with a reason when its binaries are missing.
set -u
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "install-test-servers: not root on Debian; server tests will be skipped" >&2
  exit 0
fi
need=()
command -v radosgw >/dev/null 2>&1 || need+=(radosgw ceph-mon ceph-osd)
command -v prometheus >/dev/null 2>&1 || need+=(prometheus)
if [ ${#need[@]} -gt 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  (apt-get update -qq || true) >/dev/null 2>&1
  apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null 2>&1 \
    || echo "install-test-servers: apt-get install ${need[*]} failed; those tests will be skipped" >&2
fi
exit 0
