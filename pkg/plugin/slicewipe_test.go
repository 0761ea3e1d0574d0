package plugin

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes/fake"
	clienttesting "k8s.io/client-go/testing"
	"k8s.io/utils/ptr"

	"github.com/gpudra/gpudra/pkg/slicebuilder"
)

// TestSliceWipeIsRepublishedAtOnce: when the node's slices are deleted (a
// starting kubelet wipes them), the plugin publishes again without
// waiting for anything else to change. Another node's slices and another
// driver's are not its business.
func TestSliceWipeIsRepublishedAtOnce(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	client := fake.NewClientset()
	slice := func(name, node, driver string) *resourceapi.ResourceSlice {
		return &resourceapi.ResourceSlice{ObjectMeta: metav1.ObjectMeta{Name: name},
			Spec: resourceapi.ResourceSliceSpec{Driver: driver, NodeName: ptr.To(node), Pool: resourceapi.ResourcePool{Name: node, ResourceSliceCount: 1}}}
	}
	for _, s := range []*resourceapi.ResourceSlice{slice("mine", pool, slicebuilder.DriverName), slice("other-node", "other", slicebuilder.DriverName),
		slice("other-driver", pool, "gpu.nvidia.com")} {
		_, err := client.ResourceV1().ResourceSlices().Create(ctx, s, metav1.CreateOptions{})
		require.NoError(t, err)
	}
	// The fake sends events only to watches that exist: wait for the
	// informer's.
	watching := make(chan struct{})
	var once sync.Once
	client.PrependWatchReactor("resourceslices", func(clienttesting.Action) (bool, watch.Interface, error) {
		once.Do(func() { close(watching) })
		return false, nil, nil
	})
	var publishes atomic.Int32
	d := &Driver{pool: pool, metrics: NewMetrics(), publish: func(context.Context) error { publishes.Add(1); return nil }}
	d.startRepublishing(ctx)
	t.Cleanup(d.stopRepublishing)
	synced, err := d.republishOnWipe(ctx, client, pool)
	require.NoError(t, err)
	// The fake applies no field selector: the handler must still tell
	// the node's own slices apart.
	require.Eventually(t, synced, 5*time.Second, 10*time.Millisecond)
	<-watching
	// Listed with the node's slice there: no publish for the start.
	time.Sleep(100 * time.Millisecond)
	require.Zero(t, publishes.Load())

	for _, other := range []string{"other-node", "other-driver"} {
		require.NoError(t, client.ResourceV1().ResourceSlices().Delete(ctx, other, metav1.DeleteOptions{}))
	}
	time.Sleep(200 * time.Millisecond)
	assert.Zero(t, publishes.Load(), "another node's or driver's slice deleted: nothing to publish")
	require.NoError(t, client.ResourceV1().ResourceSlices().Delete(ctx, "mine", metav1.DeleteOptions{}))
	require.Eventually(t, func() bool { return publishes.Load() >= 1 }, 5*time.Second, 10*time.Millisecond,
		"the node's slice deleted: published again")
	assert.Equal(t, float64(1), testutil.ToFloat64(d.metrics.slicesDeleted), "one own slice counted deleted")
}

// TestSliceWipeBeforeTheWatchIsRepublished: slices deleted before the
// watch started (no event comes for them) are published again once it has
// listed none of the node's, and again until one is listed: a publish may
// come before the helper's controller has seen the wipe, and change
// nothing (here the first two publish nothing, the third the slice).
func TestSliceWipeBeforeTheWatchIsRepublished(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	client := fake.NewClientset()
	var publishes atomic.Int32
	d := &Driver{pool: pool, metrics: NewMetrics(), publish: func(ctx context.Context) error {
		if publishes.Add(1) == 3 {
			_, err := client.ResourceV1().ResourceSlices().Create(ctx, &resourceapi.ResourceSlice{ObjectMeta: metav1.ObjectMeta{Name: "mine"},
				Spec: resourceapi.ResourceSliceSpec{Driver: slicebuilder.DriverName, NodeName: ptr.To(pool), Pool: resourceapi.ResourcePool{Name: pool, ResourceSliceCount: 1}}},
				metav1.CreateOptions{})
			return err
		}
		return nil
	}}
	d.startRepublishing(ctx)
	t.Cleanup(d.stopRepublishing)
	_, err := d.republishOnWipe(ctx, client, pool)
	require.NoError(t, err)
	require.Eventually(t, func() bool { return publishes.Load() >= 3 }, 10*time.Second, 10*time.Millisecond,
		"no slice of the node listed: published until one is")
	time.Sleep(3 * time.Second)
	assert.Equal(t, int32(3), publishes.Load(), "the slice listed: no more publishes")
}
