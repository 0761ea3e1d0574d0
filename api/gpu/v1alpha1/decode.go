package v1alpha1

import (
	"errors"
	"fmt"
	"slices"
	"strings"

	"k8s.io/apimachinery/pkg/util/validation/field"
	"sigs.k8s.io/json"
)

// Decode parses an opaque config strictly and validates it. Errors name the
// field: `sharing.strategy: Unsupported value: "Fast"`.
func Decode(raw []byte) (*GpuConfig, error) {
	var c GpuConfig
	strictErrs, err := json.UnmarshalStrict(raw, &c, json.DisallowDuplicateFields, json.DisallowUnknownFields)
	if err != nil {
		return nil, fmt.Errorf("decode GpuConfig: %w", err)
	}
	if len(strictErrs) > 0 {
		msgs := make([]string, 0, len(strictErrs))
		for _, e := range strictErrs {
			msgs = append(msgs, e.Error())
		}
		return nil, fmt.Errorf("decode GpuConfig: %s", strings.Join(msgs, "; "))
	}
	if err := c.Validate(); err != nil {
		return nil, err
	}
	c.Default()
	return &c, nil
}

// Default fills what an empty config means.
func (c *GpuConfig) Default() {
	if c.Sharing == nil {
		c.Sharing = &Sharing{}
	}
	if c.Sharing.Strategy == "" {
		c.Sharing.Strategy = Exclusive
	}
	if c.Sharing.Strategy == TimeSlicing {
		if c.Sharing.TimeSlicing == nil {
			c.Sharing.TimeSlicing = &TimeSlicingConfig{}
		}
		if c.Sharing.TimeSlicing.Interval == "" {
			c.Sharing.TimeSlicing.Interval = DefaultTimeSlice
		}
	}
	if c.Sharing.Strategy == MPS && c.Sharing.MPS == nil {
		c.Sharing.MPS = &MPSConfig{}
	}
}

// Validate checks the config on its own; all problems are reported at once.
// The plugin and the admission webhook share it.
func (c *GpuConfig) Validate() error {
	errs := c.validate()
	if len(errs) == 0 {
		return nil
	}
	return fmt.Errorf("invalid GpuConfig: %w", errors.Join(errs.ToAggregate()))
}

// DeviceFacts are what validation needs to know of a device the config is
// applied to.
type DeviceFacts struct {
	Name        string
	MemoryBytes int64
}

// ValidateForDevice checks the config against a device it is applied to:
// limits above what the device has are refused.
func (c *GpuConfig) ValidateForDevice(d DeviceFacts) error {
	errs := c.validate()
	if s := c.Sharing; s != nil && s.MPS != nil && s.MPS.PinnedMemoryLimit != nil && d.MemoryBytes > 0 {
		if s.MPS.PinnedMemoryLimit.Value() > d.MemoryBytes {
			errs = append(errs, field.Invalid(field.NewPath("sharing", "mps", "pinnedMemoryLimit"), s.MPS.PinnedMemoryLimit.String(),
				fmt.Sprintf("exceeds the memory of device %s (%dMi)", d.Name, d.MemoryBytes>>20)))
		}
	}
	if len(errs) == 0 {
		return nil
	}
	return fmt.Errorf("invalid GpuConfig: %w", errors.Join(errs.ToAggregate()))
}

// ShareBounds are what the scheduler let one share of a GPU consume
// (consumable capacity): its memory, its multiprocessors, and the whole
// GPU's multiprocessors, to turn the share into a thread percentage.
type ShareBounds struct {
	// Device names the GPU in errors.
	Device             string
	MemoryBytes        int64
	Multiprocessors    int64
	GPUMultiprocessors int64
}

// MaxThreadPercentage is the share's multiprocessors as a percentage of the
// GPU's, rounded up (the share may use the SMs it was given, and no more);
// 0 when the share consumed no multiprocessors (then it has no compute
// bound: it time-shares every SM, and any percentage is accepted).
func (b ShareBounds) MaxThreadPercentage() int64 {
	if b.Multiprocessors <= 0 || b.GPUMultiprocessors <= 0 {
		return 0
	}
	return min((b.Multiprocessors*100+b.GPUMultiprocessors-1)/b.GPUMultiprocessors, 100)
}

// ValidateForShare checks the config against one share of a GPU that
// several claims use: a share may not change what belongs to the whole GPU
// or escape its bounds, so TimeSlicing (a property of the GPU), an active
// thread percentage above the share's multiprocessors and a pinned memory
// limit above the share's memory are refused, by field. The plugin calls it
// at prepare; the admission webhook cannot (the share is allocated after
// admission) and checks only Validate.
func (c *GpuConfig) ValidateForShare(b ShareBounds) error {
	errs := c.validate()
	if s := c.Sharing; s != nil {
		p := field.NewPath("sharing")
		if s.Strategy == TimeSlicing {
			errs = append(errs, field.Forbidden(p.Child("strategy"), fmt.Sprintf(
				"%s is not allowed on a share of device %s: the time slice is a setting of the whole GPU, which other claims' shares use", TimeSlicing, b.Device)))
		}
		if s.MPS != nil {
			mp := p.Child("mps")
			if a := s.MPS.ActiveThreadPercentage; a != nil && *a >= 1 {
				if limit := b.MaxThreadPercentage(); limit > 0 && int64(*a) > limit {
					errs = append(errs, field.Invalid(mp.Child("activeThreadPercentage"), *a, fmt.Sprintf(
						"exceeds the share of device %s (%d of %d multiprocessors: at most %d)", b.Device, b.Multiprocessors, b.GPUMultiprocessors, limit)))
				}
			}
			if l := s.MPS.PinnedMemoryLimit; l != nil && b.MemoryBytes > 0 && l.Value() > b.MemoryBytes {
				errs = append(errs, field.Invalid(mp.Child("pinnedMemoryLimit"), l.String(), fmt.Sprintf(
					"exceeds the share of device %s (%dMi)", b.Device, b.MemoryBytes>>20)))
			}
		}
	}
	if len(errs) == 0 {
		return nil
	}
	return fmt.Errorf("invalid GpuConfig: %w", errors.Join(errs.ToAggregate()))
}

func (c *GpuConfig) validate() field.ErrorList {
	var errs field.ErrorList
	if c.APIVersion != APIVersion {
		errs = append(errs, field.Invalid(field.NewPath("apiVersion"), c.APIVersion, "must be "+APIVersion))
	}
	if c.Kind != Kind {
		errs = append(errs, field.Invalid(field.NewPath("kind"), c.Kind, "must be "+Kind))
	}
	if c.Sharing != nil {
		errs = append(errs, validateSharing(c.Sharing, field.NewPath("sharing"))...)
	}
	return errs
}

func validateSharing(s *Sharing, p *field.Path) field.ErrorList {
	var errs field.ErrorList
	strategy := s.Strategy
	if strategy == "" {
		strategy = Exclusive
	}
	switch strategy {
	case Exclusive, TimeSlicing, MPS:
	default:
		errs = append(errs, field.NotSupported(p.Child("strategy"), s.Strategy, []string{string(Exclusive), string(TimeSlicing), string(MPS)}))
	}
	if s.TimeSlicing != nil {
		tp := p.Child("timeSlicing")
		if strategy != TimeSlicing {
			errs = append(errs, field.Forbidden(tp, fmt.Sprintf("only with strategy %s, not %s", TimeSlicing, strategy)))
		}
		if i := s.TimeSlicing.Interval; i != "" && !slices.Contains(TimeSliceIntervals, i) {
			valid := make([]string, 0, len(TimeSliceIntervals))
			for _, v := range TimeSliceIntervals {
				valid = append(valid, string(v))
			}
			errs = append(errs, field.NotSupported(tp.Child("interval"), i, valid))
		}
	}
	if s.MPS != nil {
		mp := p.Child("mps")
		if strategy != MPS {
			errs = append(errs, field.Forbidden(mp, fmt.Sprintf("only with strategy %s, not %s: MPS limits mean nothing without an MPS daemon", MPS, strategy)))
		}
		if a := s.MPS.ActiveThreadPercentage; a != nil && (*a < 1 || *a > 100) {
			errs = append(errs, field.Invalid(mp.Child("activeThreadPercentage"), *a, "must be between 1 and 100"))
		}
		if l := s.MPS.PinnedMemoryLimit; l != nil && l.Sign() <= 0 {
			errs = append(errs, field.Invalid(mp.Child("pinnedMemoryLimit"), l.String(), "must be positive"))
		}
	}
	return errs
}
