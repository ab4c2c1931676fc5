#!/usr/bin/env bash
# Start a local Prefect stack for tokenize-mixer: a server on loopback (SQLite under a project-local
# PREFECT_HOME), the process work pool, a worker, and the deployments in deployments/prefect.yaml.
#   infra/local_up.sh            # then: prefect deployment run tokenize-mixer/demo --watch
#   infra/local_down.sh          # stops what this started
# Environment: PREFECT_HOME (default ./.prefect), TOKENIZE_MIXER_PORT (4200), TOKENIZE_MIXER_POOL
# (tokenize-mixer-cpu), TOKENIZE_MIXER_AUTH_STRING (default: generated once, kept in
# $PREFECT_HOME/auth-string). Run from the repository root with the project's environment on PATH.
#
# The API is protected (anyone who can call it can make the worker run anything, see infra/README.md):
# HTTP basic auth with the auth string (the UI asks for it as its password; clients send it from
# PREFECT_API_AUTH_STRING), CSRF tokens on every state-changing request, and CORS limited to the UI's
# own origin, so a web page on another origin can neither send authenticated requests nor read answers.
set -euo pipefail
cd "$(dirname "$0")/.."
export PREFECT_HOME="${PREFECT_HOME:-$PWD/.prefect}"
export TOKENIZE_MIXER_PORT="${TOKENIZE_MIXER_PORT:-4200}"
export TOKENIZE_MIXER_POOL="${TOKENIZE_MIXER_POOL:-tokenize-mixer-cpu}"
export PREFECT_API_URL="http://127.0.0.1:${TOKENIZE_MIXER_PORT}/api"
export PREFECT_SERVER_ANALYTICS_ENABLED=false
export PREFECT_WORKER_QUERY_SECONDS="${PREFECT_WORKER_QUERY_SECONDS:-5}"
mkdir -p "$PREFECT_HOME"

AUTH_FILE="$PREFECT_HOME/auth-string"
if [ -n "${TOKENIZE_MIXER_AUTH_STRING:-}" ]; then
  AUTH_STRING="$TOKENIZE_MIXER_AUTH_STRING"
  AUTH_EXPORT='export PREFECT_API_AUTH_STRING="$TOKENIZE_MIXER_AUTH_STRING"'
  AUTH_WHERE='the value of $TOKENIZE_MIXER_AUTH_STRING'
else
  if [ ! -s "$AUTH_FILE" ]; then
    (umask 077 && python3 -c 'import secrets; print("admin:" + secrets.token_urlsafe(32))' >"$AUTH_FILE.tmp")
    mv "$AUTH_FILE.tmp" "$AUTH_FILE"
  fi
  chmod 600 "$AUTH_FILE"
  AUTH_STRING="$(cat "$AUTH_FILE")"
  AUTH_EXPORT="export PREFECT_API_AUTH_STRING=\"\$(cat $AUTH_FILE)\""
  AUTH_WHERE="the contents of $AUTH_FILE"
fi
# Client side: this script's prefect commands, the worker, and the flow runs it starts (they inherit it).
export PREFECT_API_AUTH_STRING="$AUTH_STRING"
export PREFECT_CLIENT_CSRF_SUPPORT_ENABLED=true
PREFECT="${PREFECT:-prefect}"

# Server side (the server's environment only, never its command line, which `ps` shows to everyone):
# basic auth, CSRF protection, and CORS for the UI's own origin only (the UI calls the API at
# PREFECT_API_URL, http://127.0.0.1:PORT/api; http://localhost:PORT is the same loopback server).
# Logs streamed out, so that `prefect deployment run --watch` shows a run's log lines (its summary) with
# its events (Prefect's default leaves the stream off and --watch shows events only).
PREFECT_SERVER_API_AUTH_STRING="$AUTH_STRING" \
PREFECT_SERVER_CSRF_PROTECTION_ENABLED=true \
PREFECT_SERVER_LOGS_STREAM_OUT_ENABLED=true \
PREFECT_SERVER_LOGS_STREAM_PUBLISHING_ENABLED=true \
PREFECT_SERVER_API_CORS_ALLOWED_ORIGINS="http://127.0.0.1:${TOKENIZE_MIXER_PORT},http://localhost:${TOKENIZE_MIXER_PORT}" \
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
# deployments/prefect.yaml names the pool tokenize-mixer-cpu (prefect deploy --all takes no --pool): a copy
# names this stack's pool
sed "s/^    name: tokenize-mixer-cpu .*/    name: \"$TOKENIZE_MIXER_POOL\"/" deployments/prefect.yaml >"$PREFECT_HOME/prefect.yaml"
"$PREFECT" --no-prompt deploy --all --prefect-file "$PREFECT_HOME/prefect.yaml" >"$PREFECT_HOME/deploy.log" 2>&1 \
  || { cat "$PREFECT_HOME/deploy.log" >&2; exit 1; }
echo "Prefect UI: http://127.0.0.1:${TOKENIZE_MIXER_PORT}  (it asks for a password: paste the whole auth string, $AUTH_WHERE)"
echo "For the prefect CLI and tokenize-mixer in this shell:"
echo "  export PREFECT_API_URL=$PREFECT_API_URL"
echo "  $AUTH_EXPORT"
