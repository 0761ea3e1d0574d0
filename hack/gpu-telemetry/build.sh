#!/usr/bin/env bash
# Builds what hack/gpu-telemetry/run.sh runs on a GPU machine without Go.
set -euo pipefail
cd "$(dirname "$0")/../.."
export CGO_CFLAGS="-O2 -g -Wno-deprecated-declarations"
mkdir -p bin
CGO_ENABLED=1 go test -c -o bin/nvml.test ./pkg/nvdevice/nvml
CGO_ENABLED=1 go build -o bin/gpudra ./cmd/gpudra
CGO_ENABLED=0 go build -o bin/gpudra-cuda-check ./cmd/gpudra-cuda-check
