#!/usr/bin/env bash
# Sets up, starts `shardline serve` on the default model, streams one answer, and keeps serving
# until Ctrl-C. Usage: ./run.sh ["your question"] [extra serve flags...]
set -euo pipefail
cd "$(dirname "$0")"
./setup.sh
QUESTION=${1:-"Why is the sky blue? Answer in two sentences."}
shift || true
.venv/bin/shardline serve "$@" &
SERVER=$!
trap 'kill -TERM $SERVER 2>/dev/null; wait $SERVER' INT TERM EXIT
.venv/bin/shardline generate --wait 120 "$QUESTION"
echo "serving gRPC on ${SHARDLINE_HOST:-127.0.0.1}:${SHARDLINE_PORT:-50051} and the OpenAI API on http://${SHARDLINE_HOST:-127.0.0.1}:${SHARDLINE_HTTP_PORT:-8000}/v1"
echo "try: .venv/bin/shardline generate \"Hello\"  or  curl http://${SHARDLINE_HOST:-127.0.0.1}:${SHARDLINE_HTTP_PORT:-8000}/v1/models  (Ctrl-C stops)"
wait $SERVER
