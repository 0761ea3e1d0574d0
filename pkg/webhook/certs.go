package webhook

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net"
	"slices"
	"time"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/events"
	"k8s.io/klog/v2"
)

// Keys of the certificate Secret: those of a kubernetes.io/tls Secret (what
// cert-manager writes too, so that the loader reads either) plus the CA's
// key, which only the certificate manager uses.
const (
	KeyCACert = "ca.crt"
	KeyCAKey  = "ca.key"
)

// Event reasons of the certificate manager, regarding the Secret.
const (
	ReasonCAIssued          = "WebhookCAIssued"
	ReasonCertificateIssued = "WebhookCertificateIssued"
)

// CertManager keeps the webhook's serving certificate: its own CA and a
// serving certificate for the webhook's names in one Secret, both renewed
// when a third of their validity is left, and the caBundle of the
// Validating (and Mutating) WebhookConfiguration kept to the CA. It runs on
// the leader only, so that two replicas never issue two certificates.
type CertManager struct {
	Client            kubernetes.Interface
	Namespace, Secret string
	// WebhookConfiguration is the ValidatingWebhookConfiguration whose
	// caBundle is kept current; MutatingWebhookConfiguration (optional) is
	// the MutatingWebhookConfiguration of gang pods, kept the same way. The
	// chart and devcluster give both the same name.
	WebhookConfiguration         string
	MutatingWebhookConfiguration string
	// DNSNames and IPs the serving certificate is for.
	DNSNames []string
	IPs      []net.IP
	// CAValidity and CertValidity: zero means 10 years and 1 year.
	CAValidity, CertValidity time.Duration
	// Recorder (nil: none) records issued certificates regarding the Secret.
	Recorder events.EventRecorder
	// Now is the clock; nil: time.Now.
	Now func() time.Time
}

func (m *CertManager) now() time.Time {
	if m.Now != nil {
		return m.Now()
	}
	return time.Now()
}

func (m *CertManager) validity() (ca, cert time.Duration) {
	ca, cert = m.CAValidity, m.CertValidity
	if ca == 0 {
		ca = 10 * 365 * 24 * time.Hour
	}
	if cert == 0 {
		cert = 365 * 24 * time.Hour
	}
	return ca, cert
}

// renewAt is when a certificate is renewed: with a third of its life left,
// so that a failing renewal has time to be noticed and retried.
func renewAt(c *x509.Certificate) time.Time {
	return c.NotAfter.Add(-c.NotAfter.Sub(c.NotBefore) / 3)
}

// Sync makes the Secret and the caBundle current and says when the next
// renewal is due.
func (m *CertManager) Sync(ctx context.Context) (time.Time, error) {
	now := m.now()
	secret, err := m.Client.CoreV1().Secrets(m.Namespace).Get(ctx, m.Secret, metav1.GetOptions{})
	create := apierrors.IsNotFound(err)
	if err != nil && !create {
		return time.Time{}, fmt.Errorf("read Secret %s/%s: %w", m.Namespace, m.Secret, err)
	}
	if create {
		secret = &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: m.Namespace, Name: m.Secret}, Type: corev1.SecretTypeTLS}
	}
	if secret.Data == nil {
		secret.Data = map[string][]byte{}
	}
	caValidity, certValidity := m.validity()
	ca, caKey, caErr := parsePair(secret.Data[KeyCACert], secret.Data[KeyCAKey])
	caIssued := false // and not stored yet
	if caErr != nil || !now.Before(renewAt(ca)) {
		// The previous CA stays in ca.crt while it is valid: clients that
		// still have the old bundle keep trusting the old certificate
		// until the new bundle reached them.
		old := ca
		if ca, caKey, err = issue(nil, nil, caValidity, now, nil, nil); err != nil {
			return time.Time{}, err
		}
		bundle := pemCert(ca)
		if caErr == nil && now.Before(old.NotAfter) {
			bundle = append(bundle, pemCert(old)...)
		}
		secret.Data[KeyCACert], secret.Data[KeyCAKey] = bundle, pemKey(caKey)
		caIssued = true
		// A Secret without a certificate is written once, with its
		// certificate: nothing was served from it (and a TLS Secret needs
		// both).
		if !create && len(secret.Data[corev1.TLSCertKey]) > 0 && len(secret.Data[corev1.TLSPrivateKeyKey]) > 0 {
			if secret, err = m.store(ctx, secret, false, ReasonCAIssued); err != nil {
				return time.Time{}, err
			}
			caIssued = false
		}
	}
	// A new CA reaches the caBundle before any certificate it signed is
	// served: the Secret (which every replica reloads) first gets the new
	// CA beside the old, the webhook configurations then get that bundle,
	// and only then is the serving certificate issued from the new CA. The
	// other order leaves a window in which replicas serve a certificate
	// the API server cannot verify.
	if err := m.syncCABundle(ctx, secret.Data[KeyCACert]); err != nil {
		return time.Time{}, err
	}
	cert, _, certErr := parsePair(secret.Data[corev1.TLSCertKey], secret.Data[corev1.TLSPrivateKeyKey])
	if certErr != nil || !now.Before(renewAt(cert)) || cert.CheckSignatureFrom(ca) != nil || !m.covers(cert) {
		cert, key, err := issue(ca, caKey, certValidity, now, m.DNSNames, m.IPs)
		if err != nil {
			return time.Time{}, err
		}
		secret.Data[corev1.TLSCertKey], secret.Data[corev1.TLSPrivateKeyKey] = pemCert(cert), pemKey(key)
		reasons := []string{ReasonCertificateIssued}
		if caIssued {
			reasons = []string{ReasonCAIssued, ReasonCertificateIssued}
		}
		if secret, err = m.store(ctx, secret, create, reasons...); err != nil {
			return time.Time{}, err
		}
	}
	cert, _, _ = parsePair(secret.Data[corev1.TLSCertKey], secret.Data[corev1.TLSPrivateKeyKey])
	next := renewAt(cert)
	if r := renewAt(ca); r.Before(next) {
		next = r
	}
	return next, nil
}

// covers says whether the certificate names exactly what it should.
// store creates or updates the Secret and reports what was issued.
func (m *CertManager) store(ctx context.Context, secret *corev1.Secret, create bool, reasons ...string) (*corev1.Secret, error) {
	var err error
	if create {
		secret, err = m.Client.CoreV1().Secrets(m.Namespace).Create(ctx, secret, metav1.CreateOptions{})
	} else {
		secret, err = m.Client.CoreV1().Secrets(m.Namespace).Update(ctx, secret, metav1.UpdateOptions{})
	}
	if err != nil {
		return nil, fmt.Errorf("store Secret %s/%s: %w", m.Namespace, m.Secret, err)
	}
	for _, r := range reasons {
		klog.FromContext(ctx).Info("Issued webhook certificate", "reason", r, "secret", klog.KObj(secret))
		if m.Recorder != nil {
			m.Recorder.Eventf(secret, nil, corev1.EventTypeNormal, r, "Issue", "issued for %v %v", m.DNSNames, m.IPs)
		}
	}
	return secret, nil
}

func (m *CertManager) covers(c *x509.Certificate) bool {
	if !slices.Equal(c.DNSNames, m.DNSNames) || len(c.IPAddresses) != len(m.IPs) {
		return false
	}
	for i := range m.IPs {
		if !c.IPAddresses[i].Equal(m.IPs[i]) {
			return false
		}
	}
	return true
}

// syncCABundle sets the caBundle of every webhook of the configurations.
// A missing configuration is no error: the chart may create it after us,
// and the next sync finds it.
func (m *CertManager) syncCABundle(ctx context.Context, bundle []byte) error {
	logger := klog.FromContext(ctx)
	api := m.Client.AdmissionregistrationV1()
	validating := func(c *admissionregistrationv1.ValidatingWebhookConfiguration) []*admissionregistrationv1.WebhookClientConfig {
		out := make([]*admissionregistrationv1.WebhookClientConfig, len(c.Webhooks))
		for i := range c.Webhooks {
			out[i] = &c.Webhooks[i].ClientConfig
		}
		return out
	}
	mutating := func(c *admissionregistrationv1.MutatingWebhookConfiguration) []*admissionregistrationv1.WebhookClientConfig {
		out := make([]*admissionregistrationv1.WebhookClientConfig, len(c.Webhooks))
		for i := range c.Webhooks {
			out[i] = &c.Webhooks[i].ClientConfig
		}
		return out
	}
	err := syncWebhookCABundle(ctx, m.WebhookConfiguration, bundle, api.ValidatingWebhookConfigurations().Get,
		api.ValidatingWebhookConfigurations().Update, validating, func() {
			logger.Info("ValidatingWebhookConfiguration not found: caBundle not set yet", "name", m.WebhookConfiguration)
		})
	if err != nil {
		return fmt.Errorf("ValidatingWebhookConfiguration %w", err)
	}
	err = syncWebhookCABundle(ctx, m.MutatingWebhookConfiguration, bundle, api.MutatingWebhookConfigurations().Get,
		api.MutatingWebhookConfigurations().Update, mutating, func() {
			// Quieter than the validating one: with gangs.enabled=false
			// the chart renders none, for good.
			logger.V(2).Info("MutatingWebhookConfiguration not found: caBundle not set", "name", m.MutatingWebhookConfiguration)
		})
	if err != nil {
		return fmt.Errorf("MutatingWebhookConfiguration %w", err)
	}
	return nil
}

// syncWebhookCABundle reads the webhook configuration name (none when
// empty), sets bundle in its webhooks' client configs and writes it back
// when any changed; missing is called when it does not exist.
func syncWebhookCABundle[T any](ctx context.Context, name string, bundle []byte,
	get func(context.Context, string, metav1.GetOptions) (*T, error),
	update func(context.Context, *T, metav1.UpdateOptions) (*T, error),
	clients func(*T) []*admissionregistrationv1.WebhookClientConfig, missing func()) error {
	if name == "" {
		return nil
	}
	cfg, err := get(ctx, name, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		missing()
		return nil
	case err != nil:
		return fmt.Errorf("%s: read: %w", name, err)
	}
	if !setCABundle(clients(cfg), bundle) {
		return nil
	}
	if _, err := update(ctx, cfg, metav1.UpdateOptions{}); err != nil {
		return fmt.Errorf("%s: update caBundle: %w", name, err)
	}
	return nil
}

// setCABundle sets bundle in every client config and says whether any
// changed.
func setCABundle(clients []*admissionregistrationv1.WebhookClientConfig, bundle []byte) bool {
	changed := false
	for _, c := range clients {
		if !bytes.Equal(c.CABundle, bundle) {
			c.CABundle = bundle
			changed = true
		}
	}
	return changed
}

// Run syncs until ctx ends: at each renewal, every resync (which also puts
// back a caBundle someone else changed), and after a failure with backoff.
func (m *CertManager) Run(ctx context.Context, resync time.Duration) error {
	logger := klog.FromContext(ctx)
	const minRetry, maxRetry = time.Second, time.Minute
	retry := minRetry
	for {
		wait := resync
		next, err := m.Sync(ctx)
		if err != nil {
			logger.Error(err, "Webhook certificate sync failed", "retryIn", retry)
			wait, retry = retry, min(2*retry, maxRetry)
		} else {
			retry = minRetry
			if d := next.Sub(m.now()); d < wait {
				wait = max(d, minRetry)
			}
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(wait):
		}
	}
}

// issue makes a key and a certificate: a self-signed CA when parent is nil,
// else a serving certificate signed by parent.
func issue(parent *x509.Certificate, parentKey *ecdsa.PrivateKey, validity time.Duration, now time.Time, dns []string, ips []net.IP) (*x509.Certificate, *ecdsa.PrivateKey, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, fmt.Errorf("generate key: %w", err)
	}
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		return nil, nil, fmt.Errorf("serial: %w", err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: serial,
		// A minute of slack for clocks a little behind ours.
		NotBefore: now.Add(-time.Minute), NotAfter: now.Add(validity),
		BasicConstraintsValid: true,
	}
	signer, signerKey := tmpl, key
	if parent == nil {
		tmpl.Subject = pkix.Name{CommonName: fmt.Sprintf("gpudra-webhook-ca@%d", now.Unix())}
		tmpl.IsCA = true
		tmpl.KeyUsage = x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature
	} else {
		signer, signerKey = parent, parentKey
		cn := "gpudra-webhook"
		if len(dns) > 0 {
			cn = dns[0]
		}
		tmpl.Subject = pkix.Name{CommonName: cn}
		tmpl.DNSNames, tmpl.IPAddresses = dns, ips
		tmpl.KeyUsage = x509.KeyUsageDigitalSignature
		tmpl.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, signer, &key.PublicKey, signerKey)
	if err != nil {
		return nil, nil, fmt.Errorf("create certificate: %w", err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, nil, fmt.Errorf("parse certificate: %w", err)
	}
	return cert, key, nil
}

// parsePair parses the first certificate of a PEM bundle and its key.
func parsePair(certPEM, keyPEM []byte) (*x509.Certificate, *ecdsa.PrivateKey, error) {
	cb, _ := pem.Decode(certPEM)
	if cb == nil {
		return nil, nil, errors.New("no certificate")
	}
	cert, err := x509.ParseCertificate(cb.Bytes)
	if err != nil {
		return nil, nil, fmt.Errorf("parse certificate: %w", err)
	}
	kb, _ := pem.Decode(keyPEM)
	if kb == nil {
		return nil, nil, errors.New("no key")
	}
	key, err := x509.ParseECPrivateKey(kb.Bytes)
	if err != nil {
		return nil, nil, fmt.Errorf("parse key: %w", err)
	}
	return cert, key, nil
}

func pemCert(c *x509.Certificate) []byte {
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: c.Raw})
}

func pemKey(k *ecdsa.PrivateKey) []byte {
	der, _ := x509.MarshalECPrivateKey(k) // cannot fail for a P-256 key
	return pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: der})
}
