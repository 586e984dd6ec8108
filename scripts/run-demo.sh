#!/usr/bin/env bash
# The README's run command: a real 1:2:1 qwen3-omni topology (the real Qwen3-Omni-MoE
# architecture from transformers on the tiny random-weight folder tiny-qwen3-omni) on this machine (embedded Redis,
# omni-cp, four stage pods and an API server), one speech request written to output.wav, the
# control plane's view of the pools, then a clean stop. Nothing is left running.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin
PORT=${PORT:-8000}
REPLICAS=${REPLICAS:-1:2:1}
PIPELINE=${PIPELINE:-qwen3-omni}
LOG=$(mktemp -t omni-up.XXXXXX.log)

"$BIN/omni-up" --pipeline "$PIPELINE" --replicas "$REPLICAS" --port "$PORT" >"$LOG" 2>&1 &
UP=$!
cleanup() {
  kill -TERM "$UP" 2>/dev/null || true
  wait "$UP" 2>/dev/null || true
  rm -f "$LOG"
}
trap cleanup EXIT INT TERM

for _ in $(seq 1 600); do
  grep -q "omni-up ready" "$LOG" && break
  if ! kill -0 "$UP" 2>/dev/null; then cat "$LOG"; echo "omni-up exited early" >&2; exit 1; fi
  sleep 0.2
done
grep -q "omni-up ready" "$LOG" || { cat "$LOG"; echo "omni-up not ready after 120 s" >&2; exit 1; }
cat "$LOG"

CP=$(grep -Eo 'control plane +http://[0-9.:]+' "$LOG" | head -n1 | awk '{print $3}' || true)
echo
echo "== POST /v1/audio/speech ($PIPELINE, replicas $REPLICAS)"
time curl -sS --fail-with-body -o output.wav \
  -H 'Content-Type: application/json' \
  -d '{"model": "'"$PIPELINE"'", "input": "Hello from omni-mesh, a fabric for multi-stage pipelines.", "seed": 7}' \
  "http://127.0.0.1:$PORT/v1/audio/speech"
"$BIN/python" - <<'PY'
import os, wave
with wave.open("output.wav") as w:  # not asked to stream: a whole WAV, its lengths true
    channels, rate, frames = w.getnchannels(), w.getframerate(), w.getnframes()
assert frames * w.getsampwidth() * channels + 44 == os.path.getsize("output.wav")
print(f"output.wav: {channels} channel(s), {rate} Hz, {frames / rate:.2f} s")
PY
echo
if [ -n "$CP" ]; then "$BIN/omni-cp" status --cp "$CP"; fi
