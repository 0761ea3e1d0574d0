package metrics

import (
	"crypto/tls"
	"fmt"
	"os"

	"k8s.io/client-go/util/cert"
)

// SelfSignedTLS is a server TLS configuration with a certificate made now,
// in memory, signed by a CA of its own that nobody else has, as
// controller-runtime's metrics server makes one: the connection is
// encrypted, so that a bearer token on the pod network is not readable by
// whoever sees the packets, but the client cannot verify the server
// (Prometheus scrapes with insecureSkipVerify). host names the certificate
// (the pod's name; the machine's host name when empty).
func SelfSignedTLS(host string) (*tls.Config, error) {
	if host == "" {
		host, _ = os.Hostname()
	}
	certPEM, keyPEM, err := cert.GenerateSelfSignedCertKey(host, nil, nil)
	if err != nil {
		return nil, fmt.Errorf("metrics server: self-signed certificate: %w", err)
	}
	pair, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		return nil, fmt.Errorf("metrics server: self-signed certificate: %w", err)
	}
	return &tls.Config{Certificates: []tls.Certificate{pair}, MinVersion: tls.VersionTLS12}, nil
}
