package controller

import (
	"context"
	"net"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/klog/v2/ktesting"

	"github.com/gpudra/gpudra/pkg/webhook"
)

func TestConfigValidate(t *testing.T) {
	for name, tc := range map[string]struct {
		cfg  Config
		want string
	}{
		"empty":              {cfg: Config{}, want: "no API client configuration\nno namespace\nno identity"},
		"webhook, no secret": {cfg: Config{Client: fake.NewClientset(), Namespace: "n", Identity: "a", WebhookAddress: ":9443"}, want: "the webhook needs its certificate Secret"},
		"fine":               {cfg: Config{Client: fake.NewClientset(), Namespace: "n", Identity: "a"}},
	} {
		t.Run(name, func(t *testing.T) {
			err := tc.cfg.validate()
			if tc.want == "" {
				assert.NoError(t, err)
				return
			}
			assert.EqualError(t, err, tc.want)
		})
	}
}

func TestHealth(t *testing.T) {
	h := &health{ready: func() error { return assert.AnError }}
	srv := httptest.NewServer(h.mux(http.NotFoundHandler()))
	defer srv.Close()
	for path, want := range map[string]int{"/healthz": 200, "/readyz": 503, "/metrics": 404} {
		resp, err := http.Get(srv.URL + path)
		require.NoError(t, err)
		resp.Body.Close()
		assert.Equal(t, want, resp.StatusCode, path)
	}
}

// TestLeaderFailover: of two replicas one leads and issues the webhook's
// certificate; when it stops, the other leads, finds the certificate valid
// and issues none.
func TestLeaderFailover(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	client := fake.NewClientset()
	start := func(id string) (context.CancelFunc, <-chan error) {
		ctx, cancel := context.WithCancel(ctx)
		l, err := net.Listen("tcp", "127.0.0.1:0")
		require.NoError(t, err)
		done := make(chan error, 1)
		go func() {
			done <- Run(ctx, Config{Client: client, Namespace: "gpudra-system", Identity: id, WebhookListener: l,
				WebhookSecret: "cert", ManageCertificates: true, WebhookIPs: []net.IP{net.ParseIP("127.0.0.1")},
				LeaseDuration: 2 * time.Second, RenewDeadline: 1500 * time.Millisecond, RetryPeriod: 100 * time.Millisecond,
				CertReloadPeriod: 100 * time.Millisecond})
		}()
		return cancel, done
	}
	holder := func() string {
		l, err := client.CoordinationV1().Leases("gpudra-system").Get(ctx, "gpudra-controller", metav1.GetOptions{})
		if err != nil || l.Spec.HolderIdentity == nil {
			return ""
		}
		return *l.Spec.HolderIdentity
	}
	stopA, doneA := start("a")
	require.Eventually(t, func() bool { return holder() == "a" }, 10*time.Second, 50*time.Millisecond)
	stopB, doneB := start("b")
	defer func() { stopB(); <-doneB }()
	var secret []byte
	require.Eventually(t, func() bool {
		s, err := client.CoreV1().Secrets("gpudra-system").Get(ctx, "cert", metav1.GetOptions{})
		if err == nil {
			secret = s.Data["tls.crt"]
		}
		return err == nil
	}, 10*time.Second, 50*time.Millisecond)

	stopA()
	require.NoError(t, <-doneA)
	stopped := time.Now()
	require.Eventually(t, func() bool { return holder() == "b" }, 2*time.Second, 50*time.Millisecond, "b takes over within the lease")
	t.Logf("took over in %s", time.Since(stopped))
	time.Sleep(500 * time.Millisecond) // b's certificate manager ran
	s, err := client.CoreV1().Secrets("gpudra-system").Get(ctx, "cert", metav1.GetOptions{})
	require.NoError(t, err)
	assert.Equal(t, secret, s.Data["tls.crt"], "the new leader keeps the valid certificate")
	events, err := client.EventsV1().Events("gpudra-system").List(ctx, metav1.ListOptions{})
	require.NoError(t, err)
	issued := 0
	for _, e := range events.Items {
		if e.Reason == webhook.ReasonCertificateIssued {
			issued++
		}
	}
	assert.Equal(t, 1, issued, "issued once, by the first leader")
}
