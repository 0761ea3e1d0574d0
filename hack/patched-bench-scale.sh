#!/usr/bin/env bash
# Builds bench-scale against a patched k8s.io/dynamic-resource-allocation, the
# scheduler's allocator, to measure a proposal for upstream (docs/scale.md,
# "What kube-scheduler could do"). The patches are bench/upstream/*.patch,
# applied to a copy of the module version bench/go.mod names, out of the
# module cache, under BIN/patched-scheduler. Never shipped: the result is
# BIN/bench-scale-patched only.
set -euo pipefail
bin=$(realpath "${1:?usage: patched-bench-scale.sh BIN}")
root=$(cd "$(dirname "$0")/.." && pwd)
work="$bin/patched-scheduler"
src=$(cd "$root/bench" && go list -m -f '{{if .Replace}}{{.Replace.Dir}}{{else}}{{.Dir}}{{end}}' k8s.io/dynamic-resource-allocation)
if [ -z "$src" ] || [ ! -d "$src" ]; then
	echo "patched-bench-scale: k8s.io/dynamic-resource-allocation is not in the module cache (run go mod download in bench/)" >&2
	exit 1
fi
rm -rf "$work"
mkdir -p "$work"
cp -r "$src" "$work/dynamic-resource-allocation"
chmod -R u+w "$work/dynamic-resource-allocation"
for p in "$root"/bench/upstream/*.patch; do
	patch --quiet -d "$work/dynamic-resource-allocation" -p1 < "$p"
done
# Upstream's own allocator tests, on the patched copy, before anything is
# measured with it.
(cd "$work/dynamic-resource-allocation" && go test ./structured/... > "$work/upstream-tests.log" 2>&1) || {
	tail -20 "$work/upstream-tests.log" >&2
	echo "patched-bench-scale: upstream's allocator tests fail on the patched copy" >&2
	exit 1
}
# gpudra's allocator tests (pkg/slicebuilder: its slices carry identities, as
# the API server's do; TestAllocatorFollowsASliceChange changes one between
# pods), against the patched allocator too.
cp "$root/go.mod" "$work/main.mod"
cp "$root/go.sum" "$work/main.sum"
(cd "$root" && go mod edit -modfile="$work/main.mod" -replace "k8s.io/dynamic-resource-allocation=$work/dynamic-resource-allocation")
(cd "$root/pkg/slicebuilder" && CGO_ENABLED=0 go test -modfile="$work/main.mod" -count=1 -run 'TestAllocator|TestDeviceOrder' . > "$work/gpudra-tests.log" 2>&1) || {
	tail -20 "$work/gpudra-tests.log" >&2
	echo "patched-bench-scale: gpudra's allocator tests fail against the patched allocator" >&2
	exit 1
}
cp "$root/bench/go.mod" "$work/go.mod"
cp "$root/bench/go.sum" "$work/go.sum"
cd "$root/bench"
go mod edit -modfile="$work/go.mod" -replace "k8s.io/dynamic-resource-allocation=$work/dynamic-resource-allocation"
CGO_ENABLED=0 go build -modfile="$work/go.mod" -o "$bin/bench-scale-patched" ./cmd/bench-scale
echo "patched-bench-scale: $bin/bench-scale-patched, with $(ls "$root"/bench/upstream/*.patch | xargs -n1 basename | tr '\n' ' ')"
