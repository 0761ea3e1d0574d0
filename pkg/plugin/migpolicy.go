package plugin

import (
	"context"
	"fmt"
	"slices"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/dynamic-resource-allocation/resourceslice"
	"k8s.io/klog/v2"

	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/slicebuilder"
)

// AnnotationMigDevices on a Node overrides --mig-devices for that node, so
// that a large cluster can publish few MIG devices and keep dynamic MIG on
// a few nodes (docs/scale.md). An annotation, not a label: a policy such as
// "profiles=1g.10gb,3g.40gb" is no valid label value. Read at start: the
// plugin is restarted to apply a change.
const AnnotationMigDevices = "gpu.gpudra.dev/mig-devices"

// ReasonMigDevicesInvalid is the Event reason of an annotation that does
// not parse.
const ReasonMigDevicesInvalid = "MigDevicesInvalid"

// ReasonMigGPUsUnpublished is the Event reason of GPUs in MIG mode that
// publish no device: the existing policy (the default) with no MIG device
// made on them.
const ReasonMigGPUsUnpublished = "MigGPUsUnpublished"

// unpublishedMigGPUs lists the indexes of the GPUs in MIG mode of which no
// device is published.
func unpublishedMigGPUs(inv *nvdevice.Inventory, res resourceslice.DriverResources) []int {
	published := map[int64]bool{}
	for _, p := range res.Pools {
		for _, s := range p.Slices {
			for _, d := range s.Devices {
				if a, ok := d.Attributes["index"]; ok && a.IntValue != nil {
					published[*a.IntValue] = true
				}
			}
		}
	}
	var out []int
	for _, g := range inv.GPUs {
		if g.MIG.Enabled && !published[int64(g.Index)] {
			out = append(out, g.Index)
		}
	}
	slices.Sort(out)
	return out
}

// reportUnpublished says, once per change, which GPUs in MIG mode publish
// nothing and what to do about it: with the existing policy a GPU in MIG
// mode without MIG devices offers nothing, which an admin who turned MIG
// mode on may not expect.
func (d *Driver) reportUnpublished(ctx context.Context, gpus []int) {
	d.mu.Lock()
	same := slices.Equal(gpus, d.unpublished)
	d.unpublished = gpus
	d.mu.Unlock()
	if same || len(gpus) == 0 {
		return
	}
	msg := fmt.Sprintf("GPUs %v are in MIG mode with no MIG device made and publish nothing under --mig-devices=%s: make MIG devices (nvidia-smi mig -cgi ... -C, or a MIG manager), or publish placements to be created with kubeletPlugin.migDevices or the Node annotation %s (all, or profiles=<profile>,...; docs/scale.md)", gpus, d.migPolicy.String(), AnnotationMigDevices)
	if d.existingMigOnly && !d.migPolicy.Existing {
		msg = fmt.Sprintf("GPUs %v are in MIG mode with no MIG device made and publish nothing: feature gate DynamicMIG is off, so no MIG device is created at prepare; make MIG devices (nvidia-smi mig -cgi ... -C, or a MIG manager)", gpus)
	}
	klog.FromContext(ctx).Info("GPUs in MIG mode publish nothing", "gpus", gpus, "migDevices", d.migPolicy.String(), "dynamicMIG", !d.existingMigOnly)
	d.events.record("", nil, corev1.EventTypeWarning, ReasonMigGPUsUnpublished, "Publish", msg)
}

// nodeMigPolicy is the MIG device policy in effect on the node: its
// annotation's, or flag's when it has none, cannot be read, or does not
// parse (then a Warning Event on the Node says why).
func nodeMigPolicy(ctx context.Context, client kubernetes.Interface, nodeName string, flag slicebuilder.MigPolicy, ev *nodeEvents) slicebuilder.MigPolicy {
	logger := klog.FromContext(ctx)
	if client == nil {
		return flag
	}
	node, err := client.CoreV1().Nodes().Get(ctx, nodeName, metav1.GetOptions{})
	if err != nil {
		logger.Error(err, "Could not read the Node for its MIG device policy: using --mig-devices", "node", nodeName, "migDevices", flag.String())
		return flag
	}
	raw, ok := node.Annotations[AnnotationMigDevices]
	if !ok {
		logger.Info("MIG device policy", "migDevices", flag.String(), "from", "--mig-devices")
		return flag
	}
	p, err := slicebuilder.ParseMigPolicy(raw)
	if err != nil {
		msg := fmt.Sprintf("annotation %s: %v; using --mig-devices=%s", AnnotationMigDevices, err, flag.String())
		logger.Error(err, "Invalid MIG device policy on the Node: using --mig-devices", "annotation", AnnotationMigDevices, "migDevices", flag.String())
		ev.record("", nil, corev1.EventTypeWarning, ReasonMigDevicesInvalid, "Publish", msg)
		return flag
	}
	logger.Info("MIG device policy", "migDevices", p.String(), "from", "annotation "+AnnotationMigDevices)
	return p
}
