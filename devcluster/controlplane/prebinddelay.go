package controlplane

import (
	"context"
	"time"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/runtime"
	fwk "k8s.io/kube-scheduler/framework"
	schedconfig "k8s.io/kubernetes/pkg/scheduler/apis/config"
	frameworkruntime "k8s.io/kubernetes/pkg/scheduler/framework/runtime"
)

// PreBindDelayAnnotation holds a pod in the scheduler's PreBind for the
// duration it names (a Go duration), before DynamicResources writes its
// claims' allocations: the window between the scheduler's choice (Reserve)
// and its write (PreBind) that a slow PreBind plugin (a volume being
// provisioned, 5-60 s) opens on a real cluster. The scheduler has
// nominated the node by then, as it does when a PreBind plugin has work.
// Tests use it to race gpudra-controller against in-flight choices.
const PreBindDelayAnnotation = "devcluster.gpudra.dev/prebind-delay"

// preBindDelayName is the plugin's name in the scheduler profile.
const preBindDelayName = "DevclusterPreBindDelay"

// preBindDelay is a PreBind plugin that waits for the pod's
// PreBindDelayAnnotation; pods without it skip it.
type preBindDelay struct{}

func newPreBindDelay(context.Context, runtime.Object, fwk.Handle) (fwk.Plugin, error) {
	return preBindDelay{}, nil
}

func (preBindDelay) Name() string { return preBindDelayName }

func delayOf(p *v1.Pod) time.Duration {
	d, err := time.ParseDuration(p.Annotations[PreBindDelayAnnotation])
	if err != nil || d <= 0 {
		return 0
	}
	return d
}

// PreBindPreFlight: only annotated pods wait; AllowParallel is false, so
// the wait ends before DynamicResources' PreBind starts.
func (preBindDelay) PreBindPreFlight(_ context.Context, _ fwk.CycleState, p *v1.Pod, _ string) (*fwk.PreBindPreFlightResult, *fwk.Status) {
	if delayOf(p) == 0 {
		return nil, fwk.NewStatus(fwk.Skip)
	}
	return nil, nil
}

func (preBindDelay) PreBind(ctx context.Context, _ fwk.CycleState, p *v1.Pod, _ string) *fwk.Status {
	select {
	case <-ctx.Done():
		return fwk.AsStatus(ctx.Err())
	case <-time.After(delayOf(p)):
		return nil
	}
}

// withPreBindDelay puts the plugin first in every profile's multi-point
// list, so that its PreBind runs before VolumeBinding's and
// DynamicResources', and returns the registry that builds it.
func withPreBindDelay(profiles []schedconfig.KubeSchedulerProfile) frameworkruntime.Registry {
	for i := range profiles {
		if profiles[i].Plugins == nil {
			profiles[i].Plugins = &schedconfig.Plugins{}
		}
		mp := &profiles[i].Plugins.MultiPoint
		mp.Enabled = append([]schedconfig.Plugin{{Name: preBindDelayName}}, mp.Enabled...)
	}
	return frameworkruntime.Registry{preBindDelayName: newPreBindDelay}
}
