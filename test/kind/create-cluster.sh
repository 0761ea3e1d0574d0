#!/usr/bin/env bash
# Creates a kind cluster that holds this host's NVIDIA GPUs, builds the gpudra
# image for this host's architecture with make image (docs/image.md), loads
# its tarball into the cluster and installs the Helm chart.
#
#   test/kind/create-cluster.sh          create (or reuse) the cluster and install gpudra
#   test/kind/create-cluster.sh delete   delete the cluster
#
# Environment: KIND_CLUSTER_NAME (default gpudra), KIND_NODE_IMAGE (default:
# the images in kind-config.yaml, kindest/node:v1.34.0).
# For hosts with real GPUs and Docker; not run by gpudra's CI and never run by
# the project (see README.md).
set -euo pipefail

script_dir="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)"
repo_root="$(cd -- "$script_dir/../.." && pwd)"
name="${KIND_CLUSTER_NAME:-gpudra}"

case "${1:-create}" in
create) ;;
delete)
  kind delete cluster --name "$name"
  exit 0
  ;;
*)
  echo "usage: $0 [create|delete]" >&2
  exit 2
  ;;
esac

# Prerequisites: say everything that is missing at once.
missing=0
need() {
  if ! command -v "$1" >/dev/null 2>&1; then
    echo "missing: $1 -- $2" >&2
    missing=1
  fi
}
need docker "Docker Engine: https://docs.docker.com/engine/install/"
need go "Go, to build the image: https://go.dev/dl/"
need make "GNU make"
need kind "go install sigs.k8s.io/kind@latest, or https://kind.sigs.k8s.io/docs/user/quick-start/#installation"
need kubectl "https://kubernetes.io/docs/tasks/tools/"
need helm "Helm 3: https://helm.sh/docs/intro/install/ (or run 'make helm' and put bin/ on PATH)"
need nvidia-smi "the NVIDIA driver on this host (R525+ for MIG, R535+ recommended)"
need nvidia-ctk "the NVIDIA Container Toolkit: https://docs.nvidia.com/datacenter/cloud-native/container-toolkit/latest/install-guide.html"
if [ "$missing" != 0 ]; then
  exit 1
fi

config=/etc/nvidia-container-runtime/config.toml
if ! grep -Eq '^[[:space:]]*accept-nvidia-visible-devices-as-volume-mounts[[:space:]]*=[[:space:]]*true' "$config" 2>/dev/null; then
  echo "not set: accept-nvidia-visible-devices-as-volume-mounts = true in $config" >&2
  echo "  sudo nvidia-ctk config --in-place --set accept-nvidia-visible-devices-as-volume-mounts=true" >&2
  exit 1
fi
runtime="$(docker info --format '{{.DefaultRuntime}}' 2>/dev/null || true)"
if [ "$runtime" != "nvidia" ]; then
  echo "Docker's default runtime is '${runtime:-unknown}', not nvidia:" >&2
  echo "  sudo nvidia-ctk runtime configure --runtime=docker --set-as-default && sudo systemctl restart docker" >&2
  exit 1
fi

echo "GPUs on this host:"
nvidia-smi -L

cd "$repo_root"
if kind get clusters 2>/dev/null | grep -qx "$name"; then
  echo "kind cluster $name exists; reusing it"
else
  kind create cluster --name "$name" --config test/kind/kind-config.yaml \
    ${KIND_NODE_IMAGE:+--image "$KIND_NODE_IMAGE"}
  # As NVIDIA's DRA driver demo does: the runtime masks /proc/driver/nvidia
  # in the node container, which hides MIG devices created later. Nothing is
  # mounted there when the mask is absent; that is fine.
  for node in $(kind get nodes --name "$name"); do
    case "$node" in
    *control-plane*) ;;
    *) docker exec "$node" umount -R /proc/driver/nvidia 2>/dev/null || true ;;
    esac
  done
fi
kubectl config use-context "kind-$name" >/dev/null

# The image without Docker's build: make image, for this host's architecture
# only, as a tarball kind loads (tagged ghcr.io/gpudra/gpudra:<version>).
version="$(make -s -C "$repo_root" print-version)"
arch="$(go env GOARCH)"
make -C "$repo_root" image IMAGE_ARCHES="$arch" VERSION="$version"
kind load image-archive --name "$name" "$repo_root/bin/image/gpudra-$version-$arch.tar"

# The chart's default affinity picks nodes labelled as GPU nodes.
for node in $(kubectl get nodes -l '!node-role.kubernetes.io/control-plane' -o name); do
  kubectl label --overwrite "$node" nvidia.com/gpu.present=true
done

helm upgrade --install gpudra deployments/helm/gpudra --namespace gpudra --create-namespace \
  --set image.tag="$version" --set image.pullPolicy=Never
kubectl -n gpudra rollout status daemonset/gpudra-kubelet-plugin --timeout=180s

echo
kubectl get resourceslices -o wide
cat <<EOF

gpudra is installed in kind cluster $name. Try a pod with one whole GPU:
  kubectl apply -f examples/single-gpu/
  kubectl get resourceclaims,pods -o wide
  kubectl logs single-gpu
Note: gpudra's CDI specs inject the GPU's device nodes and NVIDIA_VISIBLE_DEVICES, not the
driver's libraries or nvidia-smi, and kind nodes run containers with runc; so the example's
nvidia-smi may not be found (see test/kind/README.md).
Delete the cluster: $0 delete
EOF
