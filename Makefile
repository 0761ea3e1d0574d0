# gpudra: build, test and demo. See README.md.
SHELL := /bin/bash
GO ?= go
export PATH := $(PATH):/usr/local/go/bin:$(HOME)/go/bin
# The header of go-nvml marks many functions deprecated; the warnings are noise.
export CGO_CFLAGS ?= -O2 -g -Wno-deprecated-declarations

VERSION ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
LDFLAGS := -X github.com/gpudra/gpudra/internal/version.Version=$(VERSION)
BIN := bin

# Everything but the NVML backend builds and tests without cgo.
NVML_PKG := ./pkg/nvdevice/nvml/...
PURE_PKGS = $(shell $(GO) list ./... | grep -v /pkg/nvdevice/nvml)
FUZZTIME ?= 100000x

.PHONY: all build test test-unit test-nvml test-fuzz lint fmt bench demo clean
all: build

build:
	@mkdir -p $(BIN)
	$(GO) build -ldflags "$(LDFLAGS)" -o $(BIN)/gpudra ./cmd/gpudra
	$(GO) build -ldflags "$(LDFLAGS)" -o $(BIN)/gpudra-kubelet-plugin ./cmd/kubelet-plugin
	CGO_ENABLED=0 $(GO) build ./...

test: lint test-unit test-nvml test-fuzz

test-unit:
	CGO_ENABLED=0 $(GO) test -count=1 $(PURE_PKGS)

test-nvml:
	CGO_ENABLED=1 $(GO) test -count=1 $(NVML_PKG)

# Bounded fuzzing of every parser of untrusted input: zero panics allowed.
test-fuzz:
	CGO_ENABLED=0 $(GO) test -run '^$$' -fuzz '^FuzzUnmarshal$$' -fuzztime $(FUZZTIME) ./pkg/plugin/checkpoint/
	CGO_ENABLED=0 $(GO) test -run '^$$' -fuzz '^FuzzDecode$$' -fuzztime $(FUZZTIME) ./api/gpu/v1alpha1/
	CGO_ENABLED=0 $(GO) test -run '^$$' -fuzz '^FuzzParseSpec$$' -fuzztime $(FUZZTIME) ./pkg/nvdevice/sim/

lint:
	@unformatted=$$(gofmt -l $$(git ls-files --cached --others --exclude-standard '*.go')); \
	  if [ -n "$$unformatted" ]; then echo "gofmt needed: $$unformatted"; exit 1; fi
	CGO_ENABLED=0 $(GO) vet $(PURE_PKGS)
	CGO_ENABLED=1 $(GO) vet $(NVML_PKG)

fmt:
	gofmt -w $$(git ls-files '*.go')

bench:
	CGO_ENABLED=0 $(GO) test -run '^$$' -bench . -benchmem $(PURE_PKGS)

# Until devcluster exists the demo shows what a simulated DGX H100 node has
# and what it would publish.
demo:
	@echo "devcluster is not built yet: showing a simulated DGX H100 node instead."
	CGO_ENABLED=0 $(GO) run ./cmd/gpudra inventory --backend sim --machine dgx-h100 --node-name demo-node
	CGO_ENABLED=0 $(GO) run ./cmd/gpudra slices --backend sim --machine dgx-h100 --node-name demo-node -o table | tail -n 30

clean:
	rm -rf $(BIN)
