package plugin

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"slices"
	"sync"
	"time"

	"k8s.io/klog/v2"
	cdispec "tags.cncf.io/container-device-interface/specs-go"

	"github.com/gpudra/gpudra/pkg/cdi"
	"github.com/gpudra/gpudra/pkg/nvdevice"
)

// driverSpec keeps the node's common CDI spec (the driver's user-space
// files, cdi.BuildDriverSpec) in step with the driver under the driver
// root: written at start, rewritten when what the backend discovers
// changes (a driver upgrade).
type driverSpec struct {
	backend nvdevice.DriverFiler
	writer  *cdi.Writer
	opts    cdi.DriverOptions

	mu      sync.Mutex
	written *cdispec.Spec // nil: none written (no driver root)
}

// driverSpecEvery spaces the checks for a driver upgrade.
const driverSpecEvery = time.Minute

// sync discovers the driver's files and writes the common spec if it
// changed; it reports whether it wrote. A backend without a driver root
// (a simulated machine given none) is no error: there is no common spec,
// and prepared devices do not reference one.
func (s *driverSpec) sync(ctx context.Context) (bool, error) {
	files, err := s.backend.DriverFiles(ctx)
	if errors.Is(err, nvdevice.ErrNotFound) {
		s.mu.Lock()
		had := s.written != nil
		s.mu.Unlock()
		if !had {
			klog.FromContext(ctx).Info("No driver files found: containers get no driver libraries from the CDI spec", "reason", err.Error())
			return false, nil
		}
	}
	if err != nil {
		return false, fmt.Errorf("the driver's user-space files: %w", err)
	}
	spec, err := cdi.BuildDriverSpec(files, s.opts)
	if err != nil {
		return false, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.written != nil && reflect.DeepEqual(s.written, spec) {
		return false, nil
	}
	if err := s.writer.WriteDriver(spec); err != nil {
		return false, err
	}
	klog.FromContext(ctx).Info("Wrote the driver's CDI spec", "driverVersion", files.Version, "root", files.Root, "mounts", len(spec.Devices[0].ContainerEdits.Mounts))
	s.written = spec
	return true, nil
}

// refresh is sync for the periodic check: errors are logged, the spec
// written before stays.
func (s *driverSpec) refresh(ctx context.Context) {
	if _, err := s.sync(ctx); err != nil {
		klog.FromContext(ctx).Error(err, "Updating the driver's CDI spec failed; the one written before stays")
	}
}

// deviceIDs are the CDI ids of one prepared device as the kubelet gets
// them: the claim's device and the common driver device.
func (s *driverSpec) deviceIDs(ids []string) []string {
	if s == nil {
		return ids
	}
	s.mu.Lock()
	written := s.written != nil
	s.mu.Unlock()
	if !written || slices.Contains(ids, cdi.DriverDeviceID) {
		return ids
	}
	return append(slices.Clone(ids), cdi.DriverDeviceID)
}
