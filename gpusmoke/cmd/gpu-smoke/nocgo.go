//go:build !cgo

package main

import (
	"context"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

// openNVML is nil without cgo: NVML needs it, and gpu-smoke then runs
// only --simulated (the e2e suite builds it so, without a second build of
// Kubernetes with cgo).
var openNVML func(ctx context.Context, driverRoot string) (nvdevice.Interface, func(), error)
