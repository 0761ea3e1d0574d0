# The gpudra image: gpudra-kubelet-plugin and the gpudra CLI.
# Not built by CI: this project's machines have no Docker engine. The chart's
# default image is ghcr.io/gpudra/gpudra:<appVersion>; test/kind builds this
# file as ghcr.io/gpudra/gpudra:dev.
FROM golang:1.26 AS build
ARG VERSION=dev
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
# NVML is reached through cgo (dlopen of the host's libnvidia-ml.so.1 at run time).
ENV CGO_ENABLED=1 CGO_CFLAGS="-O2 -g -Wno-deprecated-declarations"
RUN go build -ldflags "-X github.com/gpudra/gpudra/internal/version.Version=${VERSION}" -o /out/gpudra-kubelet-plugin ./cmd/kubelet-plugin && \
    go build -ldflags "-X github.com/gpudra/gpudra/internal/version.Version=${VERSION}" -o /out/gpudra ./cmd/gpudra

# glibc is needed to dlopen the driver's library; no NVIDIA library is in the
# image: it comes from the host's driver root (--driver-root).
FROM debian:bookworm-slim
COPY --from=build /out/gpudra-kubelet-plugin /out/gpudra /usr/bin/
ENTRYPOINT ["/usr/bin/gpudra-kubelet-plugin"]
