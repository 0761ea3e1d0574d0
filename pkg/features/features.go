// Package features lists gpudra's feature gates (--feature-gates) and their
// maturity. docs/feature-gates.md explains each one.
//
// Maturity follows Kubernetes: an Alpha gate is off by default and may
// change or go; a Beta gate is on by default and can be turned off when it
// misbehaves. Nothing gpudra does has run on a real H100 yet (docs/install.md),
// so no gate is GA: the gates below are the features that have run only on
// the simulator, end to end in devcluster. They are Beta because the demo
// and the e2e suite use them; each gate is a switch to turn one feature off
// on a cluster where it misbehaves, without touching the others.
package features

import (
	"fmt"
	"sort"

	"k8s.io/component-base/featuregate"
)

const (
	// MPSSharing lets claims share a GPU through an MPS server
	// (sharing.strategy MPS), and caps shares of fractional GPUs with MPS.
	// Off: such claims are refused at prepare; unprepare still works.
	MPSSharing featuregate.Feature = "MPSSharing"

	// TimeSlicing lets claims set a GPU's time slice (sharing.strategy
	// TimeSlicing, through nvidia-smi). Off: such claims are refused at
	// prepare.
	TimeSlicing featuregate.Feature = "TimeSlicing"

	// FractionalGPUs allows --fractional-gpus: whole GPUs published as
	// shareable through consumable capacity, each share capped with MPS
	// (so it needs MPSSharing too). Off: --fractional-gpus fails the start.
	FractionalGPUs featuregate.Feature = "FractionalGPUs"

	// DynamicMIG creates MIG instances at prepare for allocated MIG
	// placements (and whole GPUs in MIG mode). Off: such claims are
	// refused at prepare; MIG devices that exist (created with nvidia-smi)
	// are still served.
	DynamicMIG featuregate.Feature = "DynamicMIG"

	// DeviceHealth watches GPU health (XID events, GPUs that fall off the
	// bus) and taints the devices of unhealthy GPUs. Off: no health watch,
	// no taints, and taints recorded before are not restored.
	DeviceHealth featuregate.Feature = "DeviceHealth"
)

// specs are the gates with their maturity and default.
var specs = map[featuregate.Feature]featuregate.FeatureSpec{
	MPSSharing:     {Default: true, PreRelease: featuregate.Beta},
	TimeSlicing:    {Default: true, PreRelease: featuregate.Beta},
	FractionalGPUs: {Default: true, PreRelease: featuregate.Beta},
	DynamicMIG:     {Default: true, PreRelease: featuregate.Beta},
	DeviceHealth:   {Default: true, PreRelease: featuregate.Beta},
}

// New returns a gate with gpudra's features at their defaults. Each binary
// makes its own (no package-level state), so that tests and devcluster's
// in-process plugins can each have theirs.
func New() featuregate.MutableVersionedFeatureGate {
	g := featuregate.NewFeatureGate()
	if err := g.Add(specs); err != nil {
		// The specs are constants of this package.
		panic(err)
	}
	return g
}

// Enabled says whether f is on in g; a nil g has every gate at its default
// (callers that build a plugin without flags, such as devcluster).
func Enabled(g featuregate.FeatureGate, f featuregate.Feature) bool {
	if g == nil {
		return specs[f].Default
	}
	return g.Enabled(f)
}

// DisabledError says that a feature was asked for while its gate is off.
type DisabledError struct {
	Feature featuregate.Feature
}

func (e *DisabledError) Error() string {
	return fmt.Sprintf("feature gate %s is disabled (--feature-gates=%s=true turns it on)", e.Feature, e.Feature)
}

// Require returns a *DisabledError when f is off in g.
func Require(g featuregate.FeatureGate, f featuregate.Feature) error {
	if !Enabled(g, f) {
		return &DisabledError{Feature: f}
	}
	return nil
}

// All are gpudra's gates, sorted, for docs and tests.
func All() []featuregate.Feature {
	out := make([]featuregate.Feature, 0, len(specs))
	for f := range specs {
		out = append(out, f)
	}
	sort.Slice(out, func(i, j int) bool { return out[i] < out[j] })
	return out
}

// Spec is the maturity and default of f.
func Spec(f featuregate.Feature) (featuregate.FeatureSpec, bool) {
	s, ok := specs[f]
	return s, ok
}
