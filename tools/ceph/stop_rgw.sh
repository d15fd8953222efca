#!/usr/bin/env bash
# Stop the daemons started by tools/ceph/start_rgw.sh (by the PIDs in their pid files) and remove DIR.
set -u
DIR=${1:-${CEPH_TEST_DIR:?give the directory for the cluster as the first argument}}
for name in client.rgw.r osd.0 mon.a; do       # reverse start order
  f="$DIR/run/$name.pid"
  [ -f "$f" ] || continue
  pid=$(cat "$f")
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid"
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    kill -0 "$pid" 2>/dev/null && kill -KILL "$pid"
  fi
  rm -f "$f"
done
rm -rf "$DIR"
