package plugin

import (
	"errors"
	"fmt"

	"k8s.io/component-base/featuregate"

	gpuapi "github.com/gpudra/gpudra/api/gpu/v1alpha1"
	"github.com/gpudra/gpudra/pkg/features"
)

// CheckFeatures refuses a configuration that needs a feature gate that is
// off (docs/feature-gates.md). Start calls it first; cmd/kubelet-plugin
// calls it with its other flag checks, before it opens the GPUs.
func (c Config) CheckFeatures() error {
	if !c.FractionalGPUs {
		return nil
	}
	// Every share smaller than its GPU is capped with MPS.
	var errs []error
	for _, f := range []featuregate.Feature{features.FractionalGPUs, features.MPSSharing} {
		if err := features.Require(c.FeatureGates, f); err != nil {
			errs = append(errs, err)
		}
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("fractional GPUs (--fractional-gpus): %w", err)
	}
	return nil
}

// claimFeatures refuses a claim whose preparation needs a feature gate that
// is off. Prepare calls it before any side effect; claims prepared before a
// gate was turned off keep their record, and unprepare works for them as
// before: a gate stops new uses, it never strands old ones.
func claimFeatures(gates featuregate.FeatureGate, sharing *gpuapi.Sharing, plan []PlannedDevice) error {
	var errs []error
	if sharing != nil {
		switch sharing.Strategy {
		case gpuapi.MPS:
			if err := features.Require(gates, features.MPSSharing); err != nil {
				errs = append(errs, fmt.Errorf("sharing.strategy MPS (also the cap of a GPU share): %w", err))
			}
		case gpuapi.TimeSlicing:
			if err := features.Require(gates, features.TimeSlicing); err != nil {
				errs = append(errs, fmt.Errorf("sharing.strategy TimeSlicing: %w", err))
			}
		}
	}
	for _, p := range plan {
		if p.Mig == nil || p.Mig.Existing != nil {
			continue
		}
		if err := features.Require(gates, features.DynamicMIG); err != nil {
			errs = append(errs, fmt.Errorf("device %s needs a MIG instance created: %w", p.Device, err))
			break
		}
	}
	return errors.Join(errs...)
}
