#!/usr/bin/env bash
# Smoke test for an operator, from a checkout of this repository on an inf2 instance: a Neuron DLAMI with
# the project and its Neuron extra installed (README, "Neuron stack"), or the inf2serve image with the
# checkout mounted (the image leaves tests/ out). It runs what could not be run without Inferentia hardware:
#   1. the `neuron`-marked tests against the real Neuron library (compile, validation gate in bf16, load
#      from another directory without recompiling, continuous batching, golden replay);
#   2. compiles of the checkpoint through `inf2serve compile`: in step, with NxD Inference's async mode
#      (`--async-mode`), and with several decode batch sizes (`--decode-batches 1,2,4`);
#   3. each artifact served in turn: the same greedy prompts (parity: async and batch buckets must give
#      the in-step text), timed, with the NeuronCore metrics of /metrics;
#   4. two replicas on two core groups (`--replicas 2` over the cores given, one core each, tp=1).
# It writes one report (versions, timings, parity, a metrics sample) to send back:
#   $INF2SERVE_SMOKE_REPORT (default ./inf2-smoke-report.json).
# Usage: deploy/inf2-smoke.sh [checkpoint-dir]        (default: ../shared/models/stories260K)
# Environment: INF2SERVE_SMOKE_BACKEND (neuron-nxdi, or neuron-tnx on a Neuron 2.25 stack: no async mode,
#   one decode batch), INF2SERVE_SMOKE_CORES (the two NeuronCores of one chip, default 0-1; any
#   NEURON_RT_VISIBLE_CORES form), PORT (default 8080), PYTHON.
set -euo pipefail
cd "$(dirname "$0")/.."

python="${PYTHON:-python3}"
backend="${INF2SERVE_SMOKE_BACKEND:-neuron-nxdi}"
cores="${INF2SERVE_SMOKE_CORES:-0-1}"
port="${PORT:-8080}"
report="${INF2SERVE_SMOKE_REPORT:-$PWD/inf2-smoke-report.json}"
checkpoint="${1:-../shared/models/stories260K}"
work="$(mktemp -d)"
server=""
PROMPTS=("Once upon a time" "The little dog" "One day, Lily")

cleanup() {
    stop_server
    rm -rf "$work"
}
trap cleanup EXIT

fail() {
    echo "inf2-smoke: $*" >&2
    [ -f "$work/server.log" ] && tail -n 40 "$work/server.log" >&2
    record status "\"failed: $*\""
    write_report
    exit 1
}

# The report is built from one JSON fragment per line in $work/report.lines (key, then a JSON value).
record() { printf '%s\t%s\n' "$1" "$2" >>"$work/report.lines"; }
write_report() {
    "$python" - "$work/report.lines" "$report" <<'EOF'
import json, sys
report = {}
for line in open(sys.argv[1]):
    key, _, value = line.rstrip("\n").partition("\t")
    report[key] = json.loads(value)
json.dump(report, open(sys.argv[2], "w"), indent=2)
print(f"inf2-smoke: report written to {sys.argv[2]}")
EOF
}
now() { date +%s.%N; }
elapsed() { "$python" -c "import sys; print(round(float(sys.argv[2]) - float(sys.argv[1]), 3))" "$1" "$(now)"; }
json_string() { "$python" -c 'import json, sys; print(json.dumps(sys.stdin.read()))'; }

stop_server() {
    if [ -n "$server" ] && kill -0 "$server" 2>/dev/null; then
        kill -TERM "$server"
        wait "$server" || true
    fi
    server=""
}

start_server() {  # start_server <artifact> <serve options...>; waits for /ping (15 minutes at most)
    local artifact="$1"
    shift
    "$python" -m app serve --artifact "$artifact" --host 127.0.0.1 --port "$port" "$@" >"$work/server.log" 2>&1 &
    server=$!
    for _ in $(seq 900); do
        curl -fsS "http://127.0.0.1:$port/ping" >/dev/null 2>&1 && return 0
        kill -0 "$server" 2>/dev/null || fail "the server exited before it was ready ($*)"
        sleep 1
    done
    fail "the server was not ready after 15 minutes ($*)"
}

completions() {  # the greedy text of each prompt, one JSON string a line
    for prompt in "${PROMPTS[@]}"; do
        curl -fsS "http://127.0.0.1:$port/v1/completions" -H "content-type: application/json" \
            -d "{\"prompt\": \"$prompt\", \"max_tokens\": 48, \"temperature\": 0}" \
            | "$python" -c 'import json, sys; print(json.dumps(json.load(sys.stdin)["choices"][0]["text"]))' \
            || fail "a completion failed"
    done
}

compile_artifact() {  # compile_artifact <name> <tp> <compile options...>; prints the artifact URI
    local name="$1" tp="$2" started
    shift 2
    started="$(now)"
    "$python" -m app compile --model "$checkpoint" --output "$work/artifacts-$name" --backend "$backend" \
        --tp "$tp" --batch-size 4 --max-positions 256 --dtype bf16 "$@" | tail -n 1 \
        || fail "compiling the $name artifact failed"
    record "compile_s_$name" "$(elapsed "$started")"
}

[ -e /dev/neuron0 ] || fail "no /dev/neuron0: run this on an inf2 instance"
record backend "\"$backend\""
record cores "\"$cores\""
record neuron_ls "$( (neuron-ls 2>&1 || echo "neuron-ls not found") | json_string)"
record versions "$("$python" - <<'EOF'
import json
from importlib.metadata import PackageNotFoundError, version
from app.backends.neuron.runtime import runtime_version
names = ("inf2serve", "torch", "neuronx-cc", "torch-neuronx", "neuronx-distributed",
         "neuronx-distributed-inference", "transformers-neuronx", "transformers")
found = {}
for name in names:
    try:
        found[name] = version(name)
    except PackageNotFoundError:
        pass
found["aws-neuronx-runtime-lib"] = runtime_version()
print(json.dumps(found))
EOF
)"

echo "== 1/4 neuron-marked tests ($backend, cores $cores)"
started="$(now)"
INF2SERVE_SMOKE_BACKEND="$backend" INF2SERVE_SMOKE_CORES="$cores" \
    "$python" -m pytest -m neuron -v tests/backends/neuron || fail "the neuron-marked tests failed"
record tests_s "$(elapsed "$started")"

echo "== 2/4 compile $checkpoint for $backend: in step, async mode, decode batch buckets"
declare -A artifacts
artifacts[in_step]="$(compile_artifact in_step 2)"
if [ "$backend" = neuron-nxdi ]; then
    artifacts[async_mode]="$(compile_artifact async_mode 2 --async-mode)"
    artifacts[decode_batches]="$(compile_artifact decode_batches 2 --decode-batches 1,2,4)"
fi

echo "== 3/4 serve each artifact: parity, timings, metrics"
for mode in in_step async_mode decode_batches; do
    [ -n "${artifacts[$mode]:-}" ] || continue
    echo "-- $mode: ${artifacts[$mode]}"
    started="$(now)"
    start_server "${artifacts[$mode]}" --device "neuron:$cores"
    record "ready_s_$mode" "$(elapsed "$started")"
    started="$(now)"
    completions >"$work/texts-$mode"
    record "completions_s_$mode" "$(elapsed "$started")"
    record "texts_$mode" "$("$python" -c 'import json, sys; print(json.dumps([json.loads(l) for l in open(sys.argv[1])]))' "$work/texts-$mode")"
    if [ "$mode" != in_step ]; then
        if cmp -s "$work/texts-in_step" "$work/texts-$mode"; then record "parity_$mode" true; else
            record "parity_$mode" false
            fail "$mode generated other text than in step (greedy): see the report's texts_*"
        fi
    fi
    curl -fsS "http://127.0.0.1:$port/metrics" >"$work/metrics-$mode"
    grep -qE "^inf2serve_(neuroncore_utilization_ratio|device_memory_used_bytes)" "$work/metrics-$mode" \
        || fail "no NeuronCore metrics in /metrics ($mode)"
    record "metrics_sample_$mode" "$(grep -E '^inf2serve_' "$work/metrics-$mode" | head -n 60 | json_string)"
    stop_server
done

echo "== 4/4 two replicas on two core groups ($cores, one core each)"
replica_artifact="$(compile_artifact replicas 1)"
started="$(now)"
start_server "$replica_artifact" --device "neuron:$cores" --replicas 2
record ready_s_replicas "$(elapsed "$started")"
pids=()
for i in 1 2 3 4; do
    completions >"$work/texts-replicas-$i" &
    pids+=("$!")
done
for pid in "${pids[@]}"; do wait "$pid" || fail "a completion through the replicas failed"; done
curl -fsS "http://127.0.0.1:$port/metrics" >"$work/metrics-replicas"
for replica in 0 1; do
    grep -q "replica=\"$replica\"" "$work/metrics-replicas" || fail "/metrics has no series of replica $replica"
done
record metrics_sample_replicas "$(grep -E '^inf2serve_' "$work/metrics-replicas" | head -n 60 | json_string)"
stop_server

record status '"passed"'
write_report
echo "inf2-smoke: passed"
