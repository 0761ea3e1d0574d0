package plugin

import (
	"context"
	"fmt"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/klog/v2"

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
