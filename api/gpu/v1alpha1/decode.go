package v1alpha1

import (
	"errors"
	"fmt"
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
}

// Validate checks the config; all problems are reported at once.
func (c *GpuConfig) Validate() error {
	var errs field.ErrorList
	if c.APIVersion != APIVersion {
		errs = append(errs, field.Invalid(field.NewPath("apiVersion"), c.APIVersion, "must be "+APIVersion))
	}
	if c.Kind != Kind {
		errs = append(errs, field.Invalid(field.NewPath("kind"), c.Kind, "must be "+Kind))
	}
	if c.Sharing != nil {
		p := field.NewPath("sharing", "strategy")
		// TimeSlicing and MPS are refused until the plugin enforces them.
		if s := c.Sharing.Strategy; s != "" && s != Exclusive {
			errs = append(errs, field.NotSupported(p, s, []string{string(Exclusive)}))
		}
	}
	if len(errs) == 0 {
		return nil
	}
	return fmt.Errorf("invalid GpuConfig: %w", errors.Join(errs.ToAggregate()))
}
