//go:build !cgo

package nvml

import (
	"context"
	"fmt"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

// New fails: this binary was built without cgo, which NVML needs.
func New(_ context.Context, opts Options) (nvdevice.Interface, error) {
	if _, err := FindLibrary(opts); err != nil {
		return nil, err
	}
	return nil, fmt.Errorf("this gpudra binary was built without cgo and cannot load NVML; use a cgo build or --backend sim")
}
