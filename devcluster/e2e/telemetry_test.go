package e2e

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// attribution is one scrape's claim attribution series of a node: the
// claim_info series' labels, and gpudra_device_free by device.
type attribution struct {
	info []map[string]string
	free map[string]float64
}

// scrapeAttribution scrapes the node's telemetry (scrapeNode) and keeps
// its claim attribution series.
func scrapeAttribution(t *testing.T, node string) attribution {
	t.Helper()
	s := scrapeNode(t, node)
	a := attribution{free: map[string]float64{}}
	for _, m := range s.series["gpudra_device_claim_info"] {
		a.info = append(a.info, m.labels)
	}
	for _, m := range s.series["gpudra_device_free"] {
		a.free[m.labels["dra_device_name"]] = m.value
	}
	return a
}

// inNamespace are the claim_info series of the claims in ns.
func (a attribution) inNamespace(ns string) []map[string]string {
	var out []map[string]string
	for _, l := range a.info {
		if l["dra_claim_namespace"] == ns {
			out = append(out, l)
		}
	}
	return out
}

// TestTelemetryAttributesClaims: a devcluster node exports the telemetry
// the kubelet plugin's binary does (issue 36), with its devices attributed
// to the claims its plugin prepared: one claim_info series for a pod's
// claim, on the device the claim was allocated, that device not free and
// every other one free; a pod without a claim in no series; and the
// device free again, its series gone, once the pod and its claim are.
func TestTelemetryAttributesClaims(t *testing.T) {
	const node = "dgx-h100-1" // MIG off: eight whole GPUs
	ns := namespace(t)
	claimed := gpuPod("claimed", "one")
	pinned(node)(claimed)
	plain := &v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "plain"}, Spec: v1.PodSpec{RestartPolicy: v1.RestartPolicyNever,
		Containers: []v1.Container{{Name: "c", Image: "nvcr.io/nvidia/cuda:12.8.0-base-ubuntu24.04"}}}}
	pinned(node)(plain)
	create(t, ns, gpus("one", 1), claimed, plain)
	pod := waitRunning(t, ns, "claimed")
	waitRunning(t, ns, "plain")
	claim := podClaim(t, pod, "gpu")
	result, _ := onlyDevice(t, claim)
	require.Equal(t, node, result.Pool, "the claim's device is on %s", node)

	var a attribution
	require.Eventually(t, func() bool {
		a = scrapeAttribution(t, node)
		return len(a.inNamespace(ns)) > 0
	}, 10*time.Second, 200*time.Millisecond, "no claim_info series for the claim %s/%s", ns, claim.Name)
	series := a.inNamespace(ns)
	require.Len(t, series, 1, "one series for the one claim, none for the pod without a claim: %v", series)
	assert.Equal(t, ns, series[0]["dra_claim_namespace"])
	assert.Equal(t, claim.Name, series[0]["dra_claim_name"])
	assert.Equal(t, string(claim.UID), series[0]["claim_uid"])
	assert.Equal(t, result.Device, series[0]["dra_device_name"], "the series is on the device the claim was allocated")
	assert.Equal(t, node, series[0]["node"])
	require.Len(t, a.free, 8, "gpudra_device_free for each of the node's GPUs: %v", a.free)
	for dev, free := range a.free {
		if dev == result.Device {
			assert.Equal(t, 0.0, free, "the claimed device %s is not free", dev)
		} else {
			assert.Equal(t, 1.0, free, "device %s, held by no claim, is free", dev)
		}
	}

	ctx := context.Background()
	require.NoError(t, cluster.Client.CoreV1().Pods(ns).Delete(ctx, "claimed", metav1.DeleteOptions{}))
	waitPodGone(t, ns, "claimed")
	// The claim goes with its pod (its owner); delete it unless it is gone.
	if err := cluster.Client.ResourceV1().ResourceClaims(ns).Delete(ctx, claim.Name, metav1.DeleteOptions{}); !apierrors.IsNotFound(err) {
		require.NoError(t, err)
	}
	require.Eventually(t, func() bool {
		a = scrapeAttribution(t, node)
		return len(a.inNamespace(ns)) == 0 && a.free[result.Device] == 1
	}, 10*time.Second, 200*time.Millisecond, "device %s not free again, or the claim's series still there", result.Device)
	for dev, free := range a.free {
		assert.Equal(t, 1.0, free, "device %s is free with no claim on the node", dev)
	}
}
