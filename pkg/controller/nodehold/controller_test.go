package nodehold

import (
	"context"
	"maps"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
	metadatafake "k8s.io/client-go/metadata/fake"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/client-go/tools/cache"
)

// cluster is the API the controller works against: claims in a fake
// clientset, nodes (metadata only) in a fake metadata client.
type cluster struct {
	client *fake.Clientset
	md     *metadatafake.FakeMetadataClient
}

func newCluster(t *testing.T, nodes map[string]map[string]string) *cluster {
	t.Helper()
	scheme := metadatafake.NewTestScheme()
	require.NoError(t, metav1.AddMetaToScheme(scheme))
	var objs []runtime.Object
	for name, annotations := range nodes {
		objs = append(objs, &metav1.PartialObjectMetadata{TypeMeta: metav1.TypeMeta{APIVersion: "v1", Kind: "Node"},
			ObjectMeta: metav1.ObjectMeta{Name: name, Annotations: annotations}})
	}
	return &cluster{client: fake.NewClientset(), md: metadatafake.NewSimpleMetadataClient(scheme, objs...)}
}

// start runs a controller (a leader) until the test ends or stop is
// called; reg receives its metrics.
func (c *cluster) start(t *testing.T, reg *prometheus.Registry, opts Options) (stop func()) {
	t.Helper()
	opts.Client, opts.Metadata, opts.Registerer = c.client, c.md, reg
	opts.Gap = 10 * time.Millisecond
	nh, err := New(opts)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- nh.Run(ctx) }()
	stopped := false
	stop = func() {
		if !stopped {
			stopped = true
			cancel()
			require.NoError(t, <-done)
		}
	}
	t.Cleanup(stop)
	return stop
}

func (c *cluster) annotations(t *testing.T, node string) map[string]string {
	t.Helper()
	n, err := c.md.Resource(Nodes).Get(context.Background(), node, metav1.GetOptions{})
	require.NoError(t, err)
	return n.Annotations
}

// eventually waits until node's annotations are want.
func (c *cluster) eventually(t *testing.T, node string, want map[string]string, msg string) {
	t.Helper()
	var got map[string]string
	require.Eventually(t, func() bool {
		got = c.annotations(t, node)
		return maps.Equal(got, want)
	}, 10*time.Second, 10*time.Millisecond, "%s: node %s has %v, want %v", msg, node, &got, want)
}

func (c *cluster) addClaim(t *testing.T, cl *resourceapi.ResourceClaim) {
	t.Helper()
	_, err := c.client.ResourceV1().ResourceClaims(cl.Namespace).Create(context.Background(), cl, metav1.CreateOptions{})
	require.NoError(t, err)
}

func (c *cluster) deleteClaim(t *testing.T, ns, name string) {
	t.Helper()
	require.NoError(t, c.client.ResourceV1().ResourceClaims(ns).Delete(context.Background(), name, metav1.DeleteOptions{}))
}

func marked(reason string) map[string]string {
	return map[string]string{KarpenterDoNotDisrupt: "true", ClusterAutoscalerScaleDownDisabled: "true", Marker: reason}
}

func writes(t *testing.T, reg *prometheus.Registry, op, result string) float64 {
	t.Helper()
	m, err := newMetrics(reg)
	require.NoError(t, err)
	return testutil.ToFloat64(m.writes.WithLabelValues(op, result))
}

func TestWriterMarksAndUnmarks(t *testing.T) {
	c := newCluster(t, map[string]map[string]string{"n1": {"team": "a"}, "n2": nil})
	reg := prometheus.NewRegistry()
	c.start(t, reg, Options{})

	c.addClaim(t, claim("a", "job", gpu("n1", "gpu-0")))
	c.eventually(t, "n1", map[string]string{"team": "a", KarpenterDoNotDisrupt: "true", ClusterAutoscalerScaleDownDisabled: "true",
		Marker: "1 gpu.gpudra.dev claim allocated: a/job"}, "a node with an allocated claim is marked")
	assert.Empty(t, c.annotations(t, "n2"), "a node holding nothing is left alone")
	require.Eventually(t, func() bool { return testutil.ToFloat64(mustMetrics(t, reg).held) == 1 }, 5*time.Second, 10*time.Millisecond)

	c.deleteClaim(t, "a", "job")
	c.eventually(t, "n1", map[string]string{"team": "a"}, "once the claim is gone, gpudra's marks go, the node's other annotations stay")
	require.Eventually(t, func() bool { return testutil.ToFloat64(mustMetrics(t, reg).held) == 0 }, 5*time.Second, 10*time.Millisecond)
	assert.Equal(t, 1.0, writes(t, reg, opMark, "success"))
	assert.Equal(t, 1.0, writes(t, reg, opUnmark, "success"))
}

func mustMetrics(t *testing.T, reg *prometheus.Registry) *metrics {
	t.Helper()
	m, err := newMetrics(reg)
	require.NoError(t, err)
	return m
}

func TestWriterLeavesAnAdministratorsAnnotation(t *testing.T) {
	admin := map[string]string{KarpenterDoNotDisrupt: "true"}
	c := newCluster(t, map[string]map[string]string{"kept": maps.Clone(admin), "busy": maps.Clone(admin)})
	reg := prometheus.NewRegistry()
	c.start(t, reg, Options{})

	// A node gpudra holds: its own marks beside the administrator's.
	c.addClaim(t, claim("a", "job", gpu("busy", "gpu-0")))
	c.eventually(t, "busy", map[string]string{KarpenterDoNotDisrupt: "true", ClusterAutoscalerScaleDownDisabled: "true",
		Marker: "1 gpu.gpudra.dev claim allocated: a/job", PreexistingMarker: KarpenterDoNotDisrupt}, "held")
	c.deleteClaim(t, "a", "job")
	c.eventually(t, "busy", admin, "released: the administrator's annotation stays")
	// Other rounds came and went meanwhile: a node gpudra never held
	// keeps the administrator's annotation.
	assert.Equal(t, admin, c.annotations(t, "kept"))
}

func TestNewLeaderUnmarksWhatTheOldOneSet(t *testing.T) {
	c := newCluster(t, map[string]map[string]string{"n1": nil})
	old := c.start(t, prometheus.NewRegistry(), Options{})
	c.addClaim(t, claim("a", "reservation-0", gpu("n1", "gpu-0")))
	c.eventually(t, "n1", marked("1 gpu.gpudra.dev claim allocated: a/reservation-0"), "the old leader marks")
	old()

	// Released while no leader runs; the new one remembers nothing but
	// what the node says.
	c.deleteClaim(t, "a", "reservation-0")
	c.start(t, prometheus.NewRegistry(), Options{})
	c.eventually(t, "n1", map[string]string{}, "the new leader unmarks")
}

func TestWriterRetriesAFailedPatch(t *testing.T) {
	c := newCluster(t, map[string]map[string]string{"n0": nil, "n1": nil})
	var fails atomic.Int32
	c.md.PrependReactor("patch", "nodes", func(a k8stesting.Action) (bool, runtime.Object, error) {
		if a.(k8stesting.PatchAction).GetName() == "n1" && fails.Add(-1) >= 0 {
			return true, nil, apierrors.NewInternalError(assert.AnError)
		}
		return false, nil, nil
	})
	reg := prometheus.NewRegistry()
	// A long period: the retry is the backoff's, not the next period's.
	c.start(t, reg, Options{Period: time.Hour})
	// Settled: the start's rounds are done.
	c.addClaim(t, claim("a", "first", gpu("n0", "gpu-0")))
	c.eventually(t, "n0", marked("1 gpu.gpudra.dev claim allocated: a/first"), "marked")
	time.Sleep(100 * time.Millisecond)

	// One event, one round, one failed write: nothing else comes to
	// run another round.
	fails.Store(1)
	c.addClaim(t, claim("a", "job", gpu("n1", "gpu-0")))
	c.eventually(t, "n1", marked("1 gpu.gpudra.dev claim allocated: a/job"), "marked after the failed patch is retried")
	assert.Equal(t, 1.0, writes(t, reg, opMark, "error"))
	assert.Equal(t, 2.0, writes(t, reg, opMark, "success"))
}

// TestRoundBacksOffAfterAFailedWrite: a round whose write failed asks for
// the next one within a second, and then doubling; a good round, at the
// period again.
func TestRoundBacksOffAfterAFailedWrite(t *testing.T) {
	c := newCluster(t, map[string]map[string]string{"n1": nil})
	c.md.PrependReactor("patch", "nodes", func(k8stesting.Action) (bool, runtime.Object, error) {
		return true, nil, apierrors.NewTooManyRequests("slow down", 1)
	})
	nh, err := New(Options{Client: c.client, Metadata: c.md, Period: time.Hour})
	require.NoError(t, err)
	nh.claims, nh.nodes = cache.NewStore(cache.MetaNamespaceKeyFunc), cache.NewStore(cache.MetaNamespaceKeyFunc)
	require.NoError(t, nh.claims.Add(claim("a", "job", gpu("n1", "gpu-0"))))
	require.NoError(t, nh.nodes.Add(&metav1.PartialObjectMetadata{ObjectMeta: metav1.ObjectMeta{Name: "n1"}}))
	ctx := context.Background()
	assert.Equal(t, time.Second, nh.Round(ctx))
	assert.Equal(t, 2*time.Second, nh.Round(ctx))
	assert.Equal(t, 2.0, testutil.ToFloat64(nh.metrics.writes.WithLabelValues(opMark, "error")))
	assert.Equal(t, 0.0, testutil.ToFloat64(nh.metrics.held), "not marked yet")
	c.md.ReactionChain = c.md.ReactionChain[1:]
	assert.Equal(t, time.Hour, nh.Round(ctx))
	assert.Equal(t, marked("1 gpu.gpudra.dev claim allocated: a/job"), c.annotations(t, "n1"))
	assert.Equal(t, 1.0, testutil.ToFloat64(nh.metrics.held))
}

func TestWriterMarksAGangBeingAdmitted(t *testing.T) {
	c := newCluster(t, map[string]map[string]string{"n3": nil})
	var planned atomic.Pointer[[]*resourceapi.ResourceClaim]
	planned.Store(&[]*resourceapi.ResourceClaim{claim("g", "w-0", gpu("n3", "gpu-0"))})
	c.start(t, prometheus.NewRegistry(), Options{Planned: func() []*resourceapi.ResourceClaim { return *planned.Load() }})
	c.eventually(t, "n3", marked("1 claim planned for a gang being admitted: g/w-0"), "a planned node is held")
}

func TestReasonRewritesAreSpaced(t *testing.T) {
	c := newCluster(t, map[string]map[string]string{"n1": nil})
	reg := prometheus.NewRegistry()
	c.start(t, reg, Options{ReasonRefresh: time.Hour})
	c.addClaim(t, claim("a", "x", gpu("n1", "gpu-0")))
	c.eventually(t, "n1", marked("1 gpu.gpudra.dev claim allocated: a/x"), "marked")
	c.addClaim(t, claim("a", "y", gpu("n1", "gpu-1")))
	c.addClaim(t, claim("b", "z", gpu("n2", "gpu-0")))
	// n2 does not exist: nothing to write. The round that saw a/y ran,
	// and wrote nothing for n1 within ReasonRefresh.
	time.Sleep(200 * time.Millisecond)
	assert.Equal(t, marked("1 gpu.gpudra.dev claim allocated: a/x"), c.annotations(t, "n1"))
	assert.Equal(t, 0.0, writes(t, reg, opUpdate, "success"))
	// Unmarking is never held back.
	c.deleteClaim(t, "a", "x")
	c.deleteClaim(t, "a", "y")
	c.eventually(t, "n1", map[string]string{}, "unmarked at once")
}

func TestRelease(t *testing.T) {
	c := newCluster(t, map[string]map[string]string{
		"ours":  marked("1 gpu.gpudra.dev claim allocated: a/x"),
		"admin": {KarpenterDoNotDisrupt: "true"},
		"mixed": {KarpenterDoNotDisrupt: "true", ClusterAutoscalerScaleDownDisabled: "true", Marker: "r", PreexistingMarker: KarpenterDoNotDisrupt},
	})
	n, err := Release(context.Background(), c.md)
	require.NoError(t, err)
	assert.Equal(t, 2, n)
	assert.Empty(t, c.annotations(t, "ours"))
	assert.Equal(t, map[string]string{KarpenterDoNotDisrupt: "true"}, c.annotations(t, "admin"))
	assert.Equal(t, map[string]string{KarpenterDoNotDisrupt: "true"}, c.annotations(t, "mixed"))
}
