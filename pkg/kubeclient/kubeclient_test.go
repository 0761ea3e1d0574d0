package kubeclient

import (
	"context"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	eventsv1 "k8s.io/api/events/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/rest"
)

func TestClientsetServesItsGroupsWithOneRateLimiter(t *testing.T) {
	var paths []string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		paths = append(paths, r.URL.Path)
		w.Header().Set("Content-Type", "application/json")
		switch r.URL.Path {
		case "/api/v1/nodes/n1":
			_, _ = w.Write([]byte(`{"kind":"Node","apiVersion":"v1","metadata":{"name":"n1"}}`))
		case "/apis/resource.k8s.io/v1/namespaces/ns/resourceclaims/c1":
			_, _ = w.Write([]byte(`{"kind":"ResourceClaim","apiVersion":"resource.k8s.io/v1","metadata":{"name":"c1","namespace":"ns"}}`))
		case "/apis/events.k8s.io/v1/namespaces/default/events":
			w.WriteHeader(http.StatusCreated)
			_, _ = w.Write([]byte(`{"kind":"Event","apiVersion":"events.k8s.io/v1","metadata":{"name":"n1.1","namespace":"default"},"reason":"GPUUnhealthy"}`))
		default:
			w.WriteHeader(http.StatusNotFound)
		}
	}))
	defer srv.Close()

	cs, err := NewForConfig(&rest.Config{Host: srv.URL, QPS: 100, Burst: 300})
	require.NoError(t, err)
	ctx := context.Background()
	node, err := cs.CoreV1().Nodes().Get(ctx, "n1", metav1.GetOptions{})
	require.NoError(t, err)
	assert.Equal(t, "n1", node.Name)
	claim, err := cs.ResourceV1().ResourceClaims("ns").Get(ctx, "c1", metav1.GetOptions{})
	require.NoError(t, err)
	assert.Equal(t, "c1", claim.Name)
	ev, err := cs.EventsV1().Events("default").Create(ctx, &eventsv1.Event{ObjectMeta: metav1.ObjectMeta{Name: "n1.1"}, Reason: "GPUUnhealthy"}, metav1.CreateOptions{})
	require.NoError(t, err)
	assert.Equal(t, "GPUUnhealthy", ev.Reason)
	assert.Equal(t, []string{"/api/v1/nodes/n1", "/apis/resource.k8s.io/v1/namespaces/ns/resourceclaims/c1", "/apis/events.k8s.io/v1/namespaces/default/events"}, paths)

	// One token bucket for every group: the plugin's QPS is the plugin's
	// in all, as with kubernetes.NewForConfig.
	limiter := cs.CoreV1().RESTClient().GetRateLimiter()
	require.NotNil(t, limiter)
	assert.Equal(t, float32(100), limiter.QPS())
	assert.Same(t, limiter, cs.ResourceV1().RESTClient().GetRateLimiter())
	assert.Same(t, limiter, cs.ResourceV1beta1().RESTClient().GetRateLimiter())
	assert.Same(t, limiter, cs.ResourceV1beta2().RESTClient().GetRateLimiter())
	assert.Same(t, limiter, cs.EventsV1().RESTClient().GetRateLimiter())

	_, err = NewForConfig(&rest.Config{Host: srv.URL, QPS: 5})
	assert.ErrorContains(t, err, "burst")
}
