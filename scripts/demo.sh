#!/usr/bin/env bash
# The main job: set up, start all three services with the default models (target
# SmolLM2-135M-Instruct, with the draft head trained for it), stream one completion on its
# own lines, stop the services. The services' logs go to a file the script names.
#   ./scripts/demo.sh ["your prompt"]
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
. .venv/bin/activate
PORT="${SPECDEC_PORT:-50051}"
PROMPT="${1:-Summarise in one sentence: Speculative decoding lets a small draft propose several tokens that a large target model verifies in a single forward pass, so the output is exactly what the target alone would write, only faster.}"
LOG="${SPECDEC_DEMO_LOG:-$PWD/specdec-demo.log}"
echo "services' logs: $LOG" >&2
specdec up --port "$PORT" >"$LOG" 2>&1 &
UP_PID=$!
trap 'kill -TERM $UP_PID 2>/dev/null; wait $UP_PID 2>/dev/null || true' EXIT
specdec generate --addr "127.0.0.1:$PORT" --wait-ready 600 --max-new-tokens 96 "$PROMPT"
