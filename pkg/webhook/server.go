package webhook

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/klog/v2"
)

// CertLoader holds the serving certificate that every replica reads from
// the Secret (written by the leader's CertManager or by cert-manager). It
// re-reads the Secret periodically instead of watching it: a Get of one
// named Secret is all the RBAC it needs, and a renewal happens with a third
// of a certificate's life left, so a minute's delay costs nothing. Until it
// holds a valid certificate it reads it every NotReadyReloadPeriod, so that
// a replica is ready within a second of the Secret's writing.
type CertLoader struct {
	Client            kubernetes.Interface
	Namespace, Secret string

	cert atomic.Pointer[tls.Certificate]
}

// Load reads the Secret once.
func (l *CertLoader) Load(ctx context.Context) error {
	s, err := l.Client.CoreV1().Secrets(l.Namespace).Get(ctx, l.Secret, metav1.GetOptions{})
	if err != nil {
		return fmt.Errorf("read Secret %s/%s: %w", l.Namespace, l.Secret, err)
	}
	pair, err := tls.X509KeyPair(s.Data[corev1.TLSCertKey], s.Data[corev1.TLSPrivateKeyKey])
	if err != nil {
		return fmt.Errorf("Secret %s/%s: %w", l.Namespace, l.Secret, err)
	}
	if old := l.cert.Load(); old == nil || old.Leaf == nil || !old.Leaf.Equal(pair.Leaf) {
		klog.FromContext(ctx).Info("Loaded webhook serving certificate", "secret", klog.KObj(s), "notAfter", pair.Leaf.NotAfter)
	}
	l.cert.Store(&pair)
	return nil
}

// NotReadyReloadPeriod is how often Run reads the Secret while no valid
// certificate is loaded: a replica that does not lead waits for the
// leader (or cert-manager) to write it, and must become ready as soon as
// it can serve, not at its next period.
const NotReadyReloadPeriod = 500 * time.Millisecond

// Run loads the Secret every period until ctx ends, and every
// NotReadyReloadPeriod (when shorter) while no valid certificate is
// loaded. Failures are logged: the certificate in use stays until a newer
// one can be read.
func (l *CertLoader) Run(ctx context.Context, period time.Duration) {
	for {
		if err := l.Load(ctx); err != nil && ctx.Err() == nil {
			klog.FromContext(ctx).V(2).Info("Webhook certificate not loaded", "err", err)
		}
		next := period
		if l.Ready() != nil {
			next = min(period, NotReadyReloadPeriod)
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(next):
		}
	}
}

// GetCertificate is tls.Config's: always the latest certificate loaded.
func (l *CertLoader) GetCertificate(*tls.ClientHelloInfo) (*tls.Certificate, error) {
	c := l.cert.Load()
	if c == nil {
		return nil, errors.New("no serving certificate loaded yet")
	}
	return c, nil
}

// Ready says whether a certificate is loaded and valid now: what /readyz
// reports, so that no Service sends reviews to a replica that cannot serve.
func (l *CertLoader) Ready() error {
	c := l.cert.Load()
	if c == nil {
		return errors.New("no webhook serving certificate loaded")
	}
	if now := time.Now(); now.After(c.Leaf.NotAfter) || now.Before(c.Leaf.NotBefore) {
		return fmt.Errorf("webhook serving certificate not valid now (%s to %s)", c.Leaf.NotBefore, c.Leaf.NotAfter)
	}
	return nil
}

type logWriter struct{ logger klog.Logger }

func (w logWriter) Write(p []byte) (int, error) {
	w.logger.V(2).Info("Webhook server", "msg", strings.TrimSpace(string(p)))
	return len(p), nil
}

// Serve serves the webhook over TLS on l until ctx ends: h at Path and at
// MutatePath (a Handler tells the two apart by the path).
func Serve(ctx context.Context, l net.Listener, certs *CertLoader, h http.Handler) error {
	mux := http.NewServeMux()
	mux.Handle(Path, h)
	mux.Handle(MutatePath, h)
	logger := klog.FromContext(ctx)
	srv := &http.Server{
		Handler: mux, ReadHeaderTimeout: 5 * time.Second,
		TLSConfig:   &tls.Config{MinVersion: tls.VersionTLS12, GetCertificate: certs.GetCertificate},
		BaseContext: func(net.Listener) context.Context { return klog.NewContext(context.Background(), logger) },
		// TLS handshake errors (a client without our CA, a probe) are
		// the server's chatter: into the structured log, not stderr.
		ErrorLog: log.New(logWriter{logger}, "", 0),
	}
	go func() {
		<-ctx.Done()
		shutdown, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(shutdown)
	}()
	if err := srv.ServeTLS(l, "", ""); err != nil && !errors.Is(err, http.ErrServerClosed) {
		return fmt.Errorf("webhook server on %s: %w", l.Addr(), err)
	}
	return nil
}
