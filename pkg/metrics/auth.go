package metrics

import (
	"fmt"
	"net/http"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/apiserver/pkg/authentication/authenticator"
	"k8s.io/apiserver/pkg/authentication/authenticatorfactory"
	"k8s.io/apiserver/pkg/authorization/authorizer"
	"k8s.io/apiserver/pkg/authorization/authorizerfactory"
	authenticationv1 "k8s.io/client-go/kubernetes/typed/authentication/v1"
	authorizationv1 "k8s.io/client-go/kubernetes/typed/authorization/v1"
	"k8s.io/client-go/rest"
	"k8s.io/klog/v2"
)

// ProxiedAuthorizationHeader carries a bearer token ("Bearer <token>") to
// the metrics server through kube-apiserver's pods proxy, which removes
// the Authorization header of every request it authenticated and forwards
// none of the caller's identity: gpudra dashboard copies its user's token
// into it, so that the plugin reviews the user, not nobody.
const ProxiedAuthorizationHeader = "X-Gpudra-Authorization"

// Decision caches: a scrape every 10 s by one Prometheus costs one
// TokenReview and one SubjectAccessReview a minute; a refusal is asked
// again after 10 s, so that a new RoleBinding soon takes effect.
const (
	AuthenticationCacheTTL = time.Minute
	AllowCacheTTL          = time.Minute
	DenyCacheTTL           = 10 * time.Second
	reviewTimeout          = 10 * time.Second
)

// Auth authenticates a request's bearer token with a TokenReview and
// authorizes its user with a SubjectAccessReview for the non-resource
// path it asks (verb get on /metrics), as kube-rbac-proxy and
// controller-runtime's metrics filter do, the answers cached.
type Auth struct {
	Authenticator authenticator.Request
	Authorizer    authorizer.Authorizer
}

// NewKubernetesAuth reviews through the API server cfg points at, as the
// component's own identity: it needs create on
// tokenreviews.authentication.k8s.io and
// subjectaccessreviews.authorization.k8s.io.
func NewKubernetesAuth(cfg *rest.Config) (*Auth, error) {
	authn, err := authenticationv1.NewForConfig(cfg)
	if err != nil {
		return nil, fmt.Errorf("metrics authentication: TokenReview client: %w", err)
	}
	authz, err := authorizationv1.NewForConfig(cfg)
	if err != nil {
		return nil, fmt.Errorf("metrics authorization: SubjectAccessReview client: %w", err)
	}
	return NewAuth(authn, authz)
}

// NewAuth reviews with these clients.
func NewAuth(tokenReviews authenticationv1.AuthenticationV1Interface, accessReviews authorizationv1.AuthorizationV1Interface) (*Auth, error) {
	// k8s.io/apiserver/pkg/server/options' DefaultAuthWebhookRetryBackoff,
	// without the server options' dependencies (etcd, tracing).
	backoff := &wait.Backoff{Duration: 500 * time.Millisecond, Factor: 1.5, Jitter: 0.2, Steps: 5}
	authn, _, err := authenticatorfactory.DelegatingAuthenticatorConfig{
		TokenAccessReviewClient:  tokenReviews,
		TokenAccessReviewTimeout: reviewTimeout,
		WebhookRetryBackoff:      backoff,
		CacheTTL:                 AuthenticationCacheTTL,
	}.New()
	if err != nil {
		return nil, fmt.Errorf("metrics authentication: %w", err)
	}
	authz, err := authorizerfactory.DelegatingAuthorizerConfig{
		SubjectAccessReviewClient: accessReviews,
		AllowCacheTTL:             AllowCacheTTL,
		DenyCacheTTL:              DenyCacheTTL,
		WebhookRetryBackoff:       backoff,
	}.New()
	if err != nil {
		return nil, fmt.Errorf("metrics authorization: %w", err)
	}
	return &Auth{Authenticator: authn, Authorizer: authz}, nil
}

// Protect serves h to the requests whose user may get their path: 401
// without a valid bearer token, 403 when RBAC does not allow it. The
// paths in open (the probes' /healthz) are served to anyone: the kubelet
// probes without credentials, and they say nothing about who runs what.
func (a *Auth) Protect(h http.Handler, open ...string) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		for _, p := range open {
			if r.URL.Path == p {
				h.ServeHTTP(w, r)
				return
			}
		}
		logger := klog.FromContext(r.Context())
		if r.Header.Get("Authorization") == "" && r.Header.Get(ProxiedAuthorizationHeader) != "" {
			r = r.Clone(r.Context())
			r.Header.Set("Authorization", r.Header.Get(ProxiedAuthorizationHeader))
		}
		resp, ok, err := a.Authenticator.AuthenticateRequest(r)
		if err != nil || !ok {
			logger.V(4).Info("Metrics request not authenticated", "path", r.URL.Path, "remote", r.RemoteAddr, "err", err)
			http.Error(w, "Unauthorized: a bearer token the API server accepts (TokenReview) is required", http.StatusUnauthorized)
			return
		}
		attrs := authorizer.AttributesRecord{
			User:            resp.User,
			Verb:            strings.ToLower(r.Method),
			Path:            r.URL.Path,
			ResourceRequest: false,
		}
		decision, reason, err := a.Authorizer.Authorize(r.Context(), attrs)
		if err != nil {
			logger.Error(err, "Metrics request: SubjectAccessReview failed", "user", resp.User.GetName(), "path", r.URL.Path)
			http.Error(w, "Authorization failed: the API server's SubjectAccessReview did not answer", http.StatusInternalServerError)
			return
		}
		if decision != authorizer.DecisionAllow {
			logger.V(4).Info("Metrics request forbidden", "user", resp.User.GetName(), "path", r.URL.Path, "reason", reason)
			http.Error(w, fmt.Sprintf("Forbidden: user %q may not %s %s", resp.User.GetName(), attrs.Verb, r.URL.Path), http.StatusForbidden)
			return
		}
		h.ServeHTTP(w, r)
	})
}

// WithProxiedBearerToken makes cfg's requests through the API server's
// proxies (a path with /proxy/) carry the user's bearer token also in
// ProxiedAuthorizationHeader, which the API server forwards to the pod: a
// metrics server behind Protect then reviews the user, whom RBAC must let
// get /metrics. It wraps the transport inside client-go's authentication,
// so a token from a file, an exec plugin or an auth provider is seen; a
// client certificate carries no token, and the plugin answers 401.
func WithProxiedBearerToken(cfg *rest.Config) *rest.Config {
	cfg = rest.CopyConfig(cfg)
	cfg.Wrap(func(rt http.RoundTripper) http.RoundTripper { return proxiedBearerToken{rt} })
	return cfg
}

type proxiedBearerToken struct{ next http.RoundTripper }

func (p proxiedBearerToken) RoundTrip(req *http.Request) (*http.Response, error) {
	if a := req.Header.Get("Authorization"); strings.HasPrefix(a, "Bearer ") && strings.Contains(req.URL.Path, "/proxy/") {
		req = req.Clone(req.Context())
		req.Header.Set(ProxiedAuthorizationHeader, a)
	}
	return p.next.RoundTrip(req)
}
