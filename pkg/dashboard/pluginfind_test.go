package dashboard

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
)

// TestPluginPodsFoundInAnyNamespace: without a namespace the plugin pods
// are found by the chart's labels wherever the chart was installed (make
// demo: gpudra-system), and read; where that list is forbidden, or finds
// none, the note says to pass --plugin-namespace.
func TestPluginPodsFoundInAnyNamespace(t *testing.T) {
	pod := pluginPod("plugin-a", "node-a", 9477)
	pod.Namespace = "gpudra-system"
	metrics := pluginMetrics(t, "node-a")
	server := func(t *testing.T, listAll func(w http.ResponseWriter)) kubernetes.Interface {
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			switch {
			case r.URL.Path == "/api/v1/pods":
				assert.Equal(t, DefaultPluginSelector, r.URL.Query().Get("labelSelector"))
				listAll(w)
			case strings.HasPrefix(r.URL.Path, "/api/v1/namespaces/gpudra-system/pods/") && strings.HasSuffix(r.URL.Path, "/proxy/metrics"):
				_, _ = w.Write(metrics)
			case strings.HasPrefix(r.URL.Path, "/api/v1/namespaces/"):
				w.Header().Set("Content-Type", "application/json")
				_ = json.NewEncoder(w).Encode(corev1.PodList{TypeMeta: metav1.TypeMeta{Kind: "PodList", APIVersion: "v1"}})
			default:
				http.NotFound(w, r)
			}
		}))
		t.Cleanup(srv.Close)
		c, err := kubernetes.NewForConfig(&rest.Config{Host: srv.URL})
		require.NoError(t, err)
		return c
	}
	list := func(pods ...corev1.Pod) func(w http.ResponseWriter) {
		return func(w http.ResponseWriter) {
			w.Header().Set("Content-Type", "application/json")
			_ = json.NewEncoder(w).Encode(corev1.PodList{TypeMeta: metav1.TypeMeta{Kind: "PodList", APIVersion: "v1"}, Items: pods})
		}
	}
	ctx := context.Background()

	t.Run("found in gpudra-system", func(t *testing.T) {
		got, notes := (&PluginProxyUsage{Client: server(t, list(pod))}).Read(ctx, nil)
		assert.Empty(t, notes)
		require.Contains(t, got, "node-a")
		assert.NotEmpty(t, got["node-a"].Devices)
	})
	t.Run("the wrong namespace given says none is there", func(t *testing.T) {
		got, notes := (&PluginProxyUsage{Client: server(t, list(pod)), Namespace: "gpudra"}).Read(ctx, nil)
		assert.Empty(t, got)
		require.Len(t, notes, 1)
		assert.Contains(t, notes[0], "no gpudra kubelet plugin pods (app.kubernetes.io/component=kubelet-plugin) in namespace gpudra")
	})
	t.Run("none anywhere", func(t *testing.T) {
		_, notes := (&PluginProxyUsage{Client: server(t, list())}).Read(ctx, nil)
		require.Len(t, notes, 1)
		assert.Contains(t, notes[0], "in any namespace: is the chart installed? Else pass --plugin-namespace")
	})
	t.Run("listing every namespace forbidden", func(t *testing.T) {
		_, notes := (&PluginProxyUsage{Client: server(t, writeForbidden)}).Read(ctx, nil)
		require.Len(t, notes, 1)
		assert.Contains(t, notes[0], "listing pods there is forbidden: pass --plugin-namespace")
	})
}
