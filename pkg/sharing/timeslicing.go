package sharing

import (
	"context"
	"errors"
	"fmt"
	"slices"

	"k8s.io/klog/v2"

	gpuapi "github.com/gpudra/gpudra/api/gpu/v1alpha1"
	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/prepared"
)

// TimeSlicer sets a GPU's time slice: the backend's compute policy
// (nvdevice.Host).
type TimeSlicer = nvdevice.ComputePolicy

// TimeSliceLevel is nvidia-smi's number for an interval.
func TimeSliceLevel(i gpuapi.TimeSliceInterval) (int, error) {
	if i == "" {
		return 0, nil
	}
	level := slices.Index(gpuapi.TimeSliceIntervals, i)
	if level < 0 {
		return 0, fmt.Errorf("unknown time slice interval %q", i)
	}
	return level, nil
}

// timeSlicing sets the time slice of the claim's GPUs. The setting belongs
// to the GPU, so it is restored to the default only when no prepared claim
// on that GPU asks for time-slicing any more.
type timeSlicing struct{ policy TimeSlicer }

func (t *timeSlicing) Prepare(ctx context.Context, c prepared.Claim) (Edits, error) {
	if t.policy == nil {
		return Edits{}, errors.New("this node cannot set time slices (no compute policy backend)")
	}
	for _, d := range c.Devices {
		if d.Mig {
			return Edits{}, fmt.Errorf("device %s is a MIG device (or a whole GPU in MIG mode, served as its largest instance): time-slicing applies to GPUs in MIG mode off (processes on one MIG device already take turns)", d.Device)
		}
	}
	interval := gpuapi.DefaultTimeSlice
	if cfg := c.SharingConfig(); cfg.TimeSlicing != nil && cfg.TimeSlicing.Interval != "" {
		interval = cfg.TimeSlicing.Interval
	}
	level, err := TimeSliceLevel(interval)
	if err != nil {
		return Edits{}, err
	}
	for _, gpu := range c.GPUs() {
		if err := t.policy.SetTimeSlice(ctx, gpu, level); err != nil {
			return Edits{}, fmt.Errorf("GPU %s: set time slice %s: %w", gpu, interval, err)
		}
		klog.FromContext(ctx).V(2).Info("Time slice set", "gpu", gpu, "interval", interval, "claim", klog.KRef(c.Namespace, c.Name))
	}
	return Edits{}, nil
}

func (t *timeSlicing) Unprepare(ctx context.Context, c prepared.Claim, others []prepared.Claim) error {
	if t.policy == nil {
		return nil
	}
	for _, gpu := range c.GPUs() {
		if stillTimeSliced(gpu, others) {
			continue
		}
		if err := t.policy.SetTimeSlice(ctx, gpu, 0); err != nil {
			return fmt.Errorf("GPU %s: restore the default time slice: %w", gpu, err)
		}
		klog.FromContext(ctx).V(2).Info("Time slice restored to the default", "gpu", gpu)
	}
	return nil
}

func stillTimeSliced(gpu string, others []prepared.Claim) bool {
	for _, o := range others {
		if o.Strategy() == gpuapi.TimeSlicing && slices.Contains(o.GPUs(), gpu) {
			return true
		}
	}
	return false
}
