package plugin

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/klog/v2/ktesting"

	"github.com/gpudra/gpudra/pkg/nvdevice/sim"
	"github.com/gpudra/gpudra/pkg/slicebuilder"
)

// TestNodeMigPolicy: the Node's annotation overrides --mig-devices; one
// that does not parse, or a Node that cannot be read, leaves the flag's.
func TestNodeMigPolicy(t *testing.T) {
	flag := slicebuilder.MigPolicy{Existing: true}
	node := func(annotations map[string]string) *corev1.Node {
		return &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "n", Annotations: annotations}}
	}
	tests := []struct {
		name string
		node *corev1.Node
		want slicebuilder.MigPolicy
	}{
		{"no annotation", node(nil), flag},
		{"annotation", node(map[string]string{AnnotationMigDevices: "profiles=3g.40gb"}), slicebuilder.MigPolicy{Profiles: []string{"3g.40gb"}}},
		{"all on one node", node(map[string]string{AnnotationMigDevices: "all"}), slicebuilder.MigPolicy{}},
		{"invalid: the flag's", node(map[string]string{AnnotationMigDevices: "many"}), flag},
		{"no Node: the flag's", nil, flag},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, ctx := ktesting.NewTestContext(t)
			client := fake.NewClientset()
			if tt.node != nil {
				client = fake.NewClientset(tt.node)
			}
			assert.Equal(t, tt.want, nodeMigPolicy(ctx, client, "n", flag, nil))
		})
	}
}

// A GPU in MIG mode with no MIG device made publishes nothing under the
// existing policy (the default since issue 26); the plugin names it.
func TestUnpublishedMigGPUs(t *testing.T) {
	const spec = "name: partly\ngpuCount: 3\nmigEnabled: [1, 2]\nmigDevices:\n- {gpu: 2, profile: 3g.40gb, start: 4}\n"
	s, err := sim.ParseSpec([]byte(spec))
	require.NoError(t, err)
	m, err := sim.New(s, "n")
	require.NoError(t, err)
	inv, err := m.Inventory(context.Background())
	require.NoError(t, err)
	for _, tt := range []struct {
		policy slicebuilder.MigPolicy
		want   []int
	}{
		{slicebuilder.MigPolicy{Existing: true}, []int{1}}, // GPU 0: MIG off, whole; GPU 2: its instance
		{slicebuilder.MigPolicy{Profiles: []string{"1g.10gb"}}, nil},
		{slicebuilder.MigPolicy{}, nil},
	} {
		t.Run(tt.policy.String(), func(t *testing.T) {
			res, err := slicebuilder.Build(inv, "n", slicebuilder.Options{Mig: tt.policy})
			require.NoError(t, err)
			assert.Equal(t, tt.want, unpublishedMigGPUs(inv, res))
		})
	}
}

// TestPreparedMigDeviceStaysPublishedUntilReleased (issue 35): a policy
// narrowed while a claim holds a MIG device the plugin created (annotation
// changed, plugin restarted) keeps that device published at its placement;
// its release withdraws it, and only under such a policy does the unprepare
// republish (under all the slices do not change, as
// TestManagedMigChangesPublishNothing checks).
func TestPreparedMigDeviceStaysPublishedUntilReleased(t *testing.T) {
	const dev = "gpu-0-mig-3g-40gb-4"
	e := newEnv(t)
	ctx := context.Background()
	d := &Driver{state: e.start(), backend: e.machine, pool: pool, repub: newRepublisher()}
	out, err := d.PrepareResourceClaims(ctx, []*resourceapi.ResourceClaim{claim("u1", []string{dev})})
	require.NoError(t, err)
	require.NoError(t, out["u1"].Err)

	d = &Driver{state: e.start(), backend: e.machine, pool: pool, repub: newRepublisher(),
		migPolicy: slicebuilder.MigPolicy{Profiles: []string{"1g.10gb"}}}
	assert.True(t, publishedDevices(t, d)[dev], "prepared: published under a policy without its profile")

	errs, err := d.UnprepareResourceClaims(ctx, []kubeletplugin.NamespacedObject{{UID: "u1"}})
	require.NoError(t, err)
	require.NoError(t, errs["u1"])
	assert.True(t, queuedRepublish(d), "the release republishes")
	assert.False(t, publishedDevices(t, d)[dev], "released: withdrawn")
	assert.True(t, publishedDevices(t, d)["gpu-0-mig-1g-10gb-4"], "the policy's placements it overlapped are back")
}

func publishedDevices(t *testing.T, d *Driver) map[string]bool {
	t.Helper()
	res, _, err := d.Resources(context.Background())
	require.NoError(t, err)
	names := map[string]bool{}
	for _, s := range res.Pools[pool].Slices {
		for _, dev := range s.Devices {
			names[dev.Name] = true
		}
	}
	return names
}

// TestRetriedRollbackRepublishes: a prepare that made a MIG device is
// killed, and its rollback at the restart fails (the GPU is lost). Under a
// narrowed MIG policy the device stays published while its record names
// it; when the periodic retry finally destroys it, the slices are
// republished without it.
func TestRetriedRollbackRepublishes(t *testing.T) {
	const dev = "gpu-0-mig-1g-10gb-6"
	e := newEnv(t)
	e.crashAt = func(step string) {
		if step == "after-mig-create" {
			panic(step)
		}
	}
	s := e.start()
	func() {
		defer func() { require.Equal(t, "after-mig-create", recover()) }()
		_, _ = prep(s, claim("u1", []string{dev}))
	}()
	e.crashAt = nil
	gpu0 := inventory(t, e.machine).GPUs[0].UUID
	require.NoError(t, e.machine.LoseGPU(gpu0))
	d := &Driver{state: e.start(), backend: e.machine, pool: pool, repub: newRepublisher(),
		migPolicy: slicebuilder.MigPolicy{Profiles: []string{"3g.40gb"}}}
	d.retryInterrupted(context.Background())
	assert.False(t, queuedRepublish(d), "the GPU is lost: nothing rolled back, nothing republished")
	require.NoError(t, e.machine.RecoverGPU(gpu0))
	assert.True(t, publishedDevices(t, d)[dev], "named by the interrupted prepare's record: published")
	d.retryInterrupted(context.Background())
	assert.True(t, queuedRepublish(d), "the rollback destroyed the MIG device: republished")
	assert.False(t, publishedDevices(t, d)[dev], "withdrawn")
	assert.True(t, publishedDevices(t, d)["gpu-0-mig-3g-40gb-4"], "the policy's placement it overlapped is back")
}
