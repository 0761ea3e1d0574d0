# The gpudra image: gpudra-kubelet-plugin, gpudra-controller (the cluster side:
# controllers and admission webhook), gpudra-mps-server (the main process of
# MPS server pods) and the gpudra CLI.
# Not built by CI: this project's machines have no Docker engine, so this file
# has never been built by the project. The chart's default image is
# ghcr.io/gpudra/gpudra:<appVersion>; test/kind builds this file as
# ghcr.io/gpudra/gpudra:dev.
#
#   docker build --build-arg VERSION=$(git describe --tags --always --dirty) \
#     --build-arg COMMIT=$(git rev-parse HEAD) -t ghcr.io/gpudra/gpudra:dev .

# The build stage is bookworm, like the runtime stage, so the binaries need no
# newer glibc than the runtime image has.
FROM golang:1.26-bookworm AS build
ARG VERSION=dev
# The commit every binary prints with --version and logs at start.
ARG COMMIT=unknown
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
# Only what the two commands import (BuildKit then sends only these from the
# context, not bin/ or devcluster/).
COPY api ./api
COPY cmd ./cmd
COPY internal ./internal
COPY pkg ./pkg
# NVML is reached through cgo (dlopen of the host's libnvidia-ml.so.1 at run
# time); go-nvml's header marks many functions deprecated, hence the flag.
ENV CGO_ENABLED=1 CGO_CFLAGS="-O2 -g -Wno-deprecated-declarations"
ENV LDFLAGS="-X github.com/gpudra/gpudra/internal/version.Version=${VERSION} -X github.com/gpudra/gpudra/internal/version.Commit=${COMMIT}"
RUN go build -ldflags "${LDFLAGS}" -o /out/gpudra-kubelet-plugin ./cmd/kubelet-plugin && \
    go build -ldflags "${LDFLAGS}" -o /out/gpudra ./cmd/gpudra && \
    CGO_ENABLED=0 go build -ldflags "${LDFLAGS}" -o /out/gpudra-mps-server ./cmd/mps-server && \
    CGO_ENABLED=0 go build -ldflags "${LDFLAGS}" -o /out/gpudra-controller ./cmd/controller

# glibc is needed to dlopen the driver's library. No NVIDIA library is in the
# image: NVML, nvidia-smi and nvidia-cuda-mps-control come from the host's
# driver root, mounted at /driver-root by the chart (--driver-root).
FROM debian:bookworm-slim
COPY --from=build /out/gpudra-kubelet-plugin /out/gpudra /out/gpudra-mps-server /out/gpudra-controller /usr/bin/
ENTRYPOINT ["/usr/bin/gpudra-kubelet-plugin"]
