package gang

import (
	"context"
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

	"github.com/gpudra/gpudra/pkg/allocator"
)

// The fence-and-write hand-off: the controller writes a plan's claim
// allocations itself. It serves every reservation, every gang on the gate
// path (released after by lifting its gates, gates.go), and the claims that
// several pods of a Workload API gang share (workload.go). The scheduler
// allocates too, so the devices are fenced first (fence.go), checked free,
// and written; a gang's writes are checked once more before its gates go
// (checkBeforeRelease). Whatever still ends up allocated twice is repaired
// (repair.go).

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
	// binding says which pod, if any, kube-scheduler is binding to one of
	// the nodes with claims it has not written yet (nil: none is asked).
	binding func(nodes []string) string
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
			if err := c.write(ctx, a, p.create.Has(a.Claim.Namespace+"/"+a.Claim.Name), p.item); err != nil {
				// All or nothing: take back what was written.
				for _, done := range p.result.Allocations[:j] {
					if uerr := c.unwrite(context.WithoutCancel(ctx), done, p.create.Has(done.Claim.Namespace+"/"+done.Claim.Name)); uerr != nil {
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
			c.keep(fences, p.result)
		}
	}
	return errs
}

// keep records a written plan's fences.
func (c *committer) keep(fences []string, plan allocator.Result) {
	if c.kept == nil {
		c.kept = map[string]*keptFence{}
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
}

// unwrite takes back one allocation this controller wrote from a plan
// (a.Result): a claim it created is deleted (the claim controller clears its
// allocation and finalizer), an existing one has its allocation taken back
// (takeBackClaim: only while that allocation is there and nobody uses it).
func (c *committer) unwrite(ctx context.Context, a allocator.ClaimAllocation, created bool) error {
	if created {
		err := c.client.ResourceV1().ResourceClaims(a.Claim.Namespace).Delete(ctx, a.Claim.Name, metav1.DeleteOptions{})
		if err != nil && !apierrors.IsNotFound(err) {
			return err
		}
		return nil
	}
	written := a.Claim.DeepCopy()
	written.Status.Allocation = a.Result.DeepCopy()
	_, err := takeBackClaim(ctx, c.client, written, time.Now())
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

// write creates the claim if asked, adds the scheduler's finalizer and the
// annotations that remember the write (item, memory.go), and writes the
// allocation into its status.
func (c *committer) write(ctx context.Context, a allocator.ClaimAllocation, create bool, item string) error {
	claims := c.client.ResourceV1().ResourceClaims(a.Claim.Namespace)
	claim := a.Claim.DeepCopy()
	at := allocationStamp(time.Now())
	markWritten(claim, item, at)
	if !slices.Contains(claim.Finalizers, resourceapi.Finalizer) {
		claim.Finalizers = append(claim.Finalizers, resourceapi.Finalizer)
	}
	var err error
	if create {
		if claim, err = claims.Create(ctx, claim, metav1.CreateOptions{}); err != nil {
			return fmt.Errorf("create claim %s/%s: %w", a.Claim.Namespace, a.Claim.Name, err)
		}
	} else {
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
	claim.Status.Allocation.AllocationTimestamp = ptr.To(at)
	if _, err := claims.UpdateStatus(ctx, claim, metav1.UpdateOptions{}); err != nil {
		if apierrors.IsNotFound(err) || apierrors.IsConflict(err) {
			return fmt.Errorf("claim %s/%s changed: %w: %w", claim.Namespace, claim.Name, err, ErrConflict)
		}
		return fmt.Errorf("write allocation of claim %s/%s: %w", claim.Namespace, claim.Name, err)
	}
	return nil
}

// checkBeforeRelease looks again, one settle after the writes, for a device
// of a gang just written (on the Workload API path: its shared claims) that
// another claim holds too (kube-scheduler decided before the fence reached
// it and wrote at PreBind after the check), before the gang's gates are
// lifted: released, its pods would let kube-scheduler allocate a cleared
// claim anywhere, outside the gang's NVLink plan. Such a gang's writes are
// taken back and it is planned again (its result becomes ErrConflict).
// Reservations are left to the round's repair, which queues them again.
func (c *Controller) checkBeforeRelease(ctx context.Context, writes []*admission, plans []commitPlan, results []error, counters *counterIndex) {
	mine := map[string]int{} // claim namespace/name -> index into writes
	for i, a := range writes {
		if results[i] != nil || a.it.kind != KindGang {
			continue
		}
		for _, al := range plans[i].result.Allocations {
			mine[al.Claim.Namespace+"/"+al.Claim.Name] = i
		}
	}
	if len(mine) == 0 {
		return
	}
	if c.committer.settle > 0 {
		select {
		case <-ctx.Done():
			return
		case <-time.After(c.committer.settle):
		}
	}
	list, err := c.opts.Client.ResourceV1().ResourceClaims("").List(ctx, metav1.ListOptions{})
	if err != nil {
		// Could not tell: the round's repair looks at these claims again
		// (they are fresh), and a released gang's is reported.
		klog.FromContext(ctx).Error(err, "Check a gang's claims before lifting its gates")
		return
	}
	claims := make([]*resourceapi.ResourceClaim, 0, len(list.Items))
	for i := range list.Items {
		claims = append(claims, &list.Items[i])
	}
	involves := func(cl *resourceapi.ResourceClaim) bool { _, ok := mine[cl.Namespace+"/"+cl.Name]; return ok }
	for _, d := range findDoubleAllocations(claims, counters, involves) {
		for _, cl := range d.claims {
			i, ok := mine[cl.Namespace+"/"+cl.Name]
			if !ok || results[i] != nil {
				continue
			}
			results[i] = fmt.Errorf("%s is in another claim too, found before the gates were lifted: %w", d.what, ErrConflict)
			for _, al := range plans[i].result.Allocations {
				if err := c.committer.unwrite(context.WithoutCancel(ctx), al, false); err != nil {
					results[i] = fmt.Errorf("%s is in another claim too, and taking back claim %s/%s failed: %w", d.what, al.Claim.Namespace, al.Claim.Name, err)
				}
			}
			c.metrics.doubles.WithLabelValues("repaired").Inc()
			klog.FromContext(ctx).Info("Took back a gang's writes before releasing it: a device is allocated twice", "gang", writes[i].it.Key, "what", d.what)
			c.recordGang(writes[i].it.gang, corev1.EventTypeWarning, ReasonDoubleAllocation,
				fmt.Sprintf("gang %s: %s was allocated to another claim too; took back the gang's allocations before lifting its gates, and planning again", writes[i].it.gang.Name, d.what))
		}
	}
}

// nominatedIndex indexes pods not bound yet by the node kube-scheduler
// nominated for them.
const nominatedIndex = "nominated"

func nominatedNode(obj any) ([]string, error) {
	p, ok := obj.(*corev1.Pod)
	if !ok || p.Spec.NodeName != "" || p.Status.NominatedNodeName == "" {
		return nil, nil
	}
	return []string{p.Status.NominatedNodeName}, nil
}

// binding names a pod kube-scheduler is binding to one of the nodes (it
// nominated the node, the pod is not bound yet) whose claims it has not all
// written yet, or "" when there is none.
func (c *Controller) binding(nodes []string) string {
	var pods []any
	for _, n := range nodes {
		objs, _ := c.pods.ByIndex(nominatedIndex, n)
		pods = append(pods, objs...)
	}
	for _, o := range pods {
		p := o.(*corev1.Pod)
		if !member(p) {
			continue
		}
		cls, err := claimsOfPod(p, c.claim, nil)
		if err != nil {
			return p.Namespace + "/" + p.Name // a claim not even made yet
		}
		for _, cl := range cls {
			if cl.Status.Allocation == nil {
				return p.Namespace + "/" + p.Name
			}
		}
	}
	return ""
}
