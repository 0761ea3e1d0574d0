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

// The limits a claim can ask for, as the condition names them.
const (
	limitPinnedMemory     = "pinnedMemoryLimit"
	limitThreadPercentage = "activeThreadPercentage"
	limitTimeSlice        = "timeSlice"
)

// Reasons of the SharingLimitsEnforced condition. A False condition's
// reason names the limits that are not enforced: "NotEnforced:" followed by
// their names, comma-separated.
const (
	reasonEnforced          = "Enforced"
	reasonNoLimitsRequested = "NoLimitsRequested"
	reasonNotEnforcedPrefix = "NotEnforced:"
)

// deviceStatus is one device's status entry and the condition it gets.
type deviceStatus struct {
	device prepared.Device
	data   SharingStatus
	// asked are the limits the claim asked for on the device (a share's
	// memory counts: it was asked for through capacity), notEnforced those
	// of them that nothing enforces against the client.
	asked, notEnforced []string
}

// condition is the SharingLimitsEnforced condition of the device: True when
// every limit the claim asked for is enforced (reason Enforced) or when it
// asked for none (NoLimitsRequested: nothing to enforce), False with a
// reason naming the limits that are not enforced.
func (d deviceStatus) condition() (metav1.ConditionStatus, string, string) {
	switch {
	case len(d.notEnforced) > 0:
		return metav1.ConditionFalse, reasonNotEnforcedPrefix + strings.Join(d.notEnforced, ","),
			fmt.Sprintf("%s sharing: not enforced against the client: %s; see data.enforced", d.data.Strategy, strings.Join(d.notEnforced, ", "))
	case len(d.asked) == 0:
		return metav1.ConditionTrue, reasonNoLimitsRequested, fmt.Sprintf("%s sharing: no limit was asked for; see data.enforced", d.data.Strategy)
	default:
		return metav1.ConditionTrue, reasonEnforced, fmt.Sprintf("%s sharing: enforced: %s; see data.enforced", d.data.Strategy, strings.Join(d.asked, ", "))
	}
}

// sharingStatuses computes the device statuses of a prepared claim; nil
// when there is nothing to report (exclusive, not a share). MPS limits are
// the ones the claim's daemon was given. Admin-access devices get no entry:
// they are not shared, only watched.
func sharingStatuses(c prepared.Claim) []deviceStatus {
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
	out := make([]deviceStatus, 0, len(c.Devices))
	for i, d := range c.Devices {
		if d.AdminAccess {
			continue
		}
		ds := deviceStatus{device: d}
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
				ds.asked = append(ds.asked, limitPinnedMemory)
				ds.notEnforced = append(ds.notEnforced, limitPinnedMemory)
			} else {
				st.Enforced["memory"] = "not limited: no pinned memory limit was asked for"
			}
			st.ActiveThreadPercentage = int32(limits.ThreadPercentage)
			if st.ActiveThreadPercentage > 0 {
				st.Enforced["compute"] = "not enforced against the client: MPS applies the active thread percentage in the client's environment (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE); a container that changes its environment is not bound"
				ds.asked = append(ds.asked, limitThreadPercentage)
				ds.notEnforced = append(ds.notEnforced, limitThreadPercentage)
			} else {
				st.Enforced["compute"] = "not limited: clients share all SMs"
			}
			st.Enforced["faults"] = "not isolated: a fatal error in one MPS client affects every client of the GPU's MPS server, other claims' included"
			st.Enforced["server"] = "one MPS server per GPU, shared with every MPS claim on it; clients of another Linux user wait until it has no clients (MPS serves one user at a time)"
		case gpuapi.TimeSlicing:
			st.Enforced["memory"] = "not enforced: time-slicing has no memory limit"
			st.Enforced["compute"] = "not enforced: processes take turns; only the time slice length is set"
			st.Enforced["faults"] = "not isolated"
			// The time slice is a setting of the GPU that the driver
			// applies to every process on it.
			st.Enforced["timeSlice"] = "enforced: the driver applies the GPU's time slice to every process on it"
			ds.asked = append(ds.asked, limitTimeSlice)
		default:
			st.Enforced["memory"] = "not enforced between the pods that share this claim"
			st.Enforced["compute"] = "not enforced between the pods that share this claim"
		}
		if c.Sharing.IPC {
			st.Enforced["ipc"] = "every consumer of the claim gets the same directory at " + gpuapi.IPCDirectory
		}
		ds.data = st
		out = append(out, ds)
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
	for _, ds := range statuses {
		d, st := ds.device, ds.data
		data, err := json.Marshal(st)
		if err != nil {
			return err
		}
		condStatus, reason, message := ds.condition()
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
