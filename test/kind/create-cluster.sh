#!/usr/bin/env bash
# Creates a kind cluster with the host's NVIDIA GPUs, builds the gpudra image,
# loads it and installs the chart. `create-cluster.sh delete` removes it.
# For hosts with real GPUs and Docker; not run by gpudra's CI.
set -euo pipefail
cd "$(dirname "$0")/../.."
name="${KIND_CLUSTER_NAME:-gpudra}"
image="ghcr.io/gpudra/gpudra:dev"

if [ "${1:-}" = "delete" ]; then
  kind delete cluster --name "$name"
  exit 0
fi

missing=0
need() {
  if ! command -v "$1" >/dev/null 2>&1; then
    echo "missing: $1 ($2)" >&2
    missing=1
  fi
}
need docker "https://docs.docker.com/engine/install/"
need kind "go install sigs.k8s.io/kind@latest"
need kubectl "https://kubernetes.io/docs/tasks/tools/"
need helm "https://helm.sh/docs/intro/install/ (or: make helm, then use bin/helm)"
need nvidia-smi "the NVIDIA driver on this host"
need nvidia-ctk "the NVIDIA Container Toolkit: https://docs.nvidia.com/datacenter/cloud-native/container-toolkit/"
[ "$missing" = 0 ] || exit 1
if ! grep -Eq '^\s*accept-nvidia-visible-devices-as-volume-mounts\s*=\s*true' /etc/nvidia-container-runtime/config.toml 2>/dev/null; then
  echo "set accept-nvidia-visible-devices-as-volume-mounts = true in /etc/nvidia-container-runtime/config.toml" >&2
  echo "and make nvidia the default Docker runtime: sudo nvidia-ctk runtime configure --runtime=docker --set-as-default" >&2
  exit 1
fi

nvidia-smi -L
kind create cluster --name "$name" --config test/kind/kind-config.yaml
docker build -t "$image" .
kind load docker-image --name "$name" "$image"
for node in $(kubectl get nodes -l '!node-role.kubernetes.io/control-plane' -o name); do
  kubectl label --overwrite "$node" nvidia.com/gpu.present=true
done
helm upgrade --install gpudra deployments/helm/gpudra --namespace gpudra --create-namespace \
  --set image.tag=dev --set image.pullPolicy=Never
kubectl -n gpudra rollout status daemonset/gpudra-kubelet-plugin --timeout=180s
kubectl get resourceslices -o wide
echo
echo "Try: kubectl apply -f examples/single-gpu/ && kubectl logs -f single-gpu"
