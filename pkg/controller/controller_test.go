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
	coordinationv1 "k8s.io/api/coordination/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/klog/v2/ktesting"
	"k8s.io/utils/ptr"

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

// TestNonLeaderReadySoon: a replica that does not lead is ready (its
// /readyz answers 200) within seconds of the leader writing the webhook's
// Secret, not at its next certificate reload (30 s by default).
func TestNonLeaderReadySoon(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	ctx, cancel := context.WithCancel(ctx)
	client := fake.NewClientset()
	// Another replica holds the lease, for the whole test.
	now := metav1.NewMicroTime(time.Now())
	_, err := client.CoordinationV1().Leases("gpudra-system").Create(ctx, &coordinationv1.Lease{
		ObjectMeta: metav1.ObjectMeta{Name: "gpudra-controller", Namespace: "gpudra-system"},
		Spec: coordinationv1.LeaseSpec{HolderIdentity: ptr.To("leader"), LeaseDurationSeconds: ptr.To[int32](3600),
			AcquireTime: &now, RenewTime: &now}}, metav1.CreateOptions{})
	require.NoError(t, err)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	health, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	healthAddress := health.Addr().String()
	require.NoError(t, health.Close())
	done := make(chan error, 1)
	go func() {
		done <- Run(ctx, Config{Client: client, Namespace: "gpudra-system", Identity: "replica", WebhookListener: l,
			WebhookSecret: "cert", ManageCertificates: true, WebhookIPs: []net.IP{net.ParseIP("127.0.0.1")},
			HealthAddress: healthAddress})
	}()
	defer func() { cancel(); <-done }()
	readyz := func() int {
		resp, err := http.Get("http://" + healthAddress + "/readyz")
		if err != nil {
			return 0
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	require.Eventually(t, func() bool { return readyz() == http.StatusServiceUnavailable }, 5*time.Second, 50*time.Millisecond,
		"not ready: no certificate yet")
	time.Sleep(time.Second) // past the replica's first load

	// The leader writes the Secret.
	m := &webhook.CertManager{Client: client, Namespace: "gpudra-system", Secret: "cert", IPs: []net.IP{net.ParseIP("127.0.0.1")}}
	_, err = m.Sync(ctx)
	require.NoError(t, err)
	written := time.Now()
	require.Eventually(t, func() bool { return readyz() == http.StatusOK }, 3*time.Second, 50*time.Millisecond,
		"a replica that does not lead is ready within seconds of the Secret's writing")
	t.Logf("ready %s after the Secret was written", time.Since(written))
	lease, err := client.CoordinationV1().Leases("gpudra-system").Get(ctx, "gpudra-controller", metav1.GetOptions{})
	require.NoError(t, err)
	assert.Equal(t, "leader", *lease.Spec.HolderIdentity, "the replica did not lead")
}
