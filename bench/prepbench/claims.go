package prepbench

// The claims the benchmark prepares: made once, each allocated to one GPU
// of the node just before its prepare and released after its unprepare, as
// the scheduler and the claim controller would, so that a GPU is held by
// one claim at a time (gpudra-controller takes back double allocations).

import (
	"context"
	"fmt"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/util/retry"
)

// createClaims creates the claims, not allocated yet.
func createClaims(ctx context.Context, client kubernetes.Interface, cfg Config) ([]*resourceapi.ResourceClaim, error) {
	out := make([]*resourceapi.ResourceClaim, 0, cfg.Claims)
	node, driver, prefix := cfg.node(), cfg.driver(), "bench"
	if cfg.Node != "" {
		prefix = cfg.Node
	}
	for i := 0; i < cfg.Claims; i++ {
		c := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("%s-%03d", prefix, i), Namespace: metav1.NamespaceDefault,
			Labels: map[string]string{nodeLabel: node}},
			Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{Requests: []resourceapi.DeviceRequest{{
				Name: "gpu", Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: driver}}}}}}
		c, err := client.ResourceV1().ResourceClaims(c.Namespace).Create(ctx, c, metav1.CreateOptions{})
		if err != nil {
			return nil, fmt.Errorf("create claim %d: %w", i, err)
		}
		out = append(out, c)
	}
	return out, nil
}

// allocate allocates claim i to its device of the node, as the scheduler
// would, and returns it as the API server stored it.
//
// Every claim used to be allocated up front: 200 claims over 8 GPUs, each
// GPU allocated to 25 claims at once, reserved for pods that do not exist.
// No scheduler makes that, and the cluster's controllers repair it: the
// ResourceClaim controller drops a reservation for a pod that does not
// exist, and gpudra-controller's double-allocation repair then takes back
// the allocation of every claim but one per device that no pod uses, so
// the plugin read the first claim back unallocated ("claim default/bench-000
// not allocated"). Now a device is allocated to one claim at a time, with
// no reservation: the plugin does not read it, and one naming a pod that
// does not exist is a write of the claim controller racing the prepare.
func allocate(ctx context.Context, client kubernetes.Interface, c *resourceapi.ResourceClaim, cfg Config, i int) (*resourceapi.ResourceClaim, error) {
	node := cfg.node()
	c = c.DeepCopy()
	c.Status.Allocation = &resourceapi.AllocationResult{
		Devices: resourceapi.DeviceAllocationResult{Results: []resourceapi.DeviceRequestAllocationResult{{
			Request: "gpu", Driver: cfg.driver(), Pool: node, Device: cfg.device(i)}}},
		NodeSelector: &v1.NodeSelector{NodeSelectorTerms: []v1.NodeSelectorTerm{{MatchFields: []v1.NodeSelectorRequirement{{
			Key: "metadata.name", Operator: v1.NodeSelectorOpIn, Values: []string{node}}}}}},
		AllocationTimestamp: &metav1.Time{Time: time.Now()},
	}
	out, err := client.ResourceV1().ResourceClaims(c.Namespace).UpdateStatus(ctx, c, metav1.UpdateOptions{})
	if err != nil {
		return nil, fmt.Errorf("allocate claim %s: %w", c.Name, err)
	}
	if out.Status.Allocation == nil {
		return nil, fmt.Errorf("allocate claim %s: the API server stored it without its allocation", c.Name)
	}
	return out, nil
}

// deallocate releases a claim after its unprepare, as the ResourceClaim
// controller does when the claim's last pod is gone.
// The plugin may have written the claim's status since (its devices'
// status): then it is read again.
func deallocate(ctx context.Context, client kubernetes.Interface, c *resourceapi.ResourceClaim) error {
	claims := client.ResourceV1().ResourceClaims(c.Namespace)
	c = c.DeepCopy()
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		c.Status.Allocation, c.Status.Devices = nil, nil
		_, err := claims.UpdateStatus(ctx, c, metav1.UpdateOptions{})
		if apierrors.IsConflict(err) {
			if cur, getErr := claims.Get(ctx, c.Name, metav1.GetOptions{}); getErr == nil {
				c = cur
			}
		}
		return err
	})
	if err != nil {
		return fmt.Errorf("deallocate claim %s: %w", c.Name, err)
	}
	return nil
}
