package webhook

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"net"
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	admissionv1 "k8s.io/api/admission/v1"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/klog/v2/ktesting"
	"k8s.io/utils/ptr"
)

// clock is a settable time for renewals.
type clock struct{ t time.Time }

func (c *clock) now() time.Time { return c.t }

func readSecret(t *testing.T, m *CertManager) (ca, cert *x509.Certificate, s *corev1.Secret) {
	t.Helper()
	s, err := m.Client.CoreV1().Secrets(m.Namespace).Get(context.Background(), m.Secret, metav1.GetOptions{})
	require.NoError(t, err)
	ca, _, err = parsePair(s.Data[KeyCACert], s.Data[KeyCAKey])
	require.NoError(t, err)
	cert, _, err = parsePair(s.Data[corev1.TLSCertKey], s.Data[corev1.TLSPrivateKeyKey])
	require.NoError(t, err)
	return ca, cert, s
}

func caBundles(t *testing.T, m *CertManager) [][]byte {
	cfg, err := m.Client.AdmissionregistrationV1().ValidatingWebhookConfigurations().Get(context.Background(), m.WebhookConfiguration, metav1.GetOptions{})
	require.NoError(t, err)
	var out [][]byte
	for _, w := range cfg.Webhooks {
		out = append(out, w.ClientConfig.CABundle)
	}
	return out
}

func mutatingCABundles(t *testing.T, m *CertManager) [][]byte {
	cfg, err := m.Client.AdmissionregistrationV1().MutatingWebhookConfigurations().Get(context.Background(), m.MutatingWebhookConfiguration, metav1.GetOptions{})
	require.NoError(t, err)
	var out [][]byte
	for _, w := range cfg.Webhooks {
		out = append(out, w.ClientConfig.CABundle)
	}
	return out
}

func TestCertManager(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	client := fake.NewClientset(Configuration("gpudra-webhook", admissionregistrationv1.WebhookClientConfig{URL: ptr.To("https://127.0.0.1:1/validate")}, true))
	clk := &clock{t: time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)}
	m := &CertManager{Client: client, Namespace: "gpudra-system", Secret: "gpudra-webhook-cert", WebhookConfiguration: "gpudra-webhook",
		DNSNames: []string{"gpudra-webhook.gpudra-system.svc"}, IPs: []net.IP{net.ParseIP("127.0.0.1")},
		CAValidity: 300 * 24 * time.Hour, CertValidity: 30 * 24 * time.Hour, Now: clk.now}

	// A new cluster: CA and certificate issued, caBundle set everywhere.
	next, err := m.Sync(ctx)
	require.NoError(t, err)
	ca, cert, s := readSecret(t, m)
	assert.Equal(t, corev1.SecretTypeTLS, s.Type)
	assert.True(t, ca.IsCA)
	require.NoError(t, cert.CheckSignatureFrom(ca))
	assert.Equal(t, m.DNSNames, cert.DNSNames)
	assert.True(t, cert.IPAddresses[0].Equal(net.ParseIP("127.0.0.1")))
	assert.Equal(t, clk.t.Add(20*24*time.Hour-20*time.Second), next, "renewal due with a third of the certificate's life left")
	bundles := caBundles(t, m)
	require.Len(t, bundles, 6)
	for _, b := range bundles {
		assert.Equal(t, s.Data[KeyCACert], b)
	}

	// Nothing due: nothing changes.
	clk.t = clk.t.Add(19 * 24 * time.Hour)
	_, err = m.Sync(ctx)
	require.NoError(t, err)
	_, again, _ := readSecret(t, m)
	assert.True(t, cert.Equal(again))

	// Past two thirds of its life the certificate is renewed, by the same CA.
	clk.t = clk.t.Add(2 * 24 * time.Hour)
	_, err = m.Sync(ctx)
	require.NoError(t, err)
	ca2, renewed, _ := readSecret(t, m)
	assert.False(t, cert.Equal(renewed))
	assert.True(t, ca.Equal(ca2))
	assert.True(t, renewed.NotAfter.After(cert.NotAfter))

	// Someone changed the caBundle: put back.
	cfg, err := client.AdmissionregistrationV1().ValidatingWebhookConfigurations().Get(ctx, "gpudra-webhook", metav1.GetOptions{})
	require.NoError(t, err)
	cfg.Webhooks[1].ClientConfig.CABundle = []byte("junk")
	_, err = client.AdmissionregistrationV1().ValidatingWebhookConfigurations().Update(ctx, cfg, metav1.UpdateOptions{})
	require.NoError(t, err)
	_, err = m.Sync(ctx)
	require.NoError(t, err)
	assert.Equal(t, s.Data[KeyCACert], caBundles(t, m)[1])

	// Near the CA's end: a new CA and certificate; the bundle holds both CAs
	// while the old one is valid, so clients with the old bundle keep working.
	clk.t = ca.NotBefore.Add(201 * 24 * time.Hour)
	_, err = m.Sync(ctx)
	require.NoError(t, err)
	ca3, cert3, s3 := readSecret(t, m)
	assert.False(t, ca.Equal(ca3))
	require.NoError(t, cert3.CheckSignatureFrom(ca3))
	pool := x509.NewCertPool()
	require.True(t, pool.AppendCertsFromPEM(s3.Data[KeyCACert]))
	_, err = renewed.Verify(x509.VerifyOptions{Roots: pool, CurrentTime: renewed.NotBefore.Add(time.Hour), DNSName: m.DNSNames[0]})
	assert.NoError(t, err, "the old CA is still in the bundle")
	assert.Equal(t, s3.Data[KeyCACert], caBundles(t, m)[0])

	// A name added: the certificate is issued again.
	m.DNSNames = append(m.DNSNames, "other.example")
	_, err = m.Sync(ctx)
	require.NoError(t, err)
	_, cert4, _ := readSecret(t, m)
	assert.Equal(t, m.DNSNames, cert4.DNSNames)
}

// TestServe: a replica serves reviews over TLS with the certificate from
// the Secret, and picks up a renewed one without a restart.
func TestServe(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	client := fake.NewClientset()
	m := &CertManager{Client: client, Namespace: "ns", Secret: "cert", IPs: []net.IP{net.ParseIP("127.0.0.1")}}
	_, err := m.Sync(ctx)
	require.NoError(t, err)
	loader := &CertLoader{Client: client, Namespace: "ns", Secret: "cert"}
	assert.Error(t, loader.Ready(), "nothing loaded yet")
	require.NoError(t, loader.Load(ctx))
	require.NoError(t, loader.Ready())
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	h := NewHandler(nil)
	h.GangPath = func() string { return GangPathGates }
	go func() { _ = Serve(ctx, l, loader, h) }()

	post := func() (*x509.Certificate, *admissionv1.AdmissionResponse) {
		_, cert, s := readSecret(t, m)
		pool := x509.NewCertPool()
		require.True(t, pool.AppendCertsFromPEM(s.Data[KeyCACert]))
		hc := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}}}
		raw, err := json.Marshal(claim(opaque(DriverName, badStrat)))
		require.NoError(t, err)
		review := admissionv1.AdmissionReview{TypeMeta: metav1.TypeMeta{APIVersion: "admission.k8s.io/v1", Kind: "AdmissionReview"},
			Request: &admissionv1.AdmissionRequest{UID: "u", Operation: admissionv1.Create, Resource: metav1.GroupVersionResource(ResourceClaims)}}
		review.Request.Object.Raw = raw
		body, err := json.Marshal(review)
		require.NoError(t, err)
		resp, err := hc.Post("https://"+l.Addr().String()+Path, "application/json", bytes.NewReader(body))
		require.NoError(t, err)
		defer resp.Body.Close()
		var out admissionv1.AdmissionReview
		require.NoError(t, json.NewDecoder(resp.Body).Decode(&out))
		return cert, out.Response
	}
	_, resp := post()
	assert.False(t, resp.Allowed)
	assert.Contains(t, resp.Result.Message, "spec.devices.config[0].opaque.parameters")

	// The same server answers the mutating webhook at MutatePath.
	_, _, s := readSecret(t, m)
	pool := x509.NewCertPool()
	require.True(t, pool.AppendCertsFromPEM(s.Data[KeyCACert]))
	hc := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}}}
	body, err := json.Marshal(admissionv1.AdmissionReview{TypeMeta: metav1.TypeMeta{APIVersion: "admission.k8s.io/v1", Kind: "AdmissionReview"},
		Request: podRequest(admissionv1.Create, gangPod(nil, nil))})
	require.NoError(t, err)
	hr, err := hc.Post("https://"+l.Addr().String()+MutatePath, "application/json", bytes.NewReader(body))
	require.NoError(t, err)
	var mutated admissionv1.AdmissionReview
	require.NoError(t, json.NewDecoder(hr.Body).Decode(&mutated))
	_ = hr.Body.Close()
	require.True(t, mutated.Response.Allowed)
	assert.JSONEq(t, `[{"op":"add","path":"/spec/schedulingGates","value":[{"name":"gpudra.dev/gang"}]}]`, string(mutated.Response.Patch))

	// A renewed certificate is served after the next load.
	m.IPs = append(m.IPs, net.ParseIP("::1"))
	_, err = m.Sync(ctx)
	require.NoError(t, err)
	require.NoError(t, loader.Load(ctx))
	cert, _ := post()
	served, err := loader.GetCertificate(nil)
	require.NoError(t, err)
	assert.True(t, served.Leaf.Equal(cert))
	assert.Len(t, served.Leaf.IPAddresses, 2)
}

// TestCertManagerMutating: the caBundle of the gang pods' mutating
// configuration is kept like the validating one's; a missing one (the
// chart with gangs.enabled=false) is no error and is found once created.
func TestCertManagerMutating(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	client := fake.NewClientset(Configuration("gpudra-webhook", admissionregistrationv1.WebhookClientConfig{URL: ptr.To("https://127.0.0.1:1/validate")}, false))
	m := &CertManager{Client: client, Namespace: "gpudra-system", Secret: "gpudra-webhook-cert",
		WebhookConfiguration: "gpudra-webhook", MutatingWebhookConfiguration: "gpudra-webhook", IPs: []net.IP{net.ParseIP("127.0.0.1")}}

	_, err := m.Sync(ctx)
	require.NoError(t, err, "no MutatingWebhookConfiguration yet")
	_, _, s := readSecret(t, m)
	for _, b := range caBundles(t, m) {
		assert.Equal(t, s.Data[KeyCACert], b)
	}

	mutating := MutatingConfiguration("gpudra-webhook", admissionregistrationv1.WebhookClientConfig{URL: ptr.To("https://127.0.0.1:1" + MutatePath)})
	_, err = client.AdmissionregistrationV1().MutatingWebhookConfigurations().Create(ctx, mutating, metav1.CreateOptions{})
	require.NoError(t, err)
	_, err = m.Sync(ctx)
	require.NoError(t, err)
	assert.Equal(t, [][]byte{s.Data[KeyCACert]}, mutatingCABundles(t, m), "set once the configuration exists")

	// Someone changed it: put back, with the same CA.
	mutating, err = client.AdmissionregistrationV1().MutatingWebhookConfigurations().Get(ctx, "gpudra-webhook", metav1.GetOptions{})
	require.NoError(t, err)
	mutating.Webhooks[0].ClientConfig.CABundle = []byte("junk")
	_, err = client.AdmissionregistrationV1().MutatingWebhookConfigurations().Update(ctx, mutating, metav1.UpdateOptions{})
	require.NoError(t, err)
	_, err = m.Sync(ctx)
	require.NoError(t, err)
	_, _, again := readSecret(t, m)
	assert.Equal(t, s.Data[KeyCACert], again.Data[KeyCACert])
	assert.Equal(t, [][]byte{s.Data[KeyCACert]}, mutatingCABundles(t, m))
}

// TestCARenewalOrder: at a CA renewal, the new CA is in every webhook's
// caBundle before the Secret (which every replica serves from) holds a
// certificate signed by it: no moment where a replica serves a certificate
// the API server cannot verify. Each write is checked as it happens.
func TestCARenewalOrder(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	client := fake.NewClientset(Configuration("gpudra-webhook", admissionregistrationv1.WebhookClientConfig{URL: ptr.To("https://127.0.0.1:1/validate")}, true))
	clk := &clock{t: time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)}
	m := &CertManager{Client: client, Namespace: "gpudra-system", Secret: "gpudra-webhook-cert", WebhookConfiguration: "gpudra-webhook",
		DNSNames: []string{"gpudra-webhook.gpudra-system.svc"}, CAValidity: 300 * 24 * time.Hour, CertValidity: 30 * 24 * time.Hour, Now: clk.now}
	_, err := m.Sync(ctx)
	require.NoError(t, err)
	oldCA, _, _ := readSecret(t, m)

	var bundle []byte // what the API server trusts, as written
	var checked int
	client.PrependReactor("update", "validatingwebhookconfigurations", func(a k8stesting.Action) (bool, runtime.Object, error) {
		cfg := a.(k8stesting.UpdateAction).GetObject().(*admissionregistrationv1.ValidatingWebhookConfiguration)
		bundle = cfg.Webhooks[0].ClientConfig.CABundle
		return false, nil, nil
	})
	client.PrependReactor("update", "secrets", func(a k8stesting.Action) (bool, runtime.Object, error) {
		s := a.(k8stesting.UpdateAction).GetObject().(*corev1.Secret)
		cert, _, err := parsePair(s.Data[corev1.TLSCertKey], s.Data[corev1.TLSPrivateKeyKey])
		require.NoError(t, err)
		pool := x509.NewCertPool()
		require.True(t, pool.AppendCertsFromPEM(bundle))
		_, err = cert.Verify(x509.VerifyOptions{Roots: pool, CurrentTime: cert.NotBefore.Add(time.Minute), DNSName: m.DNSNames[0]})
		assert.NoError(t, err, "the Secret is about to serve a certificate the caBundle does not verify")
		checked++
		return false, nil, nil
	})
	bundle = caBundles(t, m)[0]
	clk.t = oldCA.NotBefore.Add(201 * 24 * time.Hour)
	_, err = m.Sync(ctx)
	require.NoError(t, err)
	newCA, cert, _ := readSecret(t, m)
	require.False(t, oldCA.Equal(newCA), "the CA was renewed")
	require.NoError(t, cert.CheckSignatureFrom(newCA), "and the certificate issued from it")
	assert.Equal(t, 2, checked, "two Secret writes: the new CA beside the old, then the certificate")
}
