#!/bin/sh
# The Neuron release an image is built for, checked before anything is installed:
#   check-release.sh RELEASE        print the DLC base image of RELEASE (for --build-arg NEURON_BASE)
#   check-release.sh RELEASE BASE   inside the build: BASE must be RELEASE's image, and its Python one
#                                   inf2serve runs on
# Each release this repository supports has deploy/neuron/sdk-<release>.txt (its wheel pins) whose
# `# base-image:` line names the AWS Neuron DLC of that release; anything else stops here, with the list.
# A release whose pins say `# inf2: withdrawn: <why>` is kept for other hardware and refused for this image.
set -eu
release="${1:?usage: check-release.sh RELEASE [BASE]}"
here="$(dirname "$0")"
pins="$here/sdk-$release.txt"
if [ ! -f "$pins" ]; then
    supported="$(grep -L '^# inf2: withdrawn' "$here"/sdk-*.txt | sed -n 's/^.*sdk-\(.*\)\.txt$/\1/p' | tr '\n' ' ')"
    echo "Neuron SDK $release: no matching base image or wheel pins here (deploy/neuron/sdk-$release.txt)." >&2
    echo "Supported releases: $supported" >&2
    exit 64
fi
withdrawn="$(sed -n 's/^# inf2: withdrawn: *//p' "$pins")"
if [ -n "$withdrawn" ]; then
    echo "Neuron SDK $release is withdrawn for Inf2, which this image serves: $withdrawn." >&2
    exit 64
fi
expected="$(sed -n 's/^# base-image: *//p' "$pins")"
if [ "$#" -lt 2 ]; then
    echo "$expected"
    exit 0
fi
if [ "$2" != "$expected" ]; then
    echo "Neuron SDK $release is built FROM $expected, not $2:" >&2
    echo "  docker build --build-arg NEURON_SDK=$release --build-arg NEURON_BASE=$expected ." >&2
    exit 64
fi
if ! python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    echo "Neuron SDK $release: its base image $expected runs Python $(python3 -V 2>&1 | cut -d' ' -f2)," >&2
    echo "and inf2serve needs Python >= 3.11. Build another release." >&2
    exit 64
fi
