//go:build !cgo || !linux

package nvml

import (
	"context"
	"fmt"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

// New fails: NVML needs cgo on Linux, and this binary was built without it.
// A missing driver is still reported as such (wrapping
// nvdevice.ErrLibraryNotFound), since that is the more useful message.
func New(_ context.Context, opts Options) (nvdevice.Interface, error) {
	if _, err := FindLibrary(opts); err != nil {
		return nil, err
	}
	return nil, fmt.Errorf("this gpudra binary was built without cgo (or not for Linux) and cannot load NVML; use a cgo build, or --backend sim")
}
