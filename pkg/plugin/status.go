package plugin

import (
	"context"
	"encoding/json"
	"fmt"
	"reflect"
	"strings"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	metav1apply "k8s.io/client-go/applyconfigurations/meta/v1"
	resourceapply "k8s.io/client-go/applyconfigurations/resource/v1"
	"k8s.io/client-go/kubernetes"

	gpuapi "github.com/gpudra/gpudra/api/gpu/v1alpha1"
	"github.com/gpudra/gpudra/pkg/prepared"
	"github.com/gpudra/gpudra/pkg/sharing"
	"github.com/gpudra/gpudra/pkg/slicebuilder"
)

// SharingStatus is what the plugin reports in a claim's device status for
// a shared device: how it is shared, the limits, and, honestly, what is
// enforced and what is not.
type SharingStatus struct {
	Strategy               gpuapi.SharingStrategy `json:"strategy"`
	ShareID                string                 `json:"shareID,omitempty"`
	Memory                 string                 `json:"memory,omitempty"`
	Multiprocessors        int64                  `json:"multiprocessors,omitempty"`
	PinnedMemoryLimit      string                 `json:"pinnedMemoryLimit,omitempty"`
	ActiveThreadPercentage int32                  `json:"activeThreadPercentage,omitempty"`
	// Enforced maps each limit to how it is enforced, or why it is not.
	Enforced map[string]string `json:"enforced"`
}

const conditionSharingEnforced = "SharingLimitsEnforced"

// sharingStatuses computes the device statuses of a prepared claim; nil
// when there is nothing to report (exclusive, not a share). MPS limits are
// the ones the claim's daemon was given.
func sharingStatuses(c prepared.Claim) []SharingStatus {
	if c.Sharing == nil {
		return nil
	}
	var limits sharing.MPSLimits
	if c.Sharing.Strategy == gpuapi.MPS {
		var err error
		if limits, err = sharing.MPSLimitsFor(c); err != nil {
			return nil // refused at prepare already: the claim is not prepared
		}
	}
	out := make([]SharingStatus, 0, len(c.Devices))
	for i, d := range c.Devices {
		st := SharingStatus{Strategy: c.Sharing.Strategy, Enforced: map[string]string{}}
		if d.Share != nil {
			st.ShareID = d.Share.ID
			st.Memory = resource.NewQuantity(d.Share.MemoryBytes, resource.BinarySI).String()
			st.Multiprocessors = d.Share.Multiprocessors
		}
		switch c.Sharing.Strategy {
		case gpuapi.MPS:
			// One MPS server per GPU serves every MPS claim on it, so a
			// claim's limits are in its clients' environment: MPS applies
			// them to a client that keeps them, and nothing stops a
			// container from changing its own environment.
			if mib := limits.PinnedMiB[i]; mib > 0 {
				st.PinnedMemoryLimit = resource.NewQuantity(mib<<20, resource.BinarySI).String()
				st.Enforced["memory"] = "not enforced against the client: MPS applies the pinned device memory limit in the client's environment (CUDA_MPS_PINNED_DEVICE_MEM_LIMIT); a container that changes its environment is not bound"
			} else {
				st.Enforced["memory"] = "not limited: no pinned memory limit was asked for"
			}
			st.ActiveThreadPercentage = int32(limits.ThreadPercentage)
			if st.ActiveThreadPercentage > 0 {
				st.Enforced["compute"] = "not enforced against the client: MPS applies the active thread percentage in the client's environment (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE); a container that changes its environment is not bound"
			} else {
				st.Enforced["compute"] = "not limited: clients share all SMs"
			}
			st.Enforced["faults"] = "not isolated: a fatal error in one MPS client affects every client of the GPU's MPS server, other claims' included"
			st.Enforced["server"] = "one MPS server per GPU, shared with every MPS claim on it; clients of another Linux user wait until it has no clients (MPS serves one user at a time)"
		case gpuapi.TimeSlicing:
			st.Enforced["memory"] = "not enforced: time-slicing has no memory limit"
			st.Enforced["compute"] = "not enforced: processes take turns; only the time slice length is set"
			st.Enforced["faults"] = "not isolated"
		default:
			st.Enforced["memory"] = "not enforced between the pods that share this claim"
			st.Enforced["compute"] = "not enforced between the pods that share this claim"
		}
		if c.Sharing.IPC {
			st.Enforced["ipc"] = "every consumer of the claim gets the same directory at " + gpuapi.IPCDirectory
		}
		out = append(out, st)
	}
	return out
}

// writeDeviceStatus applies the claim's device statuses with server-side
// apply, so that it owns only its own entries. claim is what the kubelet
// plugin helper read from the API for this prepare: when its status already
// says the same (a repeat prepare, a restart), nothing is written, and a
// condition's transition time moves only when its status does.
func writeDeviceStatus(ctx context.Context, client kubernetes.Interface, fieldManager string, claim *resourceapi.ResourceClaim, c prepared.Claim) error {
	statuses := sharingStatuses(c)
	if len(statuses) == 0 || client == nil {
		return nil
	}
	status := resourceapply.ResourceClaimStatus()
	upToDate := true
	for i, st := range statuses {
		d := c.Devices[i]
		data, err := json.Marshal(st)
		if err != nil {
			return err
		}
		condStatus, reason := metav1.ConditionTrue, "Enforced"
		for _, how := range st.Enforced {
			if strings.HasPrefix(how, "not ") {
				condStatus, reason = metav1.ConditionFalse, "NotAllEnforced"
			}
		}
		message := fmt.Sprintf("%s sharing; see data.enforced", st.Strategy)
		transition := metav1.Now()
		existing := existingDeviceStatus(claim, d)
		var cond *metav1.Condition
		if existing != nil {
			cond = meta.FindStatusCondition(existing.Conditions, conditionSharingEnforced)
		}
		if cond != nil && cond.Status == condStatus {
			transition = cond.LastTransitionTime
		}
		if existing == nil || !sameData(existing.Data, st) || cond == nil || cond.Status != condStatus ||
			cond.Reason != reason || cond.Message != message || cond.ObservedGeneration != claim.Generation ||
			ptrValue(existing.ShareID) != st.ShareID {
			upToDate = false
		}
		dev := resourceapply.AllocatedDeviceStatus().WithDriver(slicebuilder.DriverName).WithPool(d.Pool).WithDevice(d.Device).
			WithData(runtime.RawExtension{Raw: data}).
			WithConditions(metav1apply.Condition().WithType(conditionSharingEnforced).WithStatus(condStatus).WithReason(reason).
				WithMessage(message).WithLastTransitionTime(transition).WithObservedGeneration(claim.Generation))
		if st.ShareID != "" {
			dev = dev.WithShareID(st.ShareID)
		}
		status = status.WithDevices(dev)
	}
	if upToDate {
		return nil
	}
	apply := resourceapply.ResourceClaim(claim.Name, claim.Namespace).WithStatus(status)
	_, err := client.ResourceV1().ResourceClaims(claim.Namespace).ApplyStatus(ctx, apply, metav1.ApplyOptions{FieldManager: fieldManager, Force: true})
	return err
}

// sameData says whether the status data holds st. The API server stores it
// re-encoded (server-side apply sorts the keys), so it is compared decoded.
func sameData(raw *runtime.RawExtension, st SharingStatus) bool {
	if raw == nil {
		return false
	}
	var have SharingStatus
	return json.Unmarshal(raw.Raw, &have) == nil && reflect.DeepEqual(have, st)
}

// existingDeviceStatus is the claim's status entry for the device, if any.
func existingDeviceStatus(claim *resourceapi.ResourceClaim, d prepared.Device) *resourceapi.AllocatedDeviceStatus {
	for i := range claim.Status.Devices {
		e := &claim.Status.Devices[i]
		if e.Driver == slicebuilder.DriverName && e.Pool == d.Pool && e.Device == d.Device &&
			(d.Share == nil || ptrValue(e.ShareID) == d.Share.ID) {
			return e
		}
	}
	return nil
}

func ptrValue[T any](p *T) T {
	var zero T
	if p == nil {
		return zero
	}
	return *p
}
