package e2e

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/gpudra/gpudra/pkg/controller"
)

// groveDRA is the PodCliqueSet of issue 35's item 0, as the real Grove
// operator ran it: a base PodGang of two frontend pods, each with a claim of
// its own plus one shared by both (AllReplicas), and a worker scaling group
// of a primary and a shadow sharing a claim per replica; its second replica
// is a scaled PodGang. On one 8-GPU node.
const groveDRA = `apiVersion: grove.io/v1alpha1
kind: PodCliqueSet
metadata:
  name: grove-dra
spec:
  replicas: 1
  template:
    cliqueStartupType: CliqueStartupTypeAnyOrder
    resourceClaimTemplates:
    - name: all-shared-gpu
      templateSpec:
        spec:
          devices:
            requests:
            - name: gpu
              exactly:
                deviceClassName: gpu.gpudra.dev
    - name: rep-gpu
      templateSpec:
        spec:
          devices:
            requests:
            - name: gpu
              exactly:
                deviceClassName: gpu.gpudra.dev
    resourceSharing:
    - name: all-shared-gpu
      scope: AllReplicas
      filter:
        childCliqueNames: ["frontend"]
    podCliqueScalingGroups:
    - name: worker
      cliqueNames: ["primary", "shadow"]
      replicas: 2
      minAvailable: 1
      resourceSharing:
      - name: rep-gpu
        scope: PerReplica
    cliques:
    - name: frontend
      spec:
        roleName: frontend
        replicas: 2
        minAvailable: 2
        podSpec:
          nodeSelector:
            kubernetes.io/hostname: dgx-h100-1
          resourceClaims:
          - name: own
            resourceClaimTemplateName: own-gpu
          containers:
          - name: c
            image: nvcr.io/nvidia/cuda:12.8.0-base-ubuntu24.04
            command: ["sleep", "infinity"]
            resources:
              claims:
              - name: own
    - name: primary
      spec:
        roleName: primary
        replicas: 1
        minAvailable: 1
        podSpec:
          nodeSelector:
            kubernetes.io/hostname: dgx-h100-1
          containers:
          - name: c
            image: nvcr.io/nvidia/cuda:12.8.0-base-ubuntu24.04
            command: ["sleep", "infinity"]
    - name: shadow
      spec:
        roleName: shadow
        replicas: 1
        minAvailable: 1
        podSpec:
          nodeSelector:
            kubernetes.io/hostname: dgx-h100-1
          containers:
          - name: c
            image: nvcr.io/nvidia/cuda:12.8.0-base-ubuntu24.04
            command: ["sleep", "infinity"]
`

// TestGroveSharedClaimsOnTheWorkloadPath runs issue 35's item 0 through
// devcluster's Grove stand-in on the Workload API path, round after round:
// every pod of both PodGangs runs, no device is ever in two claims, the
// claims Grove shares between pods are written by gpudra from its plan and
// each pod's own claim by kube-scheduler.
func TestGroveSharedClaimsOnTheWorkloadPath(t *testing.T) {
	onGangPath(t, controller.GangModeAuto)
	ns := namespace(t)
	ctx := context.Background()
	create(t, ns, gpus("own-gpu", 1))
	manifest := filepath.Join(t.TempDir(), "grove-dra.yaml")
	require.NoError(t, os.WriteFile(manifest, []byte(groveDRA), 0o644))
	pcs := dyn(t).Resource(schema.GroupVersionResource{Group: "grove.io", Version: "v1alpha1", Resource: "podcliquesets"}).Namespace(ns)
	const pods = 6 // two frontends, two workers per scaling-group replica
	for round := range 3 {
		apply(t, ns, manifest)
		var doubles []string
		err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 90*time.Second, true, func(ctx context.Context) (bool, error) {
			var err error
			if doubles, err = doublyAllocated(ctx); err != nil || len(doubles) > 0 {
				return len(doubles) > 0, nil
			}
			list, err := cluster.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
			if err != nil {
				return false, nil
			}
			running := 0
			for _, p := range list.Items {
				if p.Status.Phase == v1.PodRunning {
					running++
				}
			}
			return running == pods, nil
		})
		require.Empty(t, doubles, "round %d: devices in two claims: %s", round, podStates(ns))
		require.NoError(t, err, "round %d: every pod of both PodGangs runs: %s", round, podStates(ns))

		claims, err := cluster.Client.ResourceV1().ResourceClaims(ns).List(ctx, metav1.ListOptions{})
		require.NoError(t, err)
		shared, own := 0, 0
		scheduler := ""
		for _, cl := range claims.Items {
			if owner := metav1.GetControllerOf(&cl); owner != nil && owner.Kind == "Pod" {
				own++
				scheduler = allocationWriter(&cl)
			}
		}
		require.NotEmpty(t, scheduler)
		for _, cl := range claims.Items {
			if owner := metav1.GetControllerOf(&cl); owner == nil || owner.Kind != "Pod" {
				shared++
				assert.NotEqual(t, scheduler, allocationWriter(&cl), "round %d: shared claim %s allocated by gpudra, not by %s", round, cl.Name, scheduler)
			}
		}
		assert.Equal(t, 2, own, "round %d: the frontends' own claims", round)
		assert.Equal(t, 3, shared, "round %d: the frontends' shared claim and one per worker replica", round)

		require.NoError(t, pcs.Delete(ctx, "grove-dra", metav1.DeleteOptions{}))
		left := ""
		require.NoError(t, wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 90*time.Second, true, func(ctx context.Context) (bool, error) {
			list, err := cluster.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
			if err != nil {
				return false, nil
			}
			cls, err := cluster.Client.ResourceV1().ResourceClaims(ns).List(ctx, metav1.ListOptions{})
			if err != nil {
				return false, nil
			}
			// And its PodGroups: a PodGang made again under the same name
			// while the old one's PodGroup is still there is placed by
			// kube-scheduler under that PodGroup, past gpudra (docs/gangs.md).
			groups, err := cluster.Client.SchedulingV1beta1().PodGroups(ns).List(ctx, metav1.ListOptions{})
			if err != nil {
				return false, nil
			}
			_, gerr := pcs.Get(ctx, "grove-dra", metav1.GetOptions{})
			left = fmt.Sprintf("%d pods, %d claims, PodCliqueSet: %v, PodGroups:", len(list.Items), len(cls.Items), gerr)
			for _, g := range groups.Items {
				left += fmt.Sprintf(" %s (deleting: %v, finalizers %v, owners %v)", g.Name, g.DeletionTimestamp != nil, g.Finalizers, g.OwnerReferences)
			}
			return len(list.Items) == 0 && len(cls.Items) == 0 && len(groups.Items) == 0 && apierrors.IsNotFound(gerr), nil
		}), "round %d: the PodCliqueSet, its pods, claims and PodGroups are gone: %s", round, left)
	}
}
