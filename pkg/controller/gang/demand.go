package gang

import (
	"maps"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
)

// Demand, for autoscalers and people (gpudra_class_demand_devices): the
// devices of each DeviceClass that nothing holds yet but something waits
// for, by source:
//   - gangs and reservations: the queued ones (planQueues), node pool ""
//     (the controller chooses their nodes, across pools);
//   - pending_pods: the unallocated claims of pods not bound to a node
//     and in no gang, counted from the claims (a claim several pods share
//     once), in the node pool the pod's nodeSelector names, else "".
// Computed in each round and each tick of an idle controller whose counts
// are stale (countClasses): a scrape only reads the gauges.

// DefaultNodePoolLabels are the node labels that name a node's pool, tried
// in order: Karpenter's, EKS managed node groups', GKE's and AKS's.
var DefaultNodePoolLabels = []string{"karpenter.sh/nodepool", "eks.amazonaws.com/nodegroup", "cloud.google.com/gke-nodepool", "kubernetes.azure.com/agentpool"}

// Sources of demand.
const (
	DemandGangs        = "gangs"
	DemandReservations = "reservations"
	DemandPendingPods  = "pending_pods"
)

// demandKey is one series of gpudra_class_demand_devices.
type demandKey struct{ class, pool, source string }

// pendingIndex indexes the pods that may wait on a claim: not bound, not
// ended, with claims, in no gang (a gang's demand is its own source).
const pendingIndex = "pendingClaims"

func pendingWithClaims(obj any) ([]string, error) {
	p, ok := obj.(*corev1.Pod)
	if !ok || p.Spec.NodeName != "" || !member(p) || len(p.Spec.ResourceClaims) == 0 {
		return nil, nil
	}
	if name, _ := gangKey(p); name != "" {
		return nil, nil
	}
	return []string{"pending"}, nil
}

// pendingDemand counts the devices that the unallocated claims of pending
// pods ask for, per class and node pool. A claim not made yet (from a
// template) is not counted until it is; a request for all matching
// devices (allocationMode All) has no count and is left out.
func pendingDemand(pods []*corev1.Pod, claim func(namespace, name string) *resourceapi.ResourceClaim, poolLabels []string) map[demandKey]float64 {
	out := map[demandKey]float64{}
	counted := map[string]bool{}
	for _, p := range pods {
		pool := NodePool(p.Spec.NodeSelector, poolLabels)
		for _, name := range podClaimNames(p) {
			key := p.Namespace + "/" + name
			if counted[key] {
				continue
			}
			cl := claim(p.Namespace, name)
			if cl == nil || cl.Status.Allocation != nil {
				continue
			}
			counted[key] = true
			for _, r := range cl.Spec.Devices.Requests {
				if class, n, ok := requestCount(r); ok {
					out[demandKey{class, pool, DemandPendingPods}] += float64(n)
				}
			}
		}
	}
	return out
}

// podClaimNames are the names of a pod's claims: named ones, and those the
// resource claim controller made from templates (in the pod's status).
func podClaimNames(p *corev1.Pod) []string {
	made := map[string]string{}
	for _, st := range p.Status.ResourceClaimStatuses {
		if st.ResourceClaimName != nil {
			made[st.Name] = *st.ResourceClaimName
		}
	}
	var out []string
	for _, pc := range p.Spec.ResourceClaims {
		switch {
		case pc.ResourceClaimName != nil:
			out = append(out, *pc.ResourceClaimName)
		case made[pc.Name] != "":
			out = append(out, made[pc.Name])
		}
	}
	return out
}

// requestCount is the class and the number of devices a request asks for
// (of a prioritized list, its first choice's).
func requestCount(r resourceapi.DeviceRequest) (string, int64, bool) {
	class, mode, count := "", resourceapi.DeviceAllocationModeExactCount, int64(0)
	switch {
	case r.Exactly != nil:
		class, mode, count = r.Exactly.DeviceClassName, r.Exactly.AllocationMode, r.Exactly.Count
	case len(r.FirstAvailable) > 0:
		s := r.FirstAvailable[0]
		class, mode, count = s.DeviceClassName, s.AllocationMode, s.Count
	default:
		return "", 0, false
	}
	if mode == resourceapi.DeviceAllocationModeAll {
		return "", 0, false
	}
	return class, max(count, 1), true
}

// queueSource is the demand source of a queued item.
func queueSource(kind string) string {
	if kind == KindReservation {
		return DemandReservations
	}
	return DemandGangs
}

// setDemand sets gpudra_class_demand_devices from the last round's queued
// items and the pending pods now. Every class has a series per source in
// pool "" (0 when nothing waits: known to be none, not unknown); a class
// or pool nothing waits for any more leaves none behind.
func (c *Controller) setDemand() {
	demand := maps.Clone(c.queuedDemand)
	if demand == nil {
		demand = map[demandKey]float64{}
	}
	if c.pods != nil && c.claims != nil {
		objs, _ := c.pods.ByIndex(pendingIndex, "pending")
		pods := make([]*corev1.Pod, 0, len(objs))
		for _, o := range objs {
			pods = append(pods, o.(*corev1.Pod))
		}
		for k, v := range pendingDemand(pods, c.claim, c.opts.NodePoolLabels) {
			demand[k] += v
		}
	}
	for class := range c.counter.snapshot() {
		for _, src := range []string{DemandGangs, DemandReservations, DemandPendingPods} {
			k := demandKey{class, "", src}
			demand[k] += 0
		}
	}
	seen := map[demandKey]bool{}
	for k, v := range demand {
		seen[k] = true
		c.metrics.demand.WithLabelValues(k.class, k.pool, k.source).Set(v)
	}
	for k := range c.demandSeries {
		if !seen[k] {
			c.metrics.demand.DeleteLabelValues(k.class, k.pool, k.source)
		}
	}
	c.demandSeries = seen
}
