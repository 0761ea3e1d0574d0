# gpudra: build, test and demo. See README.md.
SHELL := /bin/bash
GO ?= go
export PATH := $(PATH):/usr/local/go/bin:$(HOME)/go/bin
# The header of go-nvml marks many functions deprecated; the warnings are noise.
export CGO_CFLAGS ?= -O2 -g -Wno-deprecated-declarations

# One version, one source (docs/release.md): the chart's appVersion. A
# release (RELEASE=1, the release workflow, on the tag v<appVersion>) is
# exactly it; any other build says which commit it is past it.
APP_VERSION := $(shell sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\} *$$/\1/p' deployments/helm/gpudra/Chart.yaml)
COMMIT ?= $(shell git rev-parse HEAD 2>/dev/null || echo unknown)
VERSION ?= $(if $(RELEASE),$(APP_VERSION),$(APP_VERSION)-dev.$(shell git rev-parse --short=12 HEAD 2>/dev/null || echo unknown))
LDFLAGS := -X github.com/gpudra/gpudra/internal/version.Version=$(VERSION) -X github.com/gpudra/gpudra/internal/version.Commit=$(COMMIT)
BIN := bin
comma := ,

# Everything but the NVML backend builds and tests without cgo.
NVML_PKG := ./pkg/nvdevice/nvml/...
PURE_PKGS = $(shell $(GO) list ./... | grep -v /pkg/nvdevice/nvml)
FUZZTIME ?= 100000x
CHART := deployments/helm/gpudra
HELM_VERSION := v3.22.0
HELM := $(abspath $(BIN))/helm
# runc runs devcluster's real containers (issue 27), built from the module
# proxy at a pinned version (cgo: its nsenter is C), beside the probe they run.
RUNC_VERSION := v1.5.2
RUNC := $(abspath $(BIN))/runc
PROBE := $(abspath $(BIN))/gpudra-probe
MPS_SERVER := $(abspath $(BIN))/gpudra-mps-server
# The CUDA check run inside containers (purego: dynamically linked, it needs
# the image's libc) and the simulated driver's stand-in libcuda (a C test
# fixture built with gcc, not cgo).
CUDA_CHECK := $(abspath $(BIN))/gpudra-cuda-check
FAKE_LIBCUDA := $(abspath $(BIN))/fakecuda/libcuda.so
# Karpenter v1.15's controllers with devcluster's cloud provider compiled in
# (devcluster/karpenter, a module of its own on Karpenter's Kubernetes
# libraries). Karpenter's module needs go 1.26.9: the go command fetches
# that toolchain from the module proxy for this build only.
KARPENTER := $(abspath $(BIN))/devcluster-karpenter
KARPENTER_GO := GOTOOLCHAIN=go1.26.9 CGO_ENABLED=0 $(GO)
# KubeRay's operator, its own main package as released, built from
# devcluster/kuberay (a module of its own at KubeRay's dependency
# versions), and the CRDs of that version beside it: the binary cannot
# print them and the module cache is not there at run time (docs/ray.md).
KUBERAY_DIR := $(abspath $(BIN))/kuberay
KUBERAY := $(KUBERAY_DIR)/kuberay-operator
KUBERAY_GO := CGO_ENABLED=0 $(GO)
# Kueue's manager, its own main package as released, built from
# devcluster/kueue (a module of its own at Kueue's dependency versions), and
# Kueue's own Helm chart of that version beside it: devcluster renders it
# for the CRDs, RBAC, webhook Service and configurations, and runs the
# binary itself (docs/queues.md).
KUEUE_DIR := $(abspath $(BIN))/kueue
KUEUE := $(KUEUE_DIR)/kueue-manager
# Kubernetes' version, stamped as a release build stamps it, into the real
# node's kubelet and into devcluster's control plane (its binary and the e2e
# tests): unstamped, the API server says it is v0.0.0-master+(a placeholder), which
# Kueue cannot parse and refuses to start with.
KUBERNETES_VERSION := v1.37.1
KUBE_LDFLAGS := -X k8s.io/component-base/version.gitVersion=$(KUBERNETES_VERSION) -X k8s.io/component-base/version.gitMajor=1 \
	-X k8s.io/component-base/version.gitMinor=37 -X k8s.io/component-base/version.gitTreeState=clean
# make gpu-smoke-bundle (docs/gpu-smoke.md): everything gpu-smoke needs on a
# GPU node without Go; BUNDLE_CGO=0 leaves NVML out (--simulated only), as
# the e2e suite builds it without a second, cgo build of Kubernetes.
BUNDLE_CGO ?= 1
BUNDLE_TAR ?= 1
BUNDLE_NAME ?= gpu-smoke-bundle
BUNDLE_DIR := $(abspath $(BIN))/$(BUNDLE_NAME)

.PHONY: karpenter kuberay kueue all real-node build browser print-version test test-unit test-nvml test-fuzz test-chart test-rules test-e2e test-e2e-image lint fmt bench bench-e2e bench-prepare bench-scale bench-scale-patched bench-dashboard demo demo-image demo-real-node devcluster helm probe gpu-smoke gpu-smoke-bundle image cross-cc test-image clean
all: build

build:
	@mkdir -p $(BIN)
	$(GO) build -ldflags "$(LDFLAGS)" -o $(BIN)/gpudra ./cmd/gpudra
	$(GO) build -ldflags "$(LDFLAGS)" -o $(BIN)/gpudra-kubelet-plugin ./cmd/kubelet-plugin
	CGO_ENABLED=0 $(GO) build -ldflags "$(LDFLAGS)" -o $(BIN)/gpudra-mps-server ./cmd/mps-server
	CGO_ENABLED=0 $(GO) build -ldflags "$(LDFLAGS)" -o $(BIN)/gpudra-controller ./cmd/controller
	CGO_ENABLED=0 $(GO) build ./...

test: lint browser test-unit test-image test-nvml test-fuzz test-chart test-rules real-node test-e2e test-e2e-image
# Under make test the browser tests fail, not skip, without a browser.
test: export GPUDRA_REQUIRE_BROWSER := 1
# ... and the real node's (devcluster/e2e/realnode) without root, its
# binaries (make real-node) or make image's tarball (test-image's first
# build under make test; elsewhere make test-e2e REAL_NODE_IMAGE=<absolute
# path>, else its plugin test skips).
test: export GPUDRA_REQUIRE_REAL_NODE := 1
# ... and Karpenter's (devcluster/e2e/karpenter) without make karpenter's binary.
test: export GPUDRA_REQUIRE_KARPENTER := 1
# ... and Ray's (devcluster/e2e/ray) without make kuberay's binary.
test: export GPUDRA_REQUIRE_KUBERAY := 1
# ... and Kueue's (devcluster/e2e/kueue) without make kueue's binary.
test: export GPUDRA_REQUIRE_KUEUE := 1
REAL_NODE_IMAGE ?=
test: REAL_NODE_IMAGE = $$(ls $(abspath $(BIN))/image-check-a/gpudra-*-$(GOHOSTARCH).tar | head -1)

# The dashboard's tests drive a real browser: Debian's chromium, headless,
# installed here where missing (make test does all of its own set-up).
browser:
	@command -v chromium >/dev/null || { echo "Installing Debian's chromium for the dashboard's browser tests."; \
	  SUDO=; [ "$$(id -u)" = 0 ] || SUDO=sudo; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium >/dev/null; }
	@chromium --version

test-unit:
	CGO_ENABLED=0 $(GO) test -count=1 $(PURE_PKGS)

test-nvml:
	CGO_ENABLED=1 $(GO) test -count=1 $(NVML_PKG)

# Bounded fuzzing of every parser of untrusted input: zero panics allowed.
test-fuzz:
	CGO_ENABLED=0 $(GO) test -run '^$$' -fuzz '^FuzzUnmarshal$$' -fuzztime $(FUZZTIME) ./pkg/plugin/checkpoint/
	CGO_ENABLED=0 $(GO) test -run '^$$' -fuzz '^FuzzDecode$$' -fuzztime $(FUZZTIME) ./api/gpu/v1alpha1/
	CGO_ENABLED=0 $(GO) test -run '^$$' -fuzz '^FuzzParseSpec$$' -fuzztime $(FUZZTIME) ./pkg/nvdevice/sim/

# The end-to-end suite: the examples on a real control plane (devcluster),
# then the benchmarks' and gpu-smoke's own tests (bench/, gpusmoke/: modules
# beside devcluster's, on the same control plane code). It builds the
# control plane first, with progress: the first build is long.
# RUN, a go test -run regexp, runs only the matching tests of the three
# modules, verbosely (make test-e2e RUN='^TestSingleGPU$$'), and fails if
# none matched.
# The e2e suite keeps some of its nodes' scrapes here, for the rules' test.
SCRAPES_DIR := $(abspath $(BIN))/e2e-scrapes
E2E_MODULES := devcluster bench gpusmoke
E2E_ENV = HELM=$(HELM) RUNC=$(RUNC) PROBE=$(PROBE) KARPENTER=$(KARPENTER) KUBERAY=$(KUBERAY) KUEUE=$(KUEUE) REAL_NODE_BIN=$(REAL_NODE_BIN) GPUDRA_IMAGE_TARBALL=$(REAL_NODE_IMAGE) MPS_SERVER=$(MPS_SERVER) CUDA_CHECK=$(CUDA_CHECK) FAKE_LIBCUDA=$(FAKE_LIBCUDA) \
	GPU_SMOKE_BUNDLE=$(abspath $(BIN))/gpu-smoke-bundle-sim GPUDRA_SCRAPES_DIR=$(SCRAPES_DIR) CGO_ENABLED=0
RUN ?=
test-e2e: devcluster helm probe $(RUNC) karpenter kuberay kueue
	@$(MAKE) --no-print-directory gpu-smoke-bundle BUNDLE_CGO=0 BUNDLE_TAR=0 BUNDLE_NAME=gpu-smoke-bundle-sim
	@for m in $(E2E_MODULES) devcluster/cloudapi; do echo "go vet in $$m"; (cd $$m && CGO_ENABLED=0 $(GO) vet ./...) || exit 1; done
	cd devcluster/karpenter && $(KARPENTER_GO) vet ./... && $(KARPENTER_GO) test -count=1 ./...
	rm -rf $(SCRAPES_DIR) && mkdir -p $(SCRAPES_DIR)
ifeq ($(RUN),)
	cd devcluster && $(E2E_ENV) $(GO) test -ldflags "$(KUBE_LDFLAGS)" -count=1 -timeout 45m ./...
	cd bench && $(E2E_ENV) $(GO) test -ldflags "$(KUBE_LDFLAGS)" -count=1 -timeout 20m ./...
	cd gpusmoke && $(E2E_ENV) $(GO) test -ldflags "$(KUBE_LDFLAGS)" -count=1 -timeout 10m ./...
	@# The shipped XID alert over what a devcluster node really exported
	@# before and after an XID on a GPU a pod holds (TestTelemetryPerPod).
	cd hack/promrules && GPUDRA_SCRAPES_DIR=$(SCRAPES_DIR) CGO_ENABLED=0 $(GO) test -count=1 -run '^TestXIDAlertOverDevclusterScrapes$$' .
else
	@log=$(abspath $(BIN))/test-e2e-run.log; : > $$log; \
	  for m in $(E2E_MODULES); do \
	    (cd $$m && $(E2E_ENV) $(GO) test -ldflags "$(KUBE_LDFLAGS)" -count=1 -timeout 45m -v -run '$(RUN)' ./...) 2>&1 | tee -a $$log; \
	    [ $${PIPESTATUS[0]} -eq 0 ] || exit 1; \
	  done; \
	  ran=$$(grep -c -E '^--- (PASS|SKIP)' $$log); \
	  [ "$$ran" -gt 0 ] || { echo "make test-e2e: no e2e test matches RUN='$(RUN)'"; exit 1; }; \
	  echo "make test-e2e: $$ran top-level test(s) matching RUN='$(RUN)' passed or skipped"
endif

# devcluster's image mode (issue 38): the chart's plugin and controller
# pods run from an image layout in runc serve the examples, the webhook and
# the gangs; broken values crash-loop with their reason. Standalone it runs
# a fresh make image; make test runs test-image's first build.
IMAGE_E2E_LAYOUT ?=
test: IMAGE_E2E_LAYOUT = $(abspath $(BIN))/image-check-a/oci
test-e2e-image: helm $(RUNC)
	@layout=$(IMAGE_E2E_LAYOUT); if [ -z "$$layout" ]; then $(MAKE) --no-print-directory image && layout=$(IMAGE_DIR)/oci; fi; \
	  cd devcluster && HELM=$(HELM) RUNC=$(RUNC) GPUDRA_IMAGE_LAYOUT=$$layout GPUDRA_REQUIRE_IMAGE_E2E=1 CGO_ENABLED=0 $(GO) test -count=1 -timeout 20m ./e2e/image/

# The Helm chart: lint and render with default and non-default values. The
# e2e suite installs it into devcluster and checks that wrong values fail.
test-chart: helm
	$(HELM) lint --strict $(CHART)
	$(HELM) lint --strict $(CHART) -f $(CHART)/ci/non-default-values.yaml
	$(HELM) template gpudra $(CHART) --namespace gpudra --kube-version 1.37.1 > /dev/null
	$(HELM) template gpudra $(CHART) --namespace gpudra --kube-version 1.37.1 -f $(CHART)/ci/non-default-values.yaml > /dev/null
	@# Without the controller: nothing of it renders, and no webhook either.
	@out=$$($(HELM) template gpudra $(CHART) --namespace gpudra --kube-version 1.37.1 --set controller.enabled=false) && \
	  if grep -q -e 'kind: ValidatingWebhookConfiguration' -e 'gpudra-controller' <<<"$$out"; then \
	    echo "controller.enabled=false still renders the controller or its webhook"; exit 1; fi

# The chart's Prometheus rules and Grafana dashboard (hack/promrules, a
# module of its own so that github.com/prometheus/prometheus stays out of
# the main module): parsed as `promtool check rules` does, rendered by the
# chart unchanged, every metric they use exported, and every alert and
# recording rule evaluated over scrapes of the real collectors.
test-rules: helm
	cd hack/promrules && CGO_ENABLED=0 $(GO) vet ./...
	cd hack/promrules && HELM=$(HELM) CGO_ENABLED=0 $(GO) test -count=1 ./...

# runc, built from the module proxy (no other download is reachable here).
$(RUNC):
	@mkdir -p $(BIN)
	@echo "Building runc $(RUNC_VERSION) from the Go module proxy (about a minute, once)."
	GOBIN=$(abspath $(BIN)) CGO_ENABLED=1 $(GO) install github.com/opencontainers/runc@$(RUNC_VERSION)

# The processes of devcluster's real containers, static: the probe (every
# workload container; it needs no image) and the MPS server pods' server.
probe:
	@mkdir -p $(BIN)/fakecuda
	CGO_ENABLED=0 $(GO) build -o $(PROBE) ./cmd/gpudra-probe
	CGO_ENABLED=0 $(GO) build -ldflags "$(LDFLAGS)" -o $(MPS_SERVER) ./cmd/mps-server
	CGO_ENABLED=0 $(GO) build -o $(CUDA_CHECK) ./cmd/gpudra-cuda-check
	gcc -shared -fPIC -O2 -Wall -Wl,-soname,libcuda.so.1 -o $(FAKE_LIBCUDA) pkg/nvdevice/sim/fakecuda/libcuda.c

# A real node's programs (devcluster's realnode package; docs/devcluster.md,
# "A real node"), built from the Go module proxy into bin/real-node: the
# kubelet from devcluster's own k8s.io/kubernetes (its version stamped as a
# release build stamps it), containerd, its runc shim and ctr, the CNI
# plugins, runc with libseccomp (Debian's libseccomp-dev, installed where
# missing: the CRI plugin asks every sandbox for a seccomp profile) and the
# pause image's process, and the static MPS control stand-in the simulated
# driver root gets (the image's containers have no shell for the script's).
CONTAINERD_VERSION := v2.4.2
CNI_PLUGINS_VERSION := v1.10.0
REAL_NODE_BIN := $(abspath $(BIN))/real-node
real-node: probe
	@mkdir -p $(REAL_NODE_BIN)/cni
	@[ -e /usr/include/seccomp.h ] || { echo "Installing Debian's libseccomp-dev for runc's seccomp."; \
	  SUDO=; [ "$$(id -u)" = 0 ] || SUDO=sudo; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq libseccomp-dev >/dev/null; }
	@# nsenter and ip set up containerd's network namespace (realnode).
	@command -v nsenter >/dev/null && command -v ip >/dev/null || { echo "Installing Debian's util-linux and iproute2."; \
	  SUDO=; [ "$$(id -u)" = 0 ] || SUDO=sudo; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq util-linux iproute2 >/dev/null; }
	cd devcluster && CGO_ENABLED=0 $(GO) build -ldflags "$(KUBE_LDFLAGS)" -o $(REAL_NODE_BIN)/kubelet k8s.io/kubernetes/cmd/kubelet
	cd devcluster && CGO_ENABLED=0 $(GO) build -o $(REAL_NODE_BIN)/pause ./cmd/pause
	cd devcluster && CGO_ENABLED=0 $(GO) build -o $(REAL_NODE_BIN)/nvidia-cuda-mps-control ./cmd/fake-mps-control
	GOBIN=$(REAL_NODE_BIN) CGO_ENABLED=1 $(GO) install -ldflags "-X github.com/containerd/containerd/v2/version.Version=$(CONTAINERD_VERSION:v%=%)" \
		github.com/containerd/containerd/v2/cmd/containerd@$(CONTAINERD_VERSION) \
		github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2@$(CONTAINERD_VERSION) github.com/containerd/containerd/v2/cmd/ctr@$(CONTAINERD_VERSION)
	GOBIN=$(REAL_NODE_BIN)/cni CGO_ENABLED=0 $(GO) install github.com/containernetworking/plugins/plugins/main/bridge@$(CNI_PLUGINS_VERSION) \
		github.com/containernetworking/plugins/plugins/main/loopback@$(CNI_PLUGINS_VERSION) github.com/containernetworking/plugins/plugins/ipam/host-local@$(CNI_PLUGINS_VERSION)
	GOBIN=$(REAL_NODE_BIN) CGO_ENABLED=1 $(GO) install -tags seccomp github.com/opencontainers/runc@$(RUNC_VERSION)

# helm, built from the module proxy (no other download is reachable here).
helm: $(HELM)
$(HELM):
	@mkdir -p $(BIN)
	@echo "Building helm $(HELM_VERSION) from the Go module proxy (about a minute, once)."
	GOBIN=$(abspath $(BIN)) $(GO) install helm.sh/helm/v3/cmd/helm@$(HELM_VERSION)

# The workflows' linter, built from the Go module proxy at a pinned version.
ACTIONLINT_VERSION := v1.7.12
ACTIONLINT := $(abspath $(BIN))/actionlint
$(ACTIONLINT):
	@mkdir -p $(BIN)
	GOBIN=$(abspath $(BIN)) CGO_ENABLED=0 $(GO) install github.com/rhysd/actionlint/cmd/actionlint@$(ACTIONLINT_VERSION)

print-version:
	@echo $(VERSION)

lint: $(ACTIONLINT)
	$(ACTIONLINT) -no-color .github/workflows/*.yml
	@unformatted=$$(gofmt -l $$(git ls-files --cached --others --exclude-standard '*.go')); \
	  if [ -n "$$unformatted" ]; then echo "gofmt needed: $$unformatted"; exit 1; fi
	CGO_ENABLED=0 $(GO) vet $(PURE_PKGS)
	CGO_ENABLED=1 $(GO) vet $(NVML_PKG)

fmt:
	gofmt -w $$(git ls-files '*.go')

bench:
	CGO_ENABLED=0 $(GO) test -run '^$$' -bench . -benchmem $(PURE_PKGS)

# The demo: a real Kubernetes control plane with two simulated DGX H100
# nodes running the gpudra kubelet plugin; applies examples/ and prints where
# every pod landed and which GPUs it would see. DEMO_FLAGS=--keep leaves it
# running for kubectl.
demo: devcluster helm probe $(RUNC)
	$(BIN)/devcluster --examples examples --runc $(RUNC) --probe $(PROBE) --mps-server $(MPS_SERVER) $(DEMO_FLAGS)

# The demo with the chart's own kubelet plugin DaemonSet pod and controller
# Deployment pods run from make image's OCI layout in runc, as the chart
# renders them (devcluster's image mode, docs/devcluster.md; root): three
# DGX H100 nodes with MIG off and the examples that image mode runs (not
# MIG, MPS, the fractional node or Grove: docs/devcluster.md says why).
DEMO_IMAGE_EXAMPLES := single-gpu nvlink-pair prioritized-list shared-claim cel-selector time-slicing gang/plain-pods.yaml reservation
demo-image: devcluster helm probe $(RUNC) image
	$(BIN)/devcluster --image $(IMAGE_DIR)/oci --machines dgx-h100-nomig,dgx-h100-nomig,dgx-h100-nomig --fractional-node=false --grove=false \
		--examples examples $(foreach e,$(DEMO_IMAGE_EXAMPLES),--example $(e)) --runc $(RUNC) --probe $(PROBE) --mps-server $(MPS_SERVER) $(DEMO_FLAGS)

# The demo with a real node beside the simulated ones: real-node-0 is run by
# the kubelet binary and containerd (make real-node), the chart's plugin pod
# runs there from make image's image (this machine's architecture only),
# and the examples that fit one DGX H100 run there, their containers the
# probe image; the table's RUNTIME column says what started each pod's
# containers (docs/devcluster.md, "A real node"; root).
demo-real-node: devcluster helm probe $(RUNC) real-node
	@$(MAKE) --no-print-directory image IMAGE_ARCHES=$(GOHOSTARCH)
	$(BIN)/devcluster --real-node $(REAL_NODE_BIN) --real-node-image $$(ls $(IMAGE_DIR)/gpudra-*-$(GOHOSTARCH).tar | head -1) \
		--examples examples --runc $(RUNC) --probe $(PROBE) --mps-server $(MPS_SERVER) $(DEMO_FLAGS)

karpenter:
	@mkdir -p $(BIN)
	cd devcluster/karpenter && $(KARPENTER_GO) build -o $(KARPENTER) ./cmd/devcluster-karpenter

kuberay:
	@mkdir -p $(KUBERAY_DIR)
	cd devcluster/kuberay && $(KUBERAY_GO) build -o $(KUBERAY) github.com/ray-project/kuberay/ray-operator
	cd devcluster/kuberay && crds=$$($(GO) list -m -f '{{.Dir}}' github.com/ray-project/kuberay/ray-operator)/config/crd/bases && \
	  for f in $$crds/ray.io_*.yaml; do echo ---; cat $$f; done > $(KUBERAY_DIR)/crds.yaml

kueue:
	@mkdir -p $(KUEUE_DIR)
	cd devcluster/kueue && CGO_ENABLED=0 $(GO) build -o $(KUEUE) sigs.k8s.io/kueue/cmd/kueue
	rm -rf $(KUEUE_DIR)/chart
	cd devcluster/kueue && cp -R $$($(GO) list -m -f '{{.Dir}}' sigs.k8s.io/kueue)/charts/kueue $(KUEUE_DIR)/chart && chmod -R u+w $(KUEUE_DIR)/chart

devcluster:
	@mkdir -p $(BIN)
	@KUBE_LDFLAGS="$(KUBE_LDFLAGS)" bash hack/build-progress.sh ../$(BIN)/devcluster

# End-to-end benchmark: 100 pods with one GPU claim each over 16 nodes.
bench-e2e: devcluster helm
	cd devcluster && CGO_ENABLED=0 $(GO) test -run '^$$' -bench . -benchtime 1x ./e2e/

# The plugin binary as shipped, as a process of its own against devcluster's
# real API server: 200 one-GPU claims prepared and unprepared over its DRA
# socket, one after the other. The last line is the summary; the log goes to
# bin/bench-prepare.log.
bench-prepare: build helm
	cd bench && CGO_ENABLED=0 $(GO) build -o $(abspath $(BIN))/bench-prepare ./cmd/bench-prepare
	$(BIN)/bench-prepare --plugin-binary $(BIN)/gpudra-kubelet-plugin $(BENCH_PREPARE_ARGS) 2> $(BIN)/bench-prepare.log || { tail -20 $(BIN)/bench-prepare.log; exit 1; }

# The cluster as it grows (issue 26): devcluster's control plane with 100,
# 300 and 1,000 simulated DGX H100 nodes (Node objects and the slices the
# plugin would publish, no kubelets) per node mix, gpudra-controller as its
# own process. Tables to stdout, bench-scale-results.md and .csv, the plot
# to docs/bench-scale.png (a quick run draws none); the last line is the largest point's summary; the
# log goes to bin/bench-scale.log. BENCH_SCALE=quick: 50 nodes, two mixes.
bench-scale: build helm
	cd bench && CGO_ENABLED=0 $(GO) build -o $(abspath $(BIN))/bench-scale ./cmd/bench-scale
	HELM=$(HELM) $(BIN)/bench-scale --controller-binary $(BIN)/gpudra-controller --plugin-binary $(BIN)/gpudra-kubelet-plugin \
		$(if $(filter quick,$(BENCH_SCALE)),--quick) $(BENCH_SCALE_ARGS) 2> $(BIN)/bench-scale.log || { tail -20 $(BIN)/bench-scale.log; exit 1; }

# The same sweep with kube-scheduler's allocator patched by
# bench/upstream/*.patch (a proposal for upstream, docs/scale.md; never
# shipped): bin/bench-scale-patched, results to bench-scale-patched-results.md
# and .csv, the plot to bin/bench-scale-patched.png. BENCH_SCALE_ARGS as for bench-scale.
bench-scale-patched: build helm
	bash hack/patched-bench-scale.sh $(BIN)
	HELM=$(HELM) $(BIN)/bench-scale-patched --controller-binary $(BIN)/gpudra-controller --plugin-binary $(BIN)/gpudra-kubelet-plugin \
		--out bench-scale-patched-results.md --csv bench-scale-patched-results.csv --plot $(BIN)/bench-scale-patched.png \
		$(if $(filter quick,$(BENCH_SCALE)),--quick) $(BENCH_SCALE_ARGS) 2> $(BIN)/bench-scale-patched.log || { tail -20 $(BIN)/bench-scale-patched.log; exit 1; }

# gpudra dashboard on a large fleet (issue 37): devcluster's control plane
# with 1,000 API-only nodes of 8 H100s each (the scale benchmark's migoff
# nodes), half the GPUs held by claims of bound pods, the dashboard's server
# in the benchmark's process and a headless Chromium: first paint (warm and
# cold), where its time goes, the /api/view body, the cards in the DOM, how
# long an allocated or deleted claim takes to show, the dashboard's heap.
# Tables to stdout and bin/bench-dashboard-results.md; the last line is the
# summary; the log goes to bin/bench-dashboard.log. BENCH_DASHBOARD_ARGS:
# e.g. --nodes 300 --runs 9.
bench-dashboard: helm
	@mkdir -p $(BIN)
	cd bench && CGO_ENABLED=0 $(GO) build -o $(abspath $(BIN))/bench-dashboard ./cmd/bench-dashboard
	HELM=$(HELM) $(BIN)/bench-dashboard --out $(BIN)/bench-dashboard-results.md $(BENCH_DASHBOARD_ARGS) 2> $(BIN)/bench-dashboard.log || { tail -20 $(BIN)/bench-dashboard.log; exit 1; }

# The same path on a real GPU (docs/gpu-smoke.md): devcluster with one node
# backed by NVML beside a simulated one; nvidia-smi -L and a CUDA check from
# inside a container with a one-GPU claim and one without; two MPS clients
# of one claim with a memory limit, under the driver's real MPS daemon in
# its own container; the NVML inventory beside the simulator's model; and
# prepare timed on the GPU. Never changes MIG mode, creates MIG devices or
# resets a GPU; refuses GPUs in use. Without a GPU it stops at once. It
# runs the bundle (below) as a GPU node would; results in bin/gpu-smoke-results.
gpu-smoke:
	@test -e /dev/nvidiactl || { echo "gpu-smoke: no NVIDIA GPU here (/dev/nvidiactl does not exist): run it on a machine with an NVIDIA GPU and driver"; exit 1; }
	@$(MAKE) --no-print-directory gpu-smoke-bundle
	RESULTS=$(abspath $(BIN))/gpu-smoke-results $(BUNDLE_DIR)/run.sh

# One tarball with everything gpu-smoke needs on an x86-64 GPU node without
# Go or a network: its binaries (stripped), runc, the probe, the CUDA check,
# the chart rendered ahead (no helm), the simulated mode's stand-ins and
# run.sh. bin/gpu-smoke-bundle.tar.xz; `tar -xJf` it and run ./run.sh as root.
gpu-smoke-bundle: helm probe $(RUNC)
	rm -rf $(BUNDLE_DIR) && mkdir -p $(BUNDLE_DIR)/bin $(BUNDLE_DIR)/stand-ins
	CGO_ENABLED=$(BUNDLE_CGO) $(GO) build -ldflags "-s -w $(LDFLAGS)" -o $(BUNDLE_DIR)/bin/gpudra-kubelet-plugin ./cmd/kubelet-plugin
	cd gpusmoke && CGO_ENABLED=$(BUNDLE_CGO) $(GO) build -ldflags "-s -w" -o $(BUNDLE_DIR)/bin/gpu-smoke ./cmd/gpu-smoke
	CGO_ENABLED=0 $(GO) build -ldflags "-s -w" -o $(BUNDLE_DIR)/bin/gpudra-probe ./cmd/gpudra-probe
	CGO_ENABLED=0 $(GO) build -ldflags "-s -w $(LDFLAGS)" -o $(BUNDLE_DIR)/bin/gpudra-mps-server ./cmd/mps-server
	CGO_ENABLED=0 $(GO) build -ldflags "-s -w" -o $(BUNDLE_DIR)/bin/gpudra-cuda-check ./cmd/gpudra-cuda-check
	cp $(RUNC) $(BUNDLE_DIR)/bin/runc
	$(BUNDLE_DIR)/bin/gpu-smoke --write-rendered-chart $(BUNDLE_DIR)/chart.yaml --chart $(CHART) --helm $(HELM)
	cp $(FAKE_LIBCUDA) $(BUNDLE_DIR)/stand-ins/libcuda.so
	cp hack/fake-nvidia-cuda-mps-control $(BUNDLE_DIR)/stand-ins/nvidia-cuda-mps-control
	cp hack/gpu-smoke/run.sh $(BUNDLE_DIR)/run.sh
	echo "$(VERSION) $(COMMIT)" > $(BUNDLE_DIR)/VERSION
	$(if $(filter 1,$(BUNDLE_TAR)),XZ_OPT=-T0 tar -C $(abspath $(BIN)) -cJf $(BUNDLE_DIR).tar.xz $(BUNDLE_NAME) && ls -l $(BUNDLE_DIR).tar.xz)

# gpudra's image (issue 38; docs/image.md), without Docker or a registry:
# the four binaries for each architecture, glibc from Debian's packages
# pinned in hack/image/debian.lock, an OCI layout with the index of both
# architectures (bin/image/oci) and a docker-loadable tarball per
# architecture (bin/image/gpudra-<version>-<arch>.tar). Reproducible: every
# timestamp is the commit's (SOURCE_DATE_EPOCH), the binaries are built
# with -trimpath and no build id, so the same commit gives the same digest.
IMAGE_DIR ?= $(abspath $(BIN))/image
IMAGE_BUILD = $(IMAGE_DIR)-build
IMAGE_ARCHES := amd64 arm64
SOURCE_DATE_EPOCH ?= $(shell git log -1 --format=%ct 2>/dev/null || echo 0)
IMAGE_LDFLAGS := -s -w -buildid= $(LDFLAGS)
GOHOSTARCH := $(shell $(GO) env GOHOSTARCH)
# The C compiler of an architecture: the host's gcc, else Debian's cross
# compiler, which links against the same glibc release as the host's.
image_cc = $$([ $(1) = $(GOHOSTARCH) ] && echo gcc || { case $(1) in amd64) echo x86_64-linux-gnu-gcc;; arm64) echo aarch64-linux-gnu-gcc;; esac; })

image: cross-cc
	rm -rf $(IMAGE_BUILD)
	@set -e; for arch in $(IMAGE_ARCHES); do \
	  out=$(IMAGE_BUILD)/$$arch; echo "Building the $$arch binaries into $$out"; \
	  export GOOS=linux GOARCH=$$arch; cc=$(call image_cc,$$arch); \
	  CGO_ENABLED=1 CC=$$cc $(GO) build -trimpath -buildvcs=false -ldflags "$(IMAGE_LDFLAGS)" -o $$out/gpudra-kubelet-plugin ./cmd/kubelet-plugin; \
	  CGO_ENABLED=1 CC=$$cc $(GO) build -trimpath -buildvcs=false -ldflags "$(IMAGE_LDFLAGS)" -o $$out/gpudra ./cmd/gpudra; \
	  CGO_ENABLED=0 $(GO) build -trimpath -buildvcs=false -ldflags "$(IMAGE_LDFLAGS)" -o $$out/gpudra-controller ./cmd/controller; \
	  CGO_ENABLED=0 $(GO) build -trimpath -buildvcs=false -ldflags "$(IMAGE_LDFLAGS)" -o $$out/gpudra-mps-server ./cmd/mps-server; \
	done
	CGO_ENABLED=0 $(GO) run ./hack/image --out $(IMAGE_DIR) --bin $(IMAGE_BUILD) --arches $(subst $(eval) ,$(comma),$(IMAGE_ARCHES)) \
		--cache $(abspath $(BIN))/debian-cache --version $(VERSION) --revision $(COMMIT) --source-date-epoch $(SOURCE_DATE_EPOCH)

# Debian's cross compilers for the architectures that are not the host's,
# installed where missing (as browser installs chromium).
cross-cc:
	@for arch in $(filter-out $(GOHOSTARCH),$(IMAGE_ARCHES)); do \
	  cc=$(call image_cc,$$arch); \
	  command -v $$cc >/dev/null && continue; \
	  pkg=gcc-$$(echo $${cc%-gcc} | tr _ -); echo "Installing Debian's $$pkg for the $$arch binaries' cgo."; \
	  SUDO=; [ "$$(id -u)" = 0 ] || SUDO=sudo; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$pkg >/dev/null || exit 1; \
	done

# make image twice, into two directories, binaries included: the same index
# digest and the same tarballs, byte for byte; then the tarballs as docker
# load would read them (hack/image's TestImageTarballs). Both builds get
# this one's version, so that an edit in between (git describe's -dirty)
# is not taken for the recipe's nondeterminism.
IMAGE_PIN = VERSION=$(VERSION) COMMIT=$(COMMIT) SOURCE_DATE_EPOCH=$(SOURCE_DATE_EPOCH)
test-image:
	@$(MAKE) --no-print-directory image IMAGE_DIR=$(abspath $(BIN))/image-check-a $(IMAGE_PIN)
	@$(MAKE) --no-print-directory image IMAGE_DIR=$(abspath $(BIN))/image-check-b $(IMAGE_PIN)
	@a=$$(grep -o 'sha256:[0-9a-f]*' $(BIN)/image-check-a/oci/index.json); b=$$(grep -o 'sha256:[0-9a-f]*' $(BIN)/image-check-b/oci/index.json); \
	  echo "index digests of two builds: $$a $$b"; [ -n "$$a" ] && [ "$$a" = "$$b" ] || { echo "make image is not reproducible"; exit 1; }; \
	  for arch in $(IMAGE_ARCHES); do cmp $(BIN)/image-check-a/gpudra-$(VERSION)-$$arch.tar $(BIN)/image-check-b/gpudra-$(VERSION)-$$arch.tar || exit 1; done
	GPUDRA_IMAGE_DIR=$(abspath $(BIN))/image-check-a GPUDRA_IMAGE_VERSION=$(VERSION) CGO_ENABLED=0 $(GO) test -count=1 -run '^TestImageTarballs$$' ./hack/image/

clean:
	rm -rf $(BIN)
