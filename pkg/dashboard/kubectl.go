package dashboard

import "fmt"

// The kubectl commands the page offers beside each object, so that a
// person can look at what the dashboard summarises with their own tools
// (and their own RBAC). Read-only commands only: the dashboard never
// suggests a change.

func kubectlClaim(namespace, name string) string {
	// One per holder, thousands per View: no Sprintf.
	return "kubectl get resourceclaim -n " + namespace + " " + name + " -o yaml"
}

func kubectlPod(namespace, name string) string {
	return fmt.Sprintf("kubectl describe pod -n %s %s", namespace, name)
}

func kubectlNodeSlices(node string) string {
	return "kubectl get resourceslices --field-selector spec.nodeName=" + node
}

func kubectlQueue(name string) string {
	return fmt.Sprintf("kubectl get gpuqueue %s -o yaml", name)
}

func kubectlReservation(namespace, name string) string {
	return fmt.Sprintf("kubectl get gpureservation -n %s %s -o yaml", namespace, name)
}

func kubectlGang(namespace, name string) string {
	return fmt.Sprintf("kubectl get pods -n %s -l gpudra.dev/gang=%s", namespace, name)
}

// kubectlGet shows a namespaced object of any kind (a RayJob, a Kueue
// Workload, the Job it belongs to).
func kubectlGet(resource, namespace, name string) string {
	return fmt.Sprintf("kubectl get %s -n %s %s -o yaml", resource, namespace, name)
}
