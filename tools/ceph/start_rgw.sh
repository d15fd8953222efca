#!/usr/bin/env bash
# Bring up a throw-away one-node Ceph cluster (1 mon, 1 osd, no mgr) plus a
# RADOS Gateway (beast frontend on 127.0.0.1) without systemd: the real S3
# server the storage tests and benchmarks/s3_bench.py run against.
#
# Needs (Debian 12): apt-get install -y --no-install-recommends radosgw ceph-mon ceph-osd
#   (tools/install-test-servers.sh does that as root; `make test` runs it)
# Usage: tools/ceph/start_rgw.sh DIR   (env: RGW_PORT, MON_PORT, OSD_STORE=memstore|bluestore,
#                                        MEMSTORE_BYTES, S3_ACCESS_KEY, S3_SECRET_KEY,
#                                        RGW_TCP_NODELAY=0|1)
# Prints the S3 endpoint/keys as shell assignments on stdout when ready;
# tools/ceph/stop_rgw.sh DIR stops the daemons by their pid files.
#
# Traps this script avoids:
# - radosgw defaults to ms_mon_client_mode=secure, impossible with auth=none:
#   without `ms mon client mode = crc` it hangs for 5 minutes;
# - RGW creates its pools lazily (~1 s each) and the mon commits map changes
#   once a second by default: pools are created up front, paxos is shortened;
# - bluestore keeps deleted data for hours (RGW garbage collection): after
#   many GiB of writes+deletes the OSD hits ENOSPC and uploads hang. Run
#   `radosgw-admin gc process --include-all` after large deletes.
# - beast leaves Nagle's algorithm on (its tcp_nodelay=0): a small GET's reply
#   then often waits for the client's delayed ACK, ~40 ms on loopback
#   instead of ~3 ms (RGW_TCP_NODELAY=1 turns it off; the default keeps
#   beast's own default).
set -euo pipefail

DIR=${1:-${CEPH_TEST_DIR:?give the directory for the cluster as the first argument}}
RGW_PORT=${RGW_PORT:-7480}
MON_PORT=${MON_PORT:-3300}          # msgr2 only; v1 not bound
OSD_STORE=${OSD_STORE:-memstore}     # memstore: data in RAM; bluestore: sparse file
ACCESS_KEY=${S3_ACCESS_KEY:-testaccesskey0000000}
SECRET_KEY=${S3_SECRET_KEY:-testsecretkey000000000000000000000000000}
RGW_TCP_NODELAY=${RGW_TCP_NODELAY:-0}
HOST=127.0.0.1

log() { echo "[ceph-rgw $(date +%T)] $*" >&2; }
on_fail() {   # kill whatever was started (by pid file), keep $DIR/log for debugging
  log "FAILED; logs in $DIR/log"; tail -n 20 "$DIR"/log/*.log >&2 || true
  for f in "$DIR"/run/*.pid; do [ -f "$f" ] && kill "$(cat "$f")" 2>/dev/null; rm -f "$f"; done
}
trap on_fail ERR

if [ -e "$DIR/run" ] && ls "$DIR"/run/*.pid >/dev/null 2>&1; then
  echo "pid files exist in $DIR/run; run stop_ceph_rgw.sh $DIR first" >&2; exit 1
fi
port_busy() { (exec 3<>"/dev/tcp/$HOST/$1") 2>/dev/null; }
for p in "$MON_PORT" "$RGW_PORT"; do
  if port_busy "$p"; then echo "port $HOST:$p already in use" >&2; exit 1; fi
done
rm -rf "$DIR"
mkdir -p "$DIR"/{log,run,mon,osd,rgw}

cat > "$DIR/ceph.conf" <<EOF
[global]
fsid = $(cat /proc/sys/kernel/random/uuid)
mon host = v2:$HOST:$MON_PORT
public addr = $HOST
run dir = $DIR/run
pid file = $DIR/run/\$name.pid
admin socket = $DIR/run/\$name.asok
log file = $DIR/log/\$name.log
auth cluster required = none
auth service required = none
auth client required = none
ms bind msgr1 = false
osd crush chooseleaf type = 0
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd pool default pg autoscale mode = off
mon allow pool size one = true
mon allow pool delete = true
mon warn on pool no redundancy = false
mon max pg per osd = 1000
mon data avail warn = 1
mon data avail crit = 0
osd max object name len = 460
osd max object namespace len = 64

[mon.a]
mon data = $DIR/mon
# bind the mon on MON_PORT (public addr in [global] alone makes it take 3300)
public addr = v2:$HOST:$MON_PORT
# commit map changes (pool creation etc.) faster than the 1 s default
paxos propose interval = 0.05
paxos min wait = 0.01

[osd.0]
osd data = $DIR/osd
osd objectstore = $OSD_STORE
memstore device bytes = ${MEMSTORE_BYTES:-4294967296}
bluestore block create = true
bluestore block size = 10737418240
bluestore fsck on mount = false
osd memory target = 939524096
bluestore cache autotune = false
bluestore cache size = 134217728
osd class load list = *
osd class default list = *

[client.rgw.r]
# radosgw defaults to ms_mon_client_mode=secure, impossible with auth=none
ms mon client mode = crc
rgw frontends = beast endpoint=$HOST:$RGW_PORT tcp_nodelay=$RGW_TCP_NODELAY
rgw dns name = localhost
rgw enable usage log = false
rgw init timeout = 120
EOF
export CEPH_CONF="$DIR/ceph.conf"

t0=$(date +%s%N)
log "mon mkfs + start"
ceph-mon --id a --mkfs --keyring /dev/null >/dev/null
ceph-mon --id a
for _ in $(seq 1 120); do ceph --connect-timeout 2 mon stat >/dev/null 2>&1 && break; sleep 0.5; done
ceph --connect-timeout 5 mon stat >/dev/null

log "osd create + mkfs ($OSD_STORE) + start"
OSD_UUID=$(cat /proc/sys/kernel/random/uuid)
OSD_ID=$(ceph osd new "$OSD_UUID")
ceph osd crush add "osd.$OSD_ID" 1 root=default host=localhost >/dev/null 2>&1
ceph-osd --id "$OSD_ID" --mkfs --osd-uuid "$OSD_UUID" >>"$DIR/log/mkfs.log" 2>&1
ceph-osd --id "$OSD_ID" 2>>"$DIR/log/mkfs.log"
for _ in $(seq 1 120); do
  ceph osd dump 2>/dev/null | grep -q "^osd.$OSD_ID up" && break; sleep 0.5
done
ceph osd dump | grep -q "^osd.$OSD_ID up" || { log "osd did not come up"; false; }

log "rgw pools + user + start"
# create all RGW pools up front (RGW would otherwise create them lazily on
# first bucket create / first PUT / first multipart upload, ~1 s each)
# (one librados session instead of 14 `ceph` CLI runs, ~0.5 s each)
/usr/bin/python3 - "$CEPH_CONF" <<'PY'
import json, sys, rados
c = rados.Rados(conffile=sys.argv[1]); c.connect(timeout=30)
for pool in (".rgw.root", "default.rgw.log", "default.rgw.control", "default.rgw.meta",
             "default.rgw.buckets.index", "default.rgw.buckets.data", "default.rgw.buckets.non-ec"):
    for cmd in ({"prefix": "osd pool create", "pool": pool, "pg_num": 8, "pgp_num": 8},
                {"prefix": "osd pool application enable", "pool": pool, "app": "rgw"}):
        ret, _, err = c.mon_command(json.dumps(cmd), b"")
        if ret != 0:
            sys.exit(f"{cmd}: {ret} {err}")
c.shutdown()
PY
radosgw-admin user create --uid=tester --display-name="S3 tester" \
  --access-key="$ACCESS_KEY" --secret-key="$SECRET_KEY" >/dev/null
radosgw -n client.rgw.r
# wait for an HTTP answer (no curl on minimal images)
/usr/bin/python3 - "http://$HOST:$RGW_PORT/" <<'PY' || { log "rgw did not answer"; false; }
import sys, time, urllib.error, urllib.request
deadline = time.monotonic() + 120
while True:
    try:
        urllib.request.urlopen(sys.argv[1], timeout=2).read()
        break
    except urllib.error.HTTPError:
        break  # any HTTP status means the gateway is serving
    except OSError:
        if time.monotonic() > deadline:
            sys.exit(1)
        time.sleep(0.2)
PY
log "ready in $(( ($(date +%s%N) - t0) / 1000000 )) ms"

cat <<EOF
export CEPH_CONF=$DIR/ceph.conf
export S3_ENDPOINT_URL=http://$HOST:$RGW_PORT
export AWS_ACCESS_KEY_ID=$ACCESS_KEY
export AWS_SECRET_ACCESS_KEY=$SECRET_KEY
EOF
