#!/usr/bin/env bash
# Smoke test for an operator, from a checkout of this repository on an inf2 instance: a Neuron DLAMI with
# the project and its Neuron extra installed (README, "Neuron stack"), or the inf2serve image with the
# checkout mounted (the image leaves tests/ out). It runs what could not be run without Inferentia hardware:
#   1. the `neuron`-marked tests against the real Neuron library (compile, validation gate in bf16, load
#      from another directory without recompiling, continuous batching, golden replay);
#   2. a compile of the checkpoint through `inf2serve compile`;
#   3. a served completion and the NeuronCore metrics of /metrics.
# Usage: deploy/inf2-smoke.sh [checkpoint-dir]        (default: ../shared/models/stories260K)
# Environment: INF2SERVE_SMOKE_BACKEND (neuron-nxdi, or neuron-tnx on a Neuron 2.25 stack),
#   INF2SERVE_SMOKE_CORES (the two NeuronCores of one chip, default 0-1), PORT (default 8080), PYTHON.
set -euo pipefail
cd "$(dirname "$0")/.."

python="${PYTHON:-python3}"
backend="${INF2SERVE_SMOKE_BACKEND:-neuron-nxdi}"
cores="${INF2SERVE_SMOKE_CORES:-0-1}"
port="${PORT:-8080}"
checkpoint="${1:-../shared/models/stories260K}"
work="$(mktemp -d)"
server=""

cleanup() {
    if [ -n "$server" ] && kill -0 "$server" 2>/dev/null; then
        kill -TERM "$server"
        wait "$server" || true
    fi
    rm -rf "$work"
}
trap cleanup EXIT

fail() {
    echo "inf2-smoke: $*" >&2
    [ -f "$work/server.log" ] && tail -n 40 "$work/server.log" >&2
    exit 1
}

[ -e /dev/neuron0 ] || fail "no /dev/neuron0: run this on an inf2 instance"
if command -v neuron-ls >/dev/null; then neuron-ls; fi

echo "== 1/3 neuron-marked tests ($backend, cores $cores)"
INF2SERVE_SMOKE_BACKEND="$backend" INF2SERVE_SMOKE_CORES="$cores" \
    "$python" -m pytest -m neuron -v tests/backends/neuron

echo "== 2/3 compile $checkpoint for $backend"
artifact="$("$python" -m app compile --model "$checkpoint" --output "$work/artifacts" --backend "$backend" \
    --tp 2 --batch-size 4 --max-positions 256 --dtype bf16 | tail -n 1)"
echo "artifact: $artifact"

echo "== 3/3 serve one completion"
"$python" -m app serve --artifact "$artifact" --device "neuron:$cores" --host 127.0.0.1 --port "$port" \
    >"$work/server.log" 2>&1 &
server=$!
for _ in $(seq 900); do
    curl -fsS "http://127.0.0.1:$port/ping" >/dev/null 2>&1 && break
    kill -0 "$server" 2>/dev/null || fail "the server exited before it was ready"
    sleep 1
done
curl -fsS "http://127.0.0.1:$port/ping" >/dev/null || fail "the server was not ready after 15 minutes"
curl -fsS "http://127.0.0.1:$port/v1/completions" -H "content-type: application/json" \
    -d '{"prompt": "Once upon a time", "max_tokens": 32, "temperature": 0}' || fail "the completion failed"
echo
curl -fsS "http://127.0.0.1:$port/metrics" | grep -E "^inf2serve_(neuroncore_utilization_ratio|device_memory_used_bytes)" \
    || fail "no NeuronCore metrics in /metrics"
echo "inf2-smoke: passed"
