package gang

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"

	gpudrav1 "github.com/gpudra/gpudra/api/gpudra/v1alpha1"
	"github.com/gpudra/gpudra/pkg/allocator"
)

// Device fences: DeviceTaintRules that keep kube-scheduler off the devices
// the controller is about to write (commit.go), kept until its informer
// shows the writes, and swept when a leader left them behind.

// FenceTaintKey is the key of the device taint that fences devices while
// the controller writes their allocation; LabelFence marks the
// DeviceTaintRules so that leftovers of a crashed leader are found.
const (
	FenceTaintKey = gpudrav1.GroupName + "/fence"
	LabelFence    = gpudrav1.GroupName + "/fence"
)

// keptFence is a fence kept after its plan was written.
type keptFence struct {
	// claims are the written claims (namespace/name) whose allocation the
	// informer must show before the fence goes.
	claims []string
	since  time.Time
}

// keptFenceMax bounds how long a fence is kept waiting for the informer.
const keptFenceMax = 30 * time.Second

// deviceRef names one allocated device.
type deviceRef struct{ driver, pool, device string }

func planDevices(plan allocator.Result) []deviceRef {
	var out []deviceRef
	for _, a := range plan.Allocations {
		for _, r := range a.Result.Devices.Results {
			if ptr.Deref(r.AdminAccess, false) || r.ShareID != nil {
				continue // not exclusive: nothing to fence
			}
			out = append(out, deviceRef{r.Driver, r.Pool, r.Device})
		}
	}
	return out
}

// fenceName is a DeviceTaintRule's name: stable per device (device "" for
// a whole pool), so that a second fence of the same devices (two rounds
// racing after a leader change) collides instead of stacking.
func fenceName(d deviceRef) string {
	sum := sha256.Sum256([]byte(d.driver + "/" + d.pool + "/" + d.device))
	if d.device == "" {
		return "gpudra-fence-pool-" + hex.EncodeToString(sum[:8])
	}
	return "gpudra-fence-" + hex.EncodeToString(sum[:8])
}

// maxDeviceFencesPerPool: a plan that would fence more devices of one pool
// fences the whole pool with one DeviceTaintRule instead. Fences are API
// writes at the controller's client rate (20/s): a gang of 8 x 8 GPUs took
// 64 creates and 64 deletes, seconds in the critical path
// (BenchmarkGang8x8GPUs). The pool's other devices are kept from the
// scheduler only until the plan's writes are seen.
const maxDeviceFencesPerPool = 2

// fencesFor returns the DeviceTaintRules that fence the devices: one per
// device, or one per pool where a pool has more than maxDeviceFencesPerPool.
func fencesFor(devices []deviceRef) []*resourceapi.DeviceTaintRule {
	type poolKey struct{ driver, pool string }
	byPool := map[poolKey][]deviceRef{}
	var order []poolKey
	for _, d := range devices {
		k := poolKey{d.driver, d.pool}
		if _, ok := byPool[k]; !ok {
			order = append(order, k)
		}
		byPool[k] = append(byPool[k], d)
	}
	var out []*resourceapi.DeviceTaintRule
	rule := func(d deviceRef) *resourceapi.DeviceTaintRule {
		sel := &resourceapi.DeviceTaintSelector{Driver: ptr.To(d.driver), Pool: ptr.To(d.pool)}
		if d.device != "" {
			sel.Device = ptr.To(d.device)
		}
		return &resourceapi.DeviceTaintRule{
			ObjectMeta: metav1.ObjectMeta{Name: fenceName(d), Labels: map[string]string{LabelFence: "true"}},
			Spec: resourceapi.DeviceTaintRuleSpec{DeviceSelector: sel,
				Taint: resourceapi.DeviceTaint{Key: FenceTaintKey, Value: "allocating", Effect: resourceapi.DeviceTaintEffectNoSchedule}},
		}
	}
	for _, k := range order {
		ds := byPool[k]
		if len(ds) > maxDeviceFencesPerPool {
			out = append(out, rule(deviceRef{driver: k.driver, pool: k.pool}))
			continue
		}
		for _, d := range ds {
			out = append(out, rule(d))
		}
	}
	return out
}

// fenceSubject says what a fence covers, for errors.
func fenceSubject(r *resourceapi.DeviceTaintRule) string {
	sel := r.Spec.DeviceSelector
	if sel.Device == nil {
		return "pool " + ptr.Deref(sel.Pool, "")
	}
	return "device " + ptr.Deref(sel.Pool, "") + "/" + *sel.Device
}

// liftKept lifts the kept fences whose claims the informer shows allocated
// (allocated says so; a claim gone counts), or that were kept too long.
func (c *committer) liftKept(ctx context.Context, allocated func(key string) bool) {
	var lift []string
	for name, k := range c.kept {
		done := time.Since(k.since) > keptFenceMax
		if !done {
			done = true
			for _, key := range k.claims {
				if !allocated(key) {
					done = false
					break
				}
			}
		}
		if done {
			lift = append(lift, name)
			delete(c.kept, name)
		}
	}
	c.lift(ctx, lift...)
}

// lift deletes fences.
func (c *committer) lift(ctx context.Context, names ...string) {
	for _, name := range names {
		if c.kept[name] != nil {
			continue // another written plan still waits on it
		}
		if err := c.client.ResourceV1().DeviceTaintRules().Delete(context.WithoutCancel(ctx), name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			klog.FromContext(ctx).Error(err, "Lift device fence", "deviceTaintRule", name)
		}
	}
}

// sweepFences deletes fences older than maxAge: a leader that died between
// fencing and lifting leaves them behind.
func sweepFences(ctx context.Context, client kubernetes.Interface, now time.Time, maxAge time.Duration) error {
	list, err := client.ResourceV1().DeviceTaintRules().List(ctx, metav1.ListOptions{LabelSelector: LabelFence + "=true"})
	if err != nil {
		return fmt.Errorf("list device fences: %w", err)
	}
	for _, r := range list.Items {
		if now.Sub(r.CreationTimestamp.Time) < maxAge {
			continue
		}
		if err := client.ResourceV1().DeviceTaintRules().Delete(ctx, r.Name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			return fmt.Errorf("delete stale device fence %s: %w", r.Name, err)
		}
	}
	return nil
}
