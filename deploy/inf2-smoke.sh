#!/usr/bin/env bash
# Smoke test for an operator, from a checkout of this repository on an inf2 instance: a Neuron DLAMI with
# the project and its Neuron extra installed (README, "Neuron stack"), or the inf2serve image with the
# checkout mounted (the image leaves tests/ out). It runs what could not be run without Inferentia hardware:
#   1. the `neuron`-marked tests against the real Neuron library (compile, validation gate in bf16, load
#      from another directory without recompiling, continuous batching, golden replay);
#   2. compiles of the checkpoint through `inf2serve compile`: in step, with NxD Inference's async mode
#      (`--async-mode`), and with several decode batch sizes (`--decode-batches 1,2,4`);
#   3. each artifact served in turn: the same greedy prompts with their top logprobs (parity with in step:
#      the same tokens, or a first difference at a bf16 near tie, and logprobs within the bf16 tolerance,
#      as different graphs may round differently), timed, with the NeuronCore metrics of /metrics once
#      neuron-monitor has written its first report, and the server's exit status after SIGTERM;
#   4. two replicas on two core groups (`--replicas 2` over the cores given, one core each, tp=1).
# Every step is recorded and the run goes on to the next one whatever its outcome; the report (versions,
# each step's result, timings, parity, a metrics sample) is always written, to send back:
#   $INF2SERVE_SMOKE_REPORT (default ./inf2-smoke-report.json). The exit status is 1 when any step failed.
# Usage: deploy/inf2-smoke.sh [--dry-run] CHECKPOINT   (a Llama checkpoint directory or hub id: required)
#        deploy/inf2-smoke.sh --compare REFERENCE.json CANDIDATE.json   (the parity rule on saved outputs)
#   --dry-run: the same steps without Inferentia: the tests are only collected, and the portable backend
#   on the CPU stands in for every Neuron artifact (so the modes do not differ); checks the script itself.
# Environment: INF2SERVE_SMOKE_BACKEND (neuron-nxdi, or neuron-tnx on a Neuron 2.25 stack: no async mode,
#   one decode batch), INF2SERVE_SMOKE_CORES (the two NeuronCores of one chip, default 0-1; any
#   NEURON_RT_VISIBLE_CORES form), INF2SERVE_SMOKE_METRICS_WAIT_S (how long to wait for the first
#   neuron-monitor report, default 60: twelve of its 5 s periods), PORT (default 8080), PYTHON.
set -uo pipefail
cd "$(dirname "$0")/.."

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }

python="${PYTHON:-python3}"
backend="${INF2SERVE_SMOKE_BACKEND:-neuron-nxdi}"
cores="${INF2SERVE_SMOKE_CORES:-0-1}"
metrics_wait_s="${INF2SERVE_SMOKE_METRICS_WAIT_S:-60}"
port="${PORT:-8080}"
report="${INF2SERVE_SMOKE_REPORT:-$PWD/inf2-smoke-report.json}"
PROMPTS=("Once upon a time" "The little dog" "One day, Lily")
BF16_TOLERANCE=0.5 # app/artifacts/golden.py LOGPROB_TOLERANCE["bf16"]

# compare_outputs <reference.json> <candidate.json>: each a list of completion `logprobs` objects, one
# per prompt. Prints the verdict as JSON; fails when a prompt's tokens differ other than at a near tie of
# the reference (its margin to the candidate's token within the tolerance) or a logprob of the agreeing
# tokens differs by more than the tolerance.
compare_outputs() {
    "$python" - "$1" "$2" "$BF16_TOLERANCE" <<'EOF'
import json, sys
reference, candidate = (json.load(open(path)) for path in sys.argv[1:3])
tolerance = float(sys.argv[3])
prompts, passed = [], len(reference) == len(candidate)
for ref, got in zip(reference, candidate):
    n = min(len(ref["tokens"]), len(got["tokens"]))
    agree = next((i for i in range(n) if ref["tokens"][i] != got["tokens"][i]), n)
    diffs = [abs(a - b) for a, b in zip(ref["token_logprobs"][:agree], got["token_logprobs"][:agree])]
    verdict = {"agreeing_tokens": agree, "tokens": len(ref["tokens"]), "max_logprob_diff": max(diffs, default=0.0)}
    ok = verdict["max_logprob_diff"] <= tolerance
    if agree < max(len(ref["tokens"]), len(got["tokens"])):
        tops = ref["top_logprobs"][agree] if agree < len(ref["top_logprobs"]) else None
        theirs = got["tokens"][agree] if agree < len(got["tokens"]) else None
        margin = ref["token_logprobs"][agree] - tops[theirs] if tops and theirs in tops else float("inf")
        verdict["first_difference_margin"] = margin
        ok = ok and margin <= tolerance
    verdict["passed"] = ok
    passed = passed and ok
    prompts.append(verdict)
print(json.dumps({"passed": passed, "tolerance": tolerance, "prompts": prompts}))
sys.exit(0 if passed else 1)
EOF
}

dry_run=false
case "${1:-}" in
-h | --help)
    usage
    exit 0
    ;;
--compare)
    [ $# -eq 3 ] || { usage >&2; exit 2; }
    compare_outputs "$2" "$3"
    exit
    ;;
--dry-run)
    dry_run=true
    shift
    ;;
esac
checkpoint="${1:?a checkpoint is required: deploy/inf2-smoke.sh [--dry-run] CHECKPOINT (a Llama directory or hub id)}"
work="$(mktemp -d)"
server=""
failures=0

# The report is built from one JSON fragment per line in $work/report.lines (key, then a JSON value); a
# key `step:<name>` goes under "steps".
record() { printf '%s\t%s\n' "$1" "$2" >>"$work/report.lines"; }
write_report() {
    local status="passed"
    [ "$failures" -eq 0 ] || status="failed: $failures step(s)"
    record status "\"$status\""
    "$python" - "$work/report.lines" "$report" <<'EOF'
import json, sys
report = {"steps": {}}
for line in open(sys.argv[1]):
    key, _, value = line.rstrip("\n").partition("\t")
    step = key.removeprefix("step:")
    (report["steps"] if step != key else report)[step] = json.loads(value)
json.dump(report, open(sys.argv[2], "w"), indent=2)
print(f"inf2-smoke: report written to {sys.argv[2]} ({report['status']})")
EOF
}
finish() {
    stop_server
    write_report
    rm -rf "$work"
}
trap finish EXIT

# step <name> <command...>: runs the command (a function that sets $reason when it fails), records
# "passed" or "failed: <reason>" and goes on.
step() {
    local name="$1"
    shift
    reason="exit status nonzero"
    echo "-- $name"
    if "$@"; then
        record "step:$name" '"passed"'
    else
        failures=$((failures + 1))
        echo "inf2-smoke: $name failed: $reason" >&2
        record "step:$name" "$(printf 'failed: %s' "$reason" | json_string)"
    fi
}
skip() { record "step:$1" "$(printf 'skipped: %s' "$2" | json_string)"; }

now() { date +%s.%N; }
elapsed() { "$python" -c "import sys; print(round(float(sys.argv[2]) - float(sys.argv[1]), 3))" "$1" "$(now)"; }
json_string() { "$python" -c 'import json, sys; print(json.dumps(sys.stdin.read()))'; }

stop_server() {  # SIGTERM, then the server's exit status in $server_status (0: a clean drain and shutdown)
    server_status=0
    if [ -n "$server" ]; then
        kill -TERM "$server" 2>/dev/null
        wait "$server"
        server_status=$?
        server=""
    fi
}

start_server() {  # start_server <name> <artifact> <serve options...>; waits for /ping (15 minutes at most)
    local name="$1" artifact="$2" started status
    shift 2
    started="$(now)"
    "$python" -m app serve --artifact "$artifact" --host 127.0.0.1 --port "$port" "$@" >"$work/server-$name.log" 2>&1 &
    server=$!
    for _ in $(seq 900); do
        if curl -fsS "http://127.0.0.1:$port/ping" >/dev/null 2>&1; then
            record "ready_s_$name" "$(elapsed "$started")"
            return 0
        fi
        if ! kill -0 "$server" 2>/dev/null; then
            wait "$server"
            status=$?
            server=""
            reason="the server exited with status $status before it was ready: $(tail -n 5 "$work/server-$name.log")"
            return 1
        fi
        sleep 1
    done
    reason="the server was not ready after 15 minutes"
    return 1
}

serve_stop() {  # the server's exit status after SIGTERM must be 0
    stop_server
    record "server_exit_status_$1" "$server_status"
    [ "$server_status" -eq 0 ] || { reason="the server exited with status $server_status on SIGTERM"; return 1; }
}

completions() {  # completions <file>: each prompt's greedy completion `logprobs` (tokens, top 5), as a JSON list
    local out="$1" prompt
    : >"$out.lines"
    for prompt in "${PROMPTS[@]}"; do
        curl -fsS "http://127.0.0.1:$port/v1/completions" -H "content-type: application/json" \
            -d "{\"prompt\": \"$prompt\", \"max_tokens\": 48, \"temperature\": 0, \"logprobs\": 5}" \
            | "$python" -c 'import json, sys; print(json.dumps(json.load(sys.stdin)["choices"][0]["logprobs"]))' \
            >>"$out.lines" || { reason="a completion failed"; return 1; }
    done
    "$python" -c 'import json, sys; print(json.dumps([json.loads(l) for l in open(sys.argv[1])]))' "$out.lines" >"$out"
}

neuron_metrics() {  # polls /metrics until the NeuronCore series are there (see the header)
    local name="$1" want='^inf2serve_(neuroncore_utilization_ratio|device_memory_used_bytes)' started
    if ! "$dry_run" && command -v neuron-monitor >/dev/null; then
        want='^inf2serve_neuroncore_utilization_ratio\{.*source="neuron-monitor"'
    fi
    started="$(now)"
    for _ in $(seq "$metrics_wait_s"); do
        curl -fsS "http://127.0.0.1:$port/metrics" >"$work/metrics-$name" 2>/dev/null
        if grep -qE "$want" "$work/metrics-$name"; then
            record "metrics_wait_s_$name" "$(elapsed "$started")"
            record "metrics_sample_$name" "$(grep -E '^inf2serve_' "$work/metrics-$name" | head -n 60 | json_string)"
            return 0
        fi
        sleep 1
    done
    reason="no NeuronCore series in /metrics after ${metrics_wait_s} s (want $want)"
    return 1
}

run_tests() {
    local flags=(-m neuron -v)
    "$dry_run" && flags=(-m neuron --collect-only -q)
    INF2SERVE_SMOKE_BACKEND="$backend" INF2SERVE_SMOKE_CORES="$cores" \
        "$python" -m pytest "${flags[@]}" tests/backends/neuron >"$work/tests.log" 2>&1
    local status=$?
    record tests_summary "$(tail -n 1 "$work/tests.log" | json_string)"
    [ "$status" -eq 0 ] || { reason="pytest exited with status $status: $(tail -n 1 "$work/tests.log")"; return 1; }
}

compile_artifact() {  # compile_artifact <name> <tp> <compile options...>; the URI goes to $work/artifact-<name>
    local name="$1" tp="$2" started compile_backend="$backend"
    shift 2
    if "$dry_run"; then
        compile_backend=torch
        set --
    fi
    started="$(now)"
    "$python" -m app compile --model "$checkpoint" --output "$work/artifacts-$name" --backend "$compile_backend" \
        --tp "$tp" --batch-size 4 --max-positions 256 --dtype bf16 "$@" \
        >"$work/compile-$name.out" 2>"$work/compile-$name.log" \
        || { reason="inf2serve compile failed: $(tail -n 3 "$work/compile-$name.log")"; return 1; }
    tail -n 1 "$work/compile-$name.out" >"$work/artifact-$name"
    record "compile_s_$name" "$(elapsed "$started")"
}

device() { if "$dry_run"; then echo cpu; else echo "neuron:$cores"; fi; }

serve_mode() {  # serve_mode <mode>: ready, completions, parity with in step, metrics, clean exit
    local mode="$1" started ok=0 parity
    start_server "$mode" "$(cat "$work/artifact-$mode")" --device "$(device)" || return 1
    started="$(now)"
    completions "$work/outputs-$mode.json" || ok=1
    record "completions_s_$mode" "$(elapsed "$started")"
    if [ "$ok" -eq 0 ] && [ "$mode" != in_step ]; then
        if [ -f "$work/outputs-in_step.json" ]; then
            parity="$(compare_outputs "$work/outputs-in_step.json" "$work/outputs-$mode.json")" \
                || { ok=1; reason="$mode differs from in step beyond a bf16 near tie: see parity_$mode"; }
            record "parity_$mode" "$parity"
        else
            record "parity_$mode" '"no in-step outputs to compare with"'
        fi
    fi
    [ "$ok" -eq 0 ] && [ -f "$work/outputs-$mode.json" ] && record "outputs_$mode" "$(cat "$work/outputs-$mode.json")"
    local why="$reason"
    neuron_metrics "$mode" || { ok=1; why="$reason"; }
    serve_stop "$mode" || { ok=1; why="$reason"; }
    reason="$why"
    return "$ok"
}

serve_replicas() {
    local ok=0 pids=() pid replica
    start_server replicas "$(cat "$work/artifact-replicas")" --device "$(device)" --replicas 2 || return 1
    for i in 1 2 3 4; do
        completions "$work/outputs-replicas-$i.json" &
        pids+=("$!")
    done
    for pid in "${pids[@]}"; do wait "$pid" || { ok=1; reason="a completion through the replicas failed"; }; done
    curl -fsS "http://127.0.0.1:$port/metrics" >"$work/metrics-replicas"
    for replica in 0 1; do
        grep -q "replica=\"$replica\"" "$work/metrics-replicas" \
            || { ok=1; reason="/metrics has no series of replica $replica"; }
    done
    record metrics_sample_replicas "$(grep -E '^inf2serve_' "$work/metrics-replicas" | head -n 60 | json_string)"
    local why="$reason"
    serve_stop replicas || { ok=1; why="$reason"; }
    reason="$why"
    return "$ok"
}

preflight() {
    "$dry_run" && return 0
    [ -e /dev/neuron0 ] || { reason="no /dev/neuron0: run this on an inf2 instance (or pass --dry-run)"; return 1; }
}

record backend "\"$backend\""
record cores "\"$cores\""
record dry_run "$dry_run"
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

echo "== 0/4 preflight"
step preflight preflight

echo "== 1/4 neuron-marked tests ($backend, cores $cores)"
step tests run_tests

echo "== 2/4 compile $checkpoint for $backend: in step, async mode, decode batch buckets"
modes=(in_step)
[ "$backend" = neuron-nxdi ] && modes+=(async_mode decode_batches)
declare -A mode_flags=([in_step]="" [async_mode]="--async-mode" [decode_batches]="--decode-batches 1,2,4")
for mode in "${modes[@]}"; do
    # shellcheck disable=SC2086  # the flags are words
    step "compile_$mode" compile_artifact "$mode" 2 ${mode_flags[$mode]}
done

echo "== 3/4 serve each artifact: parity, timings, metrics"
for mode in "${modes[@]}"; do
    if [ -s "$work/artifact-$mode" ]; then
        step "serve_$mode" serve_mode "$mode"
    else
        skip "serve_$mode" "no $mode artifact"
    fi
done

echo "== 4/4 two replicas on two core groups ($cores, one core each)"
step compile_replicas compile_artifact replicas 1
if [ -s "$work/artifact-replicas" ]; then
    step serve_replicas serve_replicas
else
    skip serve_replicas "no replicas artifact"
fi

[ "$failures" -eq 0 ] && echo "inf2-smoke: passed" || echo "inf2-smoke: $failures step(s) failed" >&2
exit $((failures > 0))
