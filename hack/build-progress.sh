#!/usr/bin/env bash
# Builds the devcluster module with a progress line instead of silence: the
# first build compiles Kubernetes (about 6 minutes and 3 GB of memory on 2
# cores); later builds take seconds.
set -euo pipefail
cd "$(dirname "$0")/../devcluster"
out="${1:-../bin/devcluster}"
start=$SECONDS
echo "Building devcluster (a Kubernetes control plane in one binary). A first build takes about 6 minutes; later builds take seconds."
# go build -v names each package as it is compiled; errors are printed as they come.
# KUBE_LDFLAGS (make devcluster) stamps Kubernetes' version, as a release build does.
CGO_ENABLED=0 go build -v -ldflags "${KUBE_LDFLAGS:-}" -o "$out" ./cmd/devcluster 2>&1 | awk -v start="$start" '
  /^#|\.go:[0-9]+|^go: |^(package|build|link)[ :]/ { print; next }
  { n++; if (n % 200 == 0) { printf "  ... %d packages compiled\n", n; fflush() } }'
echo "devcluster built in $((SECONDS - start))s"
