package e2e

import (
	"context"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"

	"github.com/gpudra/gpudra/pkg/sharing"
)

// TestTokenControllerFillsServiceAccountTokenSecret: kube-controller-manager's
// token controller runs in devcluster, as operators such as Grove need.
func TestTokenControllerFillsServiceAccountTokenSecret(t *testing.T) {
	ns := namespace(t)
	ctx := context.Background()
	_, err := cluster.Client.CoreV1().ServiceAccounts(ns).Create(ctx, &v1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "operator"}}, metav1.CreateOptions{})
	require.NoError(t, err)
	_, err = cluster.Client.CoreV1().Secrets(ns).Create(ctx, &v1.Secret{
		ObjectMeta: metav1.ObjectMeta{Name: "operator-token", Annotations: map[string]string{v1.ServiceAccountNameKey: "operator"}},
		Type:       v1.SecretTypeServiceAccountToken}, metav1.CreateOptions{})
	require.NoError(t, err)
	var secret *v1.Secret
	require.Eventually(t, func() bool {
		secret, err = cluster.Client.CoreV1().Secrets(ns).Get(ctx, "operator-token", metav1.GetOptions{})
		return err == nil && len(secret.Data[v1.ServiceAccountTokenKey]) > 0
	}, 30*time.Second, 100*time.Millisecond, "the token controller fills the Secret")
	assert.Equal(t, ns, string(secret.Data[v1.ServiceAccountNamespaceKey]))
	assert.NotEmpty(t, secret.Annotations[v1.ServiceAccountUIDKey])
	// The service-account controller makes every namespace's "default".
	require.Eventually(t, func() bool {
		_, err := cluster.Client.CoreV1().ServiceAccounts(ns).Get(ctx, "default", metav1.GetOptions{})
		return err == nil
	}, 30*time.Second, 100*time.Millisecond)
}

var podGangGVR = schema.GroupVersionResource{Group: "scheduler.grove.io", Version: "v1alpha1", Resource: "podgangs"}

// grovePod waits for the one Running pod of a PodClique.
func grovePod(t *testing.T, ns, clique string) *v1.Pod {
	t.Helper()
	var pod *v1.Pod
	require.Eventually(t, func() bool {
		pods, err := cluster.Client.CoreV1().Pods(ns).List(context.Background(), metav1.ListOptions{LabelSelector: "grove.io/podclique=" + clique})
		if err != nil || len(pods.Items) != 1 {
			return false
		}
		pod = &pods.Items[0]
		return pod.Status.Phase == v1.PodRunning
	}, 90*time.Second, 200*time.Millisecond, "PodClique %s: one Running pod; last seen: %s", clique, describe(pod))
	return pod
}

// assertGroveClaim checks a claim Grove made: its labels and its controller.
func assertGroveClaim(t *testing.T, ns, name, ownerKind, ownerName string, extraLabels map[string]string) *resourceapi.ResourceClaim {
	t.Helper()
	claim, err := cluster.Client.ResourceV1().ResourceClaims(ns).Get(context.Background(), name, metav1.GetOptions{})
	require.NoError(t, err, "claim %s", name)
	want := map[string]string{"app.kubernetes.io/managed-by": "grove-operator", "app.kubernetes.io/part-of": "grove-demo",
		"app.kubernetes.io/component": "resource-claim"}
	for k, v := range extraLabels {
		want[k] = v
	}
	assert.Equal(t, want, claim.Labels, "labels of claim %s", name)
	ref := metav1.GetControllerOf(claim)
	require.NotNil(t, ref, "claim %s has a controller", name)
	assert.Equal(t, "grove.io/v1alpha1", ref.APIVersion)
	assert.Equal(t, ownerKind, ref.Kind, "claim %s", name)
	assert.Equal(t, ownerName, ref.Name, "claim %s", name)
	return claim
}

// assertClaimsInjected checks that the pod references exactly these claims,
// in this order, each under its own name, in every container.
func assertClaimsInjected(t *testing.T, pod *v1.Pod, claims ...string) {
	t.Helper()
	var got []string
	for _, c := range pod.Spec.ResourceClaims {
		require.NotNil(t, c.ResourceClaimName)
		assert.Equal(t, c.Name, *c.ResourceClaimName)
		got = append(got, c.Name)
	}
	assert.Equal(t, claims, got, "pod %s", pod.Name)
	for _, c := range pod.Spec.Containers {
		var names []string
		for _, rc := range c.Resources.Claims {
			names = append(names, rc.Name)
		}
		assert.Equal(t, claims, names, "container %s of pod %s", c.Name, pod.Name)
	}
}

func TestGrovePodCliqueSetSharingLevels(t *testing.T) {
	ns := namespace(t)
	ctx := context.Background()
	dyn, err := dynamic.NewForConfig(cluster.RESTConfig)
	require.NoError(t, err)
	apply(t, ns, filepath.Join(examples, "grove"))
	t.Cleanup(func() {
		// The garbage collector takes what the PodCliqueSet owned.
		_ = dyn.Resource(schema.GroupVersionResource{Group: "grove.io", Version: "v1alpha1", Resource: "podcliquesets"}).Namespace(ns).
			Delete(ctx, "grove-demo", metav1.DeleteOptions{})
	})

	primary := grovePod(t, ns, "grove-demo-0-engine-0-primary")
	shadow := grovePod(t, ns, "grove-demo-0-engine-0-shadow")
	router := grovePod(t, ns, "grove-demo-0-router")

	// Grove's names and labels on the pods, its gate lifted.
	for _, p := range []*v1.Pod{primary, shadow, router} {
		clique := p.Labels["grove.io/podclique"]
		assert.True(t, strings.HasPrefix(p.Name, clique+"-"), "pod %s named after its PodClique", p.Name)
		assert.Equal(t, "grove-operator", p.Labels["app.kubernetes.io/managed-by"])
		assert.Equal(t, "grove-demo", p.Labels["app.kubernetes.io/part-of"])
		assert.Equal(t, "grove-demo-0", p.Labels["grove.io/podgang"])
		assert.Equal(t, "0", p.Labels["grove.io/podclique-pod-index"])
		assert.Empty(t, p.Spec.SchedulingGates, "pod %s: the gate is lifted", p.Name)
		ref := metav1.GetControllerOf(p)
		require.NotNil(t, ref)
		assert.Equal(t, "PodClique", ref.Kind)
		assert.Equal(t, clique, ref.Name)
	}
	assert.Equal(t, "grove-demo-0-engine", primary.Labels["grove.io/podcliquescalinggroup"])

	// The Secret Grove waits on was filled by the token controller.
	secret, err := cluster.Client.CoreV1().Secrets(ns).Get(ctx, "grove-demo-ic-sat", metav1.GetOptions{})
	require.NoError(t, err)
	assert.NotEmpty(t, secret.Data[v1.ServiceAccountTokenKey])

	// The three levels' claims, as Grove names, labels and owns them.
	engine := assertGroveClaim(t, ns, "grove-demo-0-engine-0-engine-gpu", "PodCliqueScalingGroup", "grove-demo-0-engine",
		map[string]string{"grove.io/podcliquescalinggroup": "grove-demo-0-engine", "grove.io/podcliquescalinggroup-replica-index": "0"})
	assertGroveClaim(t, ns, "grove-demo-all-pool-gpu", "PodCliqueSet", "grove-demo", nil)
	assertGroveClaim(t, ns, "grove-demo-0-router-all-router-gpu", "PodClique", "grove-demo-0-router",
		map[string]string{"grove.io/podclique": "grove-demo-0-router"})
	assertClaimsInjected(t, primary, "grove-demo-0-engine-0-engine-gpu")
	assertClaimsInjected(t, shadow, "grove-demo-0-engine-0-engine-gpu")
	assertClaimsInjected(t, router, "grove-demo-all-pool-gpu", "grove-demo-0-router-all-router-gpu")

	// The PerReplica scaling-group claim: primary and shadow on one node,
	// one GPU, the claim's sharing config (an IPC directory) in both.
	assert.Equal(t, primary.Spec.NodeName, shadow.Spec.NodeName)
	pv, sv := views(t, primary)["engine"], views(t, shadow)["engine"]
	require.Len(t, pv.VisibleGPUs(), 1)
	assert.Equal(t, pv.VisibleGPUs(), sv.VisibleGPUs(), "the same GPU in both")
	_, dev := onlyDevice(t, podClaim(t, primary, "grove-demo-0-engine-0-engine-gpu"))
	assert.Equal(t, []string{seenUUID(t, primary.Spec.NodeName, dev)}, pv.VisibleGPUs())
	require.Len(t, pv.Mounts, 1)
	assert.True(t, strings.HasSuffix(pv.Mounts[0], ":/var/run/gpudra/ipc"), pv.Mounts[0])
	assert.Equal(t, pv.Mounts, sv.Mounts, "one IPC directory for both")
	assert.Equal(t, "/var/run/gpudra/ipc", sv.Env["GPUDRA_IPC_DIR"])
	engine, err = cluster.Client.ResourceV1().ResourceClaims(ns).Get(ctx, engine.Name, metav1.GetOptions{})
	require.NoError(t, err)
	assert.Len(t, engine.Status.ReservedFor, 2, "primary and shadow are the claim's consumers")
	// The router has the AllReplicas and the PodClique-level claim's GPUs:
	// two devices, both device nodes in its container.
	rv := views(t, router)["router"]
	_, pool := onlyDevice(t, podClaim(t, router, "grove-demo-all-pool-gpu"))
	_, own := onlyDevice(t, podClaim(t, router, "grove-demo-0-router-all-router-gpu"))
	assert.NotEqual(t, attr(pool, "uuid"), attr(own, "uuid"))
	assert.NotEqual(t, attr(dev, "uuid"), attr(pool, "uuid"))
	assert.Contains(t, rv.DeviceNodes, "/dev/nvidia"+attr(pool, "minor"))
	assert.Contains(t, rv.DeviceNodes, "/dev/nvidia"+attr(own, "minor"))

	// The PodGang holds every pod, clique by clique.
	gang, err := dyn.Resource(podGangGVR).Namespace(ns).Get(ctx, "grove-demo-0", metav1.GetOptions{})
	require.NoError(t, err)
	groups, _, _ := unstructured.NestedSlice(gang.Object, "spec", "podgroups")
	refs := map[string]string{}
	for _, g := range groups {
		m := g.(map[string]any)
		podRefs := m["podReferences"].([]any)
		require.Len(t, podRefs, 1, "podgroup %s", m["name"])
		refs[m["name"].(string)] = podRefs[0].(map[string]any)["name"].(string)
		assert.EqualValues(t, 1, m["minReplicas"])
	}
	assert.Equal(t, map[string]string{"grove-demo-0-engine-0-primary": primary.Name, "grove-demo-0-engine-0-shadow": shadow.Name,
		"grove-demo-0-router": router.Name}, refs)
}

// classPods makes two pods on one claim of a class, with no config in the
// claim.
func classPods(t *testing.T, ns, class string) (*v1.Pod, *v1.Pod) {
	t.Helper()
	_, err := cluster.Client.ResourceV1().ResourceClaims(ns).Create(context.Background(), &resourceapi.ResourceClaim{
		ObjectMeta: metav1.ObjectMeta{Name: "shared"},
		Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{Requests: []resourceapi.DeviceRequest{{Name: "gpu",
			Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: class}}}}}}, metav1.CreateOptions{})
	require.NoError(t, err)
	for _, name := range []string{"a", "b"} {
		pod := gpuPod(name, "")
		pod.Spec.ResourceClaims = []v1.PodResourceClaim{{Name: "gpu", ResourceClaimName: ptr("shared")}}
		create(t, ns, nil, pod)
	}
	return waitRunning(t, ns, "a"), waitRunning(t, ns, "b")
}

func TestClassMPSAppliesTheClassConfig(t *testing.T) {
	ns := namespace(t)
	a, b := classPods(t, ns, "gpu-mps.gpudra.dev")
	node := a.Spec.NodeName
	assert.Equal(t, node, b.Spec.NodeName)
	server := waitMPSServers(t, node, 1)[0]
	for _, p := range []*v1.Pod{a, b} {
		v := views(t, p)["cuda"]
		assert.Equal(t, sharing.MPSPipeDirectory, v.Env["CUDA_MPS_PIPE_DIRECTORY"], "pod %s", p.Name)
		assert.ElementsMatch(t, []string{filepath.Join(server.Dir, "pipe") + ":" + sharing.MPSPipeDirectory, filepath.Join(server.Dir, "shm") + ":/dev/shm"},
			v.Mounts, "pod %s: the GPU's server's pipe directory and /dev/shm", p.Name)
		assertSeesMPSServer(t, p.Name, v)
	}
	assert.Equal(t, views(t, a)["cuda"].VisibleGPUs(), strings.Split(server.Pod.Annotations["gpu.gpudra.dev/mps-devices"], ","))
	st := deviceStatus(t, podClaim(t, a, "gpu"))
	assert.Contains(t, st.Enforced["faults"], "not isolated")
	deleteAllPods(t, ns)
	require.Eventually(t, func() bool { return len(mpsServers(t, node)) == 0 }, 30*time.Second, 100*time.Millisecond)
}

func TestClassTimeSlicedAppliesTheClassConfig(t *testing.T) {
	ns := namespace(t)
	a, b := classPods(t, ns, "gpu-timesliced.gpudra.dev")
	assert.Equal(t, a.Spec.NodeName, b.Spec.NodeName)
	uuid := views(t, a)["cuda"].VisibleGPUs()
	require.Len(t, uuid, 1)
	assert.Equal(t, uuid, views(t, b)["cuda"].VisibleGPUs())
	machine := cluster.Node(a.Spec.NodeName).Machine
	assert.Equal(t, 3, machine.TimeSlice(uuid[0]), "the class's interval Long is nvidia-smi's --set-timeslice 3")
	st := deviceStatus(t, podClaim(t, a, "gpu"))
	assert.Equal(t, "not enforced: time-slicing has no memory limit", st.Enforced["memory"])
	deleteAllPods(t, ns)
	assert.Equal(t, 0, machine.TimeSlice(uuid[0]), "restored with the last claim")
}
