//go:build cgo && linux

package nvml

import (
	"fmt"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

// nvmlError is a failed NVML call. It unwraps to the model's sentinel error
// for the return code (so callers react without knowing the backend) and to
// the nvml.Return itself (so errors.Is(err, nvml.ERROR_NO_PERMISSION) works).
type nvmlError struct {
	op  string
	ret nvml.Return
	// placement: INVALID_ARGUMENT means a placement the profile does not
	// allow. Elsewhere it is a plain bad argument, not a placement error.
	placement bool
}

func (e *nvmlError) Error() string { return fmt.Sprintf("%s: %s", e.op, e.ret.Error()) }

func (e *nvmlError) Unwrap() []error {
	if s := e.sentinel(); s != nil {
		return []error{s, e.ret}
	}
	return []error{e.ret}
}

func (e *nvmlError) sentinel() error {
	switch e.ret {
	case nvml.ERROR_INSUFFICIENT_RESOURCES:
		return nvdevice.ErrInsufficientResources
	case nvml.ERROR_INVALID_ARGUMENT:
		if e.placement {
			return nvdevice.ErrInvalidPlacement
		}
	case nvml.ERROR_NOT_FOUND:
		return nvdevice.ErrNotFound
	case nvml.ERROR_GPU_IS_LOST:
		return nvdevice.ErrGPULost
	case nvml.ERROR_IN_USE:
		return nvdevice.ErrInUse
	case nvml.ERROR_LIBRARY_NOT_FOUND:
		return nvdevice.ErrLibraryNotFound
	case nvml.ERROR_DRIVER_NOT_LOADED:
		return nvdevice.ErrDriverNotLoaded
	}
	return nil
}

// check turns a non-success return into an error; op is a format string
// naming what was attempted.
func check(ret nvml.Return, op string, args ...any) error {
	if ret == nvml.SUCCESS {
		return nil
	}
	return &nvmlError{op: fmt.Sprintf(op, args...), ret: ret}
}

// checkPlacement is check for the calls that take a placement, where
// INVALID_ARGUMENT means the placement is not one the profile allows.
func checkPlacement(ret nvml.Return, op string, args ...any) error {
	if ret == nvml.SUCCESS {
		return nil
	}
	return &nvmlError{op: fmt.Sprintf(op, args...), ret: ret, placement: true}
}
