//go:build tools

// The kubelet binary a real node runs (package realnode; make real-node
// builds it from here, at the Kubernetes version this module pins).
package devcluster

import _ "k8s.io/kubernetes/cmd/kubelet"
