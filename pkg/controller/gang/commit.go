package gang

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/client-go/kubernetes"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"

	gpudrav1 "github.com/gpudra/gpudra/api/gpudra/v1alpha1"
	"github.com/gpudra/gpudra/pkg/allocator"
)

// FenceTaintKey is the key of the device taint that fences devices while
// the controller writes their allocation; LabelFence marks the
// DeviceTaintRules so that leftovers of a crashed leader are found.
const (
	FenceTaintKey = gpudrav1.GroupName + "/fence"
	LabelFence    = gpudrav1.GroupName + "/fence"
)

// ErrConflict says that a planned device was taken before its allocation
// was written; nothing was written and the item is planned again.
var ErrConflict = errors.New("a planned device was allocated by someone else")

// committer writes a plan: it fences the devices with a DeviceTaintRule
// each (the scheduler stops choosing them), waits for the fence to reach
// the scheduler, checks with the API server that the devices are still
// free, writes the allocations, and lifts the fence. The kubelet plugin's
// refusal of a device prepared twice stays the last line.
type committer struct {
	client kubernetes.Interface
	// settle is how long a fence is given to reach the scheduler's
	// informer, and an allocation the scheduler decided before it to be
	// written, before the check.
	settle time.Duration
	// kept are the fences of written plans, by DeviceTaintRule name: each
	// stays until this controller's informer shows the plan's claims
	// allocated (liftKept), since the scheduler's informer lags the same
	// way. Lifted at once, the scheduler could choose a device whose
	// allocation it has not seen yet. Only the round goroutine uses it.
	kept map[string]*keptFence
	// written are the claims this controller allocated, by UID, with when
	// and for which item: the double-allocation repair (repair.go) prefers
	// to take back its own unused writes, whose items plan again, and
	// never a released gang's.
	written map[types.UID]writtenClaim
	// binding says which pod, if any, kube-scheduler is binding to one of
	// the nodes with claims it has not written yet (nil: none is asked).
	binding func(nodes []string) string
}

// writtenClaim is one claim allocation this controller wrote.
type writtenClaim struct {
	at time.Time
	// item is the key of the reservation or gang it was written for.
	item string
}

// repairWindow is how long the controller remembers a claim it wrote.
const repairWindow = 10 * time.Minute

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

// commitPlan is one plan of a batch: its allocations, and which of its
// claims do not exist yet (a reservation's: they are created first, with the
// scheduler's finalizer so that the claim controller deallocates them when
// their last user goes).
type commitPlan struct {
	result allocator.Result
	create sets.Set[string]
	// item is the key of the reservation or gang the plan is for.
	item string
}

// commit writes one plan (commitAll of one).
func (c *committer) commit(ctx context.Context, plan allocator.Result, create sets.Set[string], counters *counterIndex) error {
	return c.commitAll(ctx, []commitPlan{{result: plan, create: create}}, counters)[0]
}

// commitAll writes the plans a round admitted, each all or nothing, behind
// one fence and one settle for all of them: admissions of one round do not
// wait on each other's settle time. counters (nil: none) says which devices
// share counters with the planned ones: they are fenced too, and the check
// adds up counters. It returns one error per plan (ErrConflict: planned
// again).
func (c *committer) commitAll(ctx context.Context, plans []commitPlan, counters *counterIndex) []error {
	logger := klog.FromContext(ctx)
	errs := make([]error, len(plans))
	failAll := func(err error) []error {
		for i := range errs {
			errs[i] = err
		}
		return errs
	}
	var devices []deviceRef
	for _, p := range plans {
		devices = append(devices, planDevices(p.result)...)
	}
	fenced := devices
	if counters != nil {
		fenced = append(slices.Clone(devices), counters.siblings(devices)...)
	}
	var fences []string
	written := false
	defer func() {
		if !written {
			// Nothing written: lift at once. A leftover fence only keeps
			// the scheduler away from free devices (and is swept up later).
			c.lift(ctx, fences...)
		}
	}()
	for _, f := range fencesFor(fenced) {
		if k := c.kept[f.Name]; k != nil {
			// Fenced already for a plan of this controller whose writes the
			// informer has not shown yet: it now waits for these too.
			fences = append(fences, f.Name)
			continue
		}
		if _, err := c.client.ResourceV1().DeviceTaintRules().Create(ctx, f, metav1.CreateOptions{}); err != nil {
			if apierrors.IsAlreadyExists(err) {
				return failAll(fmt.Errorf("%s is fenced by another allocation: %w", fenceSubject(f), ErrConflict))
			}
			return failAll(fmt.Errorf("fence %s: %w", fenceSubject(f), err))
		}
		fences = append(fences, f.Name)
	}
	if c.settle > 0 {
		select {
		case <-ctx.Done():
			return failAll(ctx.Err())
		case <-time.After(c.settle):
		}
	}
	// One list from the API server (not the informer, which may lag) for
	// the whole batch.
	list, err := c.client.ResourceV1().ResourceClaims("").List(ctx, metav1.ListOptions{})
	if err != nil {
		return failAll(fmt.Errorf("check planned devices are free: %w", err))
	}
	var admitted []deviceRef // of the plans written so far
	for i, p := range plans {
		mine := planDevices(p.result)
		if errs[i] = checkFree(list.Items, mine, admitted, p.result, counters); errs[i] != nil {
			continue
		}
		// kube-scheduler decides at Reserve and writes the claims at
		// PreBind, after the other PreBind plugins (a volume can take
		// seconds); it names the node in status.nominatedNodeName first
		// (NominatedNodeNameForExpectation, on since 1.35). Its choice is
		// invisible to the check above until then: wait for it.
		if c.binding != nil {
			if pod := c.binding(p.result.Nodes); pod != "" {
				errs[i] = fmt.Errorf("kube-scheduler is binding pod %s to a planned node and has not written its claims yet: %w", pod, ErrConflict)
				continue
			}
		}
		for j, a := range p.result.Allocations {
			if err := c.write(ctx, a, p.create.Has(a.Claim.Namespace+"/"+a.Claim.Name)); err != nil {
				// All or nothing: take back what was written.
				for _, done := range p.result.Allocations[:j] {
					if uerr := c.unwrite(context.WithoutCancel(ctx), done.Claim, p.create.Has(done.Claim.Namespace+"/"+done.Claim.Name)); uerr != nil {
						logger.Error(uerr, "Take back a partly written plan", "claim", klog.KObj(done.Claim))
					}
				}
				errs[i] = err
				break
			}
		}
		if errs[i] == nil {
			written = true
			admitted = append(admitted, mine...)
			// Kept until the informer shows the writes (liftKept).
			c.keep(fences, p.result, p.item)
		}
	}
	return errs
}

// keep records a written plan's fences (and its claims as this
// controller's own).
func (c *committer) keep(fences []string, plan allocator.Result, item string) {
	if c.kept == nil {
		c.kept = map[string]*keptFence{}
	}
	if c.written == nil {
		c.written = map[types.UID]writtenClaim{}
	}
	now := time.Now()
	var claims []string
	for _, a := range plan.Allocations {
		claims = append(claims, a.Claim.Namespace+"/"+a.Claim.Name)
	}
	for _, name := range fences {
		k := c.kept[name]
		if k == nil {
			k = &keptFence{since: now}
			c.kept[name] = k
		}
		k.claims = append(k.claims, claims...)
	}
	for uid, w := range c.written {
		if now.Sub(w.at) > repairWindow {
			delete(c.written, uid)
		}
	}
	for _, a := range plan.Allocations {
		if a.Claim.UID != "" {
			c.written[a.Claim.UID] = writtenClaim{at: now, item: item}
		}
	}
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

// unwrite takes back one written allocation: a claim it created is
// deleted (the claim controller clears its allocation and finalizer), an
// existing one gets its allocation cleared.
func (c *committer) unwrite(ctx context.Context, claim *resourceapi.ResourceClaim, created bool) error {
	claims := c.client.ResourceV1().ResourceClaims(claim.Namespace)
	if created {
		if err := claims.Delete(ctx, claim.Name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			return err
		}
		return nil
	}
	cur, err := claims.Get(ctx, claim.Name, metav1.GetOptions{})
	if err != nil {
		return err
	}
	if len(cur.Status.ReservedFor) > 0 {
		return fmt.Errorf("claim %s/%s is already in use", claim.Namespace, claim.Name)
	}
	cur.Status.Allocation = nil
	_, err = claims.UpdateStatus(ctx, cur, metav1.UpdateOptions{})
	return err
}

// checkFree fails with ErrConflict when another claim of list (read from
// the API server after the settle) holds one of the planned devices, or
// when the devices other claims hold, those of the batch's plans written
// before (admitted) and the planned ones together overdraw a shared counter
// (a GPU's memory slices, its whole-GPU counter): a MIG placement the
// scheduler gave out on a planned GPU is no exact device collision.
func checkFree(list []resourceapi.ResourceClaim, devices, admitted []deviceRef, plan allocator.Result, counters *counterIndex) error {
	mine := sets.New[types.UID]()
	for _, a := range plan.Allocations {
		if a.Claim.UID != "" {
			mine.Insert(a.Claim.UID)
		}
	}
	want := sets.New[deviceRef](devices...)
	all := append(slices.Clone(devices), admitted...)
	for _, claim := range list {
		if claim.Status.Allocation == nil || mine.Has(claim.UID) {
			continue
		}
		for _, r := range claim.Status.Allocation.Devices.Results {
			if r.ShareID != nil || ptr.Deref(r.AdminAccess, false) {
				continue
			}
			if want.Has(deviceRef{r.Driver, r.Pool, r.Device}) {
				return fmt.Errorf("device %s/%s is now in claim %s/%s: %w", r.Pool, r.Device, claim.Namespace, claim.Name, ErrConflict)
			}
			all = append(all, deviceRef{r.Driver, r.Pool, r.Device})
		}
	}
	if counters != nil {
		if over := counters.overdrawn(all); over != "" {
			return fmt.Errorf("the planned devices and those allocated meanwhile overdraw %s: %w", over, ErrConflict)
		}
	}
	return nil
}

// write creates the claim if asked, adds the scheduler's finalizer, and
// writes the allocation into its status.
func (c *committer) write(ctx context.Context, a allocator.ClaimAllocation, create bool) error {
	claims := c.client.ResourceV1().ResourceClaims(a.Claim.Namespace)
	claim := a.Claim.DeepCopy()
	var err error
	if create {
		claim.Finalizers = append(claim.Finalizers, resourceapi.Finalizer)
		if claim, err = claims.Create(ctx, claim, metav1.CreateOptions{}); err != nil {
			return fmt.Errorf("create claim %s/%s: %w", a.Claim.Namespace, a.Claim.Name, err)
		}
	} else if !slices.Contains(claim.Finalizers, resourceapi.Finalizer) {
		claim.Finalizers = append(claim.Finalizers, resourceapi.Finalizer)
		if claim, err = claims.Update(ctx, claim, metav1.UpdateOptions{}); err != nil {
			if apierrors.IsNotFound(err) || apierrors.IsConflict(err) {
				// Deleted or changed since the snapshot: plan again.
				return fmt.Errorf("claim %s/%s changed: %w: %w", a.Claim.Namespace, a.Claim.Name, err, ErrConflict)
			}
			return fmt.Errorf("add finalizer to claim %s/%s: %w", a.Claim.Namespace, a.Claim.Name, err)
		}
	}
	if claim.Status.Allocation != nil {
		return fmt.Errorf("claim %s/%s was allocated meanwhile: %w", claim.Namespace, claim.Name, ErrConflict)
	}
	claim.Status.Allocation = a.Result.DeepCopy()
	claim.Status.Allocation.AllocationTimestamp = ptr.To(metav1.Now())
	if _, err := claims.UpdateStatus(ctx, claim, metav1.UpdateOptions{}); err != nil {
		if apierrors.IsNotFound(err) || apierrors.IsConflict(err) {
			return fmt.Errorf("claim %s/%s changed: %w: %w", claim.Namespace, claim.Name, err, ErrConflict)
		}
		return fmt.Errorf("write allocation of claim %s/%s: %w", claim.Namespace, claim.Name, err)
	}
	return nil
}

// ungate removes gpudra's scheduling gate from a pod with a JSON patch
// that tests the gates first, so that a concurrent change (Grove lifting
// its own gate) is not lost; on such a change it reads the pod again.
func ungate(ctx context.Context, client kubernetes.Interface, p *corev1.Pod) error {
	for attempt := 0; ; attempt++ {
		if !gated(p) {
			return nil
		}
		var gates []corev1.PodSchedulingGate
		for _, g := range p.Spec.SchedulingGates {
			if g.Name != gpudrav1.SchedulingGate {
				gates = append(gates, g)
			}
		}
		if gates == nil {
			gates = []corev1.PodSchedulingGate{}
		}
		patch, err := json.Marshal([]map[string]any{
			{"op": "test", "path": "/spec/schedulingGates", "value": p.Spec.SchedulingGates},
			{"op": "replace", "path": "/spec/schedulingGates", "value": gates},
		})
		if err != nil {
			return err
		}
		_, err = client.CoreV1().Pods(p.Namespace).Patch(ctx, p.Name, types.JSONPatchType, patch, metav1.PatchOptions{})
		switch {
		case err == nil || apierrors.IsNotFound(err):
			return nil
		case (apierrors.IsInvalid(err) || apierrors.IsBadRequest(err)) && attempt < 3:
			// The test failed: the gates changed meanwhile.
			fresh, gerr := client.CoreV1().Pods(p.Namespace).Get(ctx, p.Name, metav1.GetOptions{})
			if apierrors.IsNotFound(gerr) {
				return nil
			}
			if gerr != nil {
				return fmt.Errorf("lift the gang gate of pod %s/%s: %w", p.Namespace, p.Name, gerr)
			}
			p = fresh
		default:
			return fmt.Errorf("lift the gang gate of pod %s/%s: %w", p.Namespace, p.Name, err)
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
