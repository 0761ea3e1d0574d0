//go:build cgo

package main

import (
	"context"

	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/nvdevice/nvml"
)

// openNVML opens the real GPUs; only a cgo build has NVML.
func openNVML(ctx context.Context, driverRoot string) (nvdevice.Interface, func(), error) {
	backend, err := nvml.New(ctx, nvml.Options{DriverRoot: driverRoot})
	if err != nil {
		return nil, nil, err
	}
	return backend, func() { _ = backend.Close() }, nil
}
