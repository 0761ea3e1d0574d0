//go:build cgo && linux

package nvml

import (
	"sync"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"k8s.io/klog/v2"
)

// absent says whether an optional call's return means that the feature is
// not there: the GPU lacks it (NOT_SUPPORTED) or the driver predates the
// call (FUNCTION_NOT_FOUND, what NVML and go-nvml answer for a function the
// loaded libnvidia-ml does not have). The feature is then off, never an
// error: an older driver must not fail discovery. The first
// FUNCTION_NOT_FOUND of each call is logged, once per process (so without
// a caller's context: the discovery paths that meet it have none).
func absent(ret nvml.Return, call string) bool {
	switch ret {
	case nvml.ERROR_NOT_SUPPORTED:
		return true
	case nvml.ERROR_FUNCTION_NOT_FOUND:
		if _, logged := missingCalls.LoadOrStore(call, true); !logged {
			klog.Background().Info("The NVML library lacks a call (a driver older than this feature); the feature is off", "call", call)
		}
		return true
	}
	return false
}

// missingCalls are the calls absent logged as missing from the library.
var missingCalls sync.Map
