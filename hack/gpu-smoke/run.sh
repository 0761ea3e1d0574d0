#!/bin/sh
# gpu-smoke bundle (make gpu-smoke-bundle; docs/gpu-smoke.md): checks a GPU
# node before the chart goes on it. Runs as root on an x86-64 Linux node
# with an NVIDIA driver, without Go or a network. Writes everything it saw
# into one directory: the inventory (table and JSON, as `gpudra inventory`
# prints it), the slices the plugin published, the
# comparison with the simulator's model, each pod's report, the prepare
# timings, the log, and RESULT (PASS, or FAIL and why).
#
#   ./run.sh                       the GPUs of this node, through NVML
#   ./run.sh --simulated [MACHINE] the same flow over a simulated GPU
#                                  (default dgx-h100-nomig), no GPU needed
#
# Environment: RESULTS (default ./results), DRIVER_ROOT (default /: where
# the driver is installed; /run/nvidia/driver under the GPU operator),
# GPU_SMOKE_ARGS (more flags for bin/gpu-smoke).
set -u
here=$(cd "$(dirname "$0")" && pwd)
results=${RESULTS:-$here/results}
driver_root=${DRIVER_ROOT:-/}
simulated=
if [ "${1:-}" = "--simulated" ]; then
  simulated=${2:-dgx-h100-nomig}
fi

fail() { echo "gpu-smoke: FAIL: $*"; mkdir -p "$results" 2>/dev/null && echo "FAIL: $*" > "$results/RESULT"; exit 1; }

[ "$(uname -m)" = x86_64 ] || fail "this bundle is for x86-64 nodes; this one is $(uname -m)"
[ "$(id -u)" = 0 ] || fail "run as root: runc needs root to run the containers"
if [ -z "$simulated" ]; then
  [ -e /dev/nvidiactl ] || \
    fail "no NVIDIA GPU here (/dev/nvidiactl does not exist): run it on a node with an NVIDIA GPU and driver, or with --simulated"
fi
# An earlier run's results (they have a RESULT) make way; nothing else is removed.
[ -e "$results/RESULT" ] && rm -rf "$results"
mkdir -p "$results" || fail "cannot make $results"
cd "$here" || exit 1
cp VERSION "$results/VERSION" 2>/dev/null
{ date -u +%Y-%m-%dT%H:%M:%SZ; uname -a; } > "$results/host.txt"

if [ -z "$simulated" ]; then
  nvidia_smi=$(command -v nvidia-smi || true)
  [ -n "$nvidia_smi" ] && "$nvidia_smi" -q -x > "$results/nvidia-smi-q.xml" 2>&1
fi
start=$(date +%s)
set -- --results "$results" --runc bin/runc --probe bin/gpudra-probe --cuda-check bin/gpudra-cuda-check \
  --mps-server bin/gpudra-mps-server --plugin-binary bin/gpudra-kubelet-plugin \
  --rendered-chart chart.yaml --driver-root "$driver_root"
if [ -n "$simulated" ]; then
  set -- "$@" --simulated "$simulated" --mps-control-binary stand-ins/nvidia-cuda-mps-control --fake-libcuda stand-ins/libcuda.so
fi
# shellcheck disable=SC2086 # GPU_SMOKE_ARGS is several flags
bin/gpu-smoke "$@" ${GPU_SMOKE_ARGS:-} 2>&1 | tee "$results/gpu-smoke.txt"
status=$(cat "$results/RESULT" 2>/dev/null || echo "FAIL: gpu-smoke wrote no RESULT")
echo "gpu-smoke: $(($(date +%s) - start)) s; results in $results: $status"
case "$status" in PASS*) exit 0 ;; *) exit 1 ;; esac
