//go:build cgo

package nvml

import (
	"fmt"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

// nvmlError wraps an NVML return code in the model's sentinel errors, so
// callers can react without knowing the backend.
type nvmlError struct {
	op  string
	ret nvml.Return
}

func (e *nvmlError) Error() string { return fmt.Sprintf("%s: %s", e.op, e.ret.Error()) }

func (e *nvmlError) Unwrap() error {
	switch e.ret {
	case nvml.ERROR_INSUFFICIENT_RESOURCES:
		return nvdevice.ErrInsufficientResources
	case nvml.ERROR_INVALID_ARGUMENT:
		return nvdevice.ErrInvalidPlacement
	case nvml.ERROR_NOT_FOUND:
		return nvdevice.ErrNotFound
	case nvml.ERROR_GPU_IS_LOST:
		return nvdevice.ErrGPULost
	case nvml.ERROR_IN_USE:
		return nvdevice.ErrInUse
	case nvml.ERROR_LIBRARY_NOT_FOUND:
		return nvdevice.ErrLibraryNotFound
	}
	return nil
}

// check turns a non-success return into an error.
func check(ret nvml.Return, op string, args ...any) error {
	if ret == nvml.SUCCESS {
		return nil
	}
	return &nvmlError{op: fmt.Sprintf(op, args...), ret: ret}
}
