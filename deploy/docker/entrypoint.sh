#!/bin/sh
# The entrypoint of both images (Dockerfile for Inferentia2, deploy/docker/Dockerfile.cpu).
#   serve [flags]  start the server (SageMaker runs `docker run IMAGE serve`), after checking that the
#                  artifact it is pointed at is there: a local directory needs its manifest.json (an alias
#                  file or an s3:// URI is resolved by the server itself; a pin, `@sha256:<hex>`, is
#                  checked by the server)
#   healthcheck    GET /ping on the serving port (Docker's HEALTHCHECK); exits 0 only on 200
#   anything else  run as given (a shell, `inf2serve compile ...`)
set -eu

artifact="${INF2SERVE_ARTIFACT:-/opt/ml/model}"
port="${INF2SERVE_PORT:-${SAGEMAKER_BIND_TO_PORT:-8080}}"

check_artifact() {
    case "$artifact" in
        s3://*) return 0 ;;
    esac
    artifact="${artifact%@sha256:*}"
    if [ -d "$artifact" ] && [ ! -f "$artifact/manifest.json" ]; then
        echo "entrypoint: $artifact holds no published artifact (no manifest.json)." >&2
        echo "entrypoint: give the container a compiled artifact there (SageMaker: ModelDataUrl)," >&2
        echo "entrypoint: or point INF2SERVE_ARTIFACT at one (a directory or s3:// URI)." >&2
        exit 66
    fi
    if [ ! -e "$artifact" ]; then
        echo "entrypoint: no artifact at $artifact: mount or download one there, or set INF2SERVE_ARTIFACT." >&2
        exit 66
    fi
}

command="${1:-serve}"
[ "$#" -gt 0 ] && shift
case "$command" in
    serve)
        check_artifact
        exec serve "$@"
        ;;
    healthcheck)
        exec python3 -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)' \
            "http://127.0.0.1:${port}/ping"
        ;;
    *)
        exec "$command" "$@"
        ;;
esac
