#!/usr/bin/env bash
# Start a local Prefect stack for tokenize-mixer: a server on loopback (SQLite under a project-local
# PREFECT_HOME), the process work pool, a worker, and the deployments in deployments/prefect.yaml.
#   infra/local_up.sh            # then: prefect deployment run tokenize-mixer/demo --watch
#   infra/local_down.sh          # stops what this started
# Environment: PREFECT_HOME (default ./.prefect), TOKENIZE_MIXER_PORT (4200), TOKENIZE_MIXER_POOL
# (tokenize-mixer-cpu). Run from the repository root with the project's environment on PATH.
set -euo pipefail
cd "$(dirname "$0")/.."
export PREFECT_HOME="${PREFECT_HOME:-$PWD/.prefect}"
export TOKENIZE_MIXER_PORT="${TOKENIZE_MIXER_PORT:-4200}"
export TOKENIZE_MIXER_POOL="${TOKENIZE_MIXER_POOL:-tokenize-mixer-cpu}"
export PREFECT_API_URL="http://127.0.0.1:${TOKENIZE_MIXER_PORT}/api"
export PREFECT_SERVER_ANALYTICS_ENABLED=false
export PREFECT_WORKER_QUERY_SECONDS="${PREFECT_WORKER_QUERY_SECONDS:-5}"
PREFECT="${PREFECT:-prefect}"
mkdir -p "$PREFECT_HOME"

setsid "$PREFECT" server start --host 127.0.0.1 --port "$TOKENIZE_MIXER_PORT" >"$PREFECT_HOME/server.log" 2>&1 &
echo $! >"$PREFECT_HOME/server.pid"
for _ in $(seq 1 120); do
  if python3 -c "import urllib.request,sys; urllib.request.urlopen('$PREFECT_API_URL/health', timeout=1)" 2>/dev/null; then
    break
  fi
  sleep 0.5
done
python3 -c "import urllib.request; urllib.request.urlopen('$PREFECT_API_URL/health', timeout=2)" \
  || { echo "Prefect server did not start; see $PREFECT_HOME/server.log" >&2; exit 1; }

"$PREFECT" work-pool inspect "$TOKENIZE_MIXER_POOL" >/dev/null 2>&1 \
  || "$PREFECT" work-pool create "$TOKENIZE_MIXER_POOL" --type process >/dev/null
setsid "$PREFECT" worker start --pool "$TOKENIZE_MIXER_POOL" >"$PREFECT_HOME/worker.log" 2>&1 &
echo $! >"$PREFECT_HOME/worker.pid"
"$PREFECT" --no-prompt deploy --all --prefect-file deployments/prefect.yaml >"$PREFECT_HOME/deploy.log" 2>&1 \
  || { cat "$PREFECT_HOME/deploy.log" >&2; exit 1; }
echo "Prefect UI: http://127.0.0.1:${TOKENIZE_MIXER_PORT}  (export PREFECT_API_URL=$PREFECT_API_URL)"
