// Package kueue is what gpudra reads of Kueue (sigs.k8s.io/kueue, v0.17,
// kueue.x-k8s.io/v1beta2), as unstructured objects: gpudra does not import
// Kueue's module, which pins other Kubernetes versions. One workload's
// state (admitted, or pending and why) is read here for the dashboard and
// gpudra jobs alike (docs/queues.md).
package kueue

import (
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
)

// Kueue's resources.
var (
	Workloads       = schema.GroupVersionResource{Group: "kueue.x-k8s.io", Version: "v1beta2", Resource: "workloads"}
	LocalQueues     = schema.GroupVersionResource{Group: "kueue.x-k8s.io", Version: "v1beta2", Resource: "localqueues"}
	ClusterQueues   = schema.GroupVersionResource{Group: "kueue.x-k8s.io", Version: "v1beta2", Resource: "clusterqueues"}
	ResourceFlavors = schema.GroupVersionResource{Group: "kueue.x-k8s.io", Version: "v1beta2", Resource: "resourceflavors"}
	Cohorts         = schema.GroupVersionResource{Group: "kueue.x-k8s.io", Version: "v1beta2", Resource: "cohorts"}
)

// The states of a Workload, as gpudra shows them.
const (
	Pending  = "pending"
	Reserved = "quota reserved"
	Admitted = "admitted"
	Finished = "finished"
	Inactive = "inactive"
)

// Status is where Kueue has a workload.
type Status struct {
	// Workload names the kueue.x-k8s.io Workload.
	Workload string `json:"workload"`
	// LocalQueue is spec.queueName; ClusterQueue the queue it was
	// admitted to, else its LocalQueue's where read.
	LocalQueue   string `json:"localQueue,omitempty"`
	ClusterQueue string `json:"clusterQueue,omitempty"`
	// State is one of the state constants.
	State string `json:"state"`
	// Reason and Message say why it is not admitted: the QuotaReserved
	// condition's when False ("couldn't assign flavors to pod set main:
	// insufficient unused quota ..."), else the Evicted condition's.
	Reason  string `json:"reason,omitempty"`
	Message string `json:"message,omitempty"`
}

// StatusOf reads a Workload's state from its conditions. clusterQueueOf
// maps "<namespace>/<LocalQueue>" to its ClusterQueue (nil: not read).
func StatusOf(w *unstructured.Unstructured, clusterQueueOf map[string]string) Status {
	st := Status{Workload: w.GetName(), State: Pending}
	st.LocalQueue, _, _ = unstructured.NestedString(w.Object, "spec", "queueName")
	st.ClusterQueue, _, _ = unstructured.NestedString(w.Object, "status", "admission", "clusterQueue")
	if st.ClusterQueue == "" && st.LocalQueue != "" {
		st.ClusterQueue = clusterQueueOf[w.GetNamespace()+"/"+st.LocalQueue]
	}
	conds := map[string]metav1.Condition{}
	raw, _, _ := unstructured.NestedSlice(w.Object, "status", "conditions")
	for _, r := range raw {
		m, ok := r.(map[string]any)
		if !ok {
			continue
		}
		c := metav1.Condition{}
		c.Type, _ = m["type"].(string)
		s, _ := m["status"].(string)
		c.Status = metav1.ConditionStatus(s)
		c.Reason, _ = m["reason"].(string)
		c.Message, _ = m["message"].(string)
		conds[c.Type] = c
	}
	is := func(t string, s metav1.ConditionStatus) bool { c, ok := conds[t]; return ok && c.Status == s }
	active, found, _ := unstructured.NestedBool(w.Object, "spec", "active")
	switch {
	case is("Finished", metav1.ConditionTrue):
		st.State = Finished
	case is("Admitted", metav1.ConditionTrue):
		st.State = Admitted
	case is("QuotaReserved", metav1.ConditionTrue):
		// Quota held, admission checks not all passed yet.
		st.State = Reserved
	case found && !active:
		st.State = Inactive
	}
	if st.State == Pending || st.State == Inactive {
		switch {
		case is("QuotaReserved", metav1.ConditionFalse):
			st.Reason, st.Message = conds["QuotaReserved"].Reason, conds["QuotaReserved"].Message
		case is("Evicted", metav1.ConditionTrue):
			st.Reason, st.Message = conds["Evicted"].Reason, conds["Evicted"].Message
		}
	}
	return st
}

// ByOwner indexes Workloads by the UID of the object each belongs to (its
// controller owner: the Job or RayJob Kueue made it for).
func ByOwner(ws []unstructured.Unstructured) map[types.UID]*unstructured.Unstructured {
	out := map[types.UID]*unstructured.Unstructured{}
	for i := range ws {
		for _, o := range ws[i].GetOwnerReferences() {
			if o.Controller != nil && *o.Controller {
				out[o.UID] = &ws[i]
			}
		}
	}
	return out
}
