#!/usr/bin/env bash
# Stop the worker and server started by infra/local_up.sh (same PREFECT_HOME).
set -uo pipefail
cd "$(dirname "$0")/.."
PREFECT_HOME="${PREFECT_HOME:-$PWD/.prefect}"
for name in worker server; do
  pidfile="$PREFECT_HOME/$name.pid"
  [ -f "$pidfile" ] || continue
  pid=$(cat "$pidfile")
  kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null
  for _ in $(seq 1 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
  kill -KILL -- "-$pid" 2>/dev/null || true
  rm -f "$pidfile"
done
