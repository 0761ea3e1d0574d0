package plugin

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	drapb "k8s.io/kubelet/pkg/apis/dra/v1"
)

func get(t *testing.T, h http.Handler, path string) (int, string) {
	t.Helper()
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, path, nil))
	body, _ := io.ReadAll(rec.Body)
	return rec.Code, string(body)
}

func TestMetricsAndLiveness(t *testing.T) {
	e := newEnv(t)
	ok, bad := claim("ok", []string{"gpu-1"}), claim("bad", []string{"gpu-1"})
	m := NewMetrics()
	kubelet, _, p := startPluginWithMetrics(t, e, m, ok, bad)
	h := m.Handler(p.Sockets...)

	code, body := get(t, h, "/healthz")
	assert.Equal(t, http.StatusOK, code, body)

	_, err := kubelet.dra.NodePrepareResources(context.Background(), &drapb.NodePrepareResourcesRequest{Claims: []*drapb.Claim{
		{Namespace: ok.Namespace, Name: ok.Name, Uid: "ok"}, {Namespace: bad.Namespace, Name: bad.Name, Uid: "bad"}}})
	require.NoError(t, err)
	_, body = get(t, h, "/metrics")
	assert.Contains(t, body, `gpudra_plugin_claim_operations_total{operation="prepare",result="success"} 1`)
	assert.Contains(t, body, `gpudra_plugin_claim_operations_total{operation="prepare",result="error"} 1`)
	assert.Contains(t, body, `gpudra_plugin_claim_operation_duration_seconds_count{operation="prepare"} 2`)
	assert.Contains(t, body, "gpudra_plugin_devices_published 58")

	p.Stop()
	code, body = get(t, h, "/healthz")
	assert.Equal(t, http.StatusServiceUnavailable, code, "a plugin whose sockets are gone is not alive")
	assert.Contains(t, body, "dra.sock")
}
