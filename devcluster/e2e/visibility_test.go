package e2e

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/dynamic"

	"github.com/gpudra/gpudra/pkg/cdi"
)

// visibilityPCS is a Grove-shaped pair with two claims per container: the
// primary and the shadow of each scaling-group replica share that replica's
// claim (PerReplica) and, with every other replica, the PodCliqueSet's
// AllReplicas claim, which a filter gives to the scaling group only.
const visibilityPCS = `apiVersion: grove.io/v1alpha1
kind: PodCliqueSet
metadata:
  name: %s
spec:
  replicas: 1
  template:
    cliqueStartupType: CliqueStartupTypeAnyOrder
    resourceClaimTemplates:
    - name: engine-gpu
      templateSpec:
        spec:
          devices:
            requests:
            - name: gpu
              exactly:
                deviceClassName: gpu.gpudra.dev
                selectors:
                - cel:
                    expression: '!("sharing" in device.attributes["gpu.gpudra.dev"])'
    - name: pool-gpu
      templateSpec:
        spec:
          devices:
            requests:
            - name: gpu
              exactly:
                deviceClassName: gpu.gpudra.dev
                selectors:
                - cel:
                    expression: '!("sharing" in device.attributes["gpu.gpudra.dev"])'
    resourceSharing:
    - name: pool-gpu
      scope: AllReplicas
      filter:
        childScalingGroupNames: ["engine"]
    podCliqueScalingGroups:
    - name: engine
      cliqueNames: ["primary", "shadow"]
      replicas: %d
      minAvailable: 1
      resourceSharing:
      - name: engine-gpu
        scope: PerReplica
    cliques:
    - name: primary
      spec:
        roleName: primary
        replicas: 1
        minAvailable: 1
        podSpec:
          containers:
          - name: engine
            image: nvcr.io/nvidia/cuda:12.8.0-base-ubuntu24.04
            command: ["bash", "-c", "nvidia-smi -L && sleep infinity"]
    - name: shadow
      spec:
        roleName: shadow
        replicas: 1
        minAvailable: 1
        podSpec:
          containers:
          - name: engine
            image: nvcr.io/nvidia/cuda:12.8.0-base-ubuntu24.04
            command: ["bash", "-c", "nvidia-smi -L && sleep infinity"]
`

// deviceEnvUUIDs are the UUIDs the container's env names, one variable per
// device.
func deviceEnvUUIDs(env map[string]string) []string {
	var out []string
	for k, v := range env {
		if strings.HasPrefix(k, cdi.DeviceEnvPrefix) && strings.HasSuffix(k, "_UUID") {
			out = append(out, v)
		}
	}
	sort.Strings(out)
	return out
}

// TestVisibilityGroveTwoClaimsPerContainer: the primary and the shadow of a
// Grove scaling group, each with the set-level claim and the scaling-group
// claim in one container, see both GPUs, the same ones in both, in every
// run: nothing one claim's CDI spec sets overwrites the other's, whichever
// order the kubelet lists the claims in. Ten runs of create, check, delete,
// two scaling-group replicas each (twenty pairs).
func TestVisibilityGroveTwoClaimsPerContainer(t *testing.T) {
	const runs, groupReplicas = 10, 2
	ns := namespace(t)
	ctx := context.Background()
	dyn, err := dynamic.NewForConfig(cluster.RESTConfig)
	require.NoError(t, err)
	pcsGVR := schema.GroupVersionResource{Group: "grove.io", Version: "v1alpha1", Resource: "podcliquesets"}
	dir := t.TempDir()
	pairs := 0
	for run := range runs {
		name := fmt.Sprintf("vis-%d", run)
		path := filepath.Join(dir, name+".yaml")
		require.NoError(t, os.WriteFile(path, []byte(fmt.Sprintf(visibilityPCS, name, groupReplicas)), 0o644))
		start := time.Now()
		apply(t, ns, path)
		pool := name + "-all-pool-gpu"
		for g := range groupReplicas {
			group := fmt.Sprintf("%s-0-engine-%d", name, g)
			engine := group + "-engine-gpu"
			primary := grovePod(t, ns, group+"-primary")
			shadow := grovePod(t, ns, group+"-shadow")
			assertClaimsInjected(t, primary, pool, engine)
			assertClaimsInjected(t, shadow, pool, engine)
			_, poolDev := onlyDevice(t, podClaim(t, primary, pool))
			_, engineDev := onlyDevice(t, podClaim(t, primary, engine))
			require.NotEqual(t, attr(poolDev, "uuid"), attr(engineDev, "uuid"))
			want := []string{seenUUID(t, primary.Spec.NodeName, poolDev), seenUUID(t, primary.Spec.NodeName, engineDev)}
			sort.Strings(want)
			for _, p := range []*v1.Pod{primary, shadow} {
				v := views(t, p)["engine"]
				var claimDevices []string
				for _, id := range v.CDIDevices {
					if strings.HasPrefix(id, cdi.Vendor+"/"+cdi.Class+"=") {
						claimDevices = append(claimDevices, id)
					}
				}
				assert.Len(t, claimDevices, 2, "run %d, pod %s: one CDI device per claim: %v", run, p.Name, v.CDIDevices)
				got := append([]string(nil), v.VisibleGPUs()...)
				sort.Strings(got)
				assert.Equal(t, want, got, "run %d, pod %s: both claims' GPUs, from the device nodes", run, p.Name)
				assert.Equal(t, want, deviceEnvUUIDs(v.Env), "run %d, pod %s: each device's identity", run, p.Name)
				assert.Empty(t, v.Conflicts, "run %d, pod %s: nothing one claim sets is overwritten by the other", run, p.Name)
				assert.Equal(t, "void", v.Env["NVIDIA_VISIBLE_DEVICES"], "run %d, pod %s", run, p.Name)
				assert.NotContains(t, v.Env, "CUDA_VISIBLE_DEVICES", "run %d, pod %s", run, p.Name)
				assert.Contains(t, v.DeviceNodes, "/dev/nvidia"+attr(poolDev, "minor"), "run %d, pod %s", run, p.Name)
				assert.Contains(t, v.DeviceNodes, "/dev/nvidia"+attr(engineDev, "minor"), "run %d, pod %s", run, p.Name)
			}
			assert.Equal(t, views(t, primary)["engine"].VisibleGPUs(), views(t, shadow)["engine"].VisibleGPUs(),
				"run %d, group %s: the same GPUs in primary and shadow", run, group)
			pairs++
		}
		// Delete and wait until the claims are gone, so the next run
		// starts from free GPUs.
		require.NoError(t, dyn.Resource(pcsGVR).Namespace(ns).Delete(ctx, name, metav1.DeleteOptions{}))
		deleteAllPods(t, ns)
		err := wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 60*time.Second, true, func(ctx context.Context) (bool, error) {
			claims, err := cluster.Client.ResourceV1().ResourceClaims(ns).List(ctx, metav1.ListOptions{})
			return err == nil && len(claims.Items) == 0, nil
		})
		require.NoError(t, err, "run %d: claims not deleted", run)
		t.Logf("run %d: %d primary/shadow pairs checked in %s", run, groupReplicas, time.Since(start).Round(time.Millisecond))
	}
	assert.Equal(t, runs*groupReplicas, pairs)
}
