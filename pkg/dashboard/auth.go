package dashboard

import (
	"crypto/rand"
	"crypto/subtle"
	"fmt"
	"net/http"
	"net/url"
	"strings"
)

// TokenParam is the query parameter of the URL gpudra dashboard prints,
// as Jupyter's: http://127.0.0.1:8477/?token=...
const TokenParam = "token"

// tokenAuth keeps the page to whoever holds the URL the CLI printed. The
// server reads the cluster with its user's kubeconfig; on a shared host
// (a bastion) every local user reaches 127.0.0.1, so the address alone
// would lend that kubeconfig's reads to all of them.
//
// The URL's token is exchanged, on the first load, for an HttpOnly,
// SameSite=Strict cookie, and the browser is sent to the URL without it
// (out of the address bar and its history); scripts send it as
// "Authorization: Bearer <token>".
type tokenAuth struct {
	token []byte
	// cookie is the cookie's name. Browsers share a host's cookies across
	// ports, so the name carries the port: two dashboards on one host keep
	// their own.
	cookie string
}

// NewToken returns a random token of 128 bits, as text.
func NewToken() string { return rand.Text() }

func newTokenAuth(token, port string) tokenAuth {
	return tokenAuth{token: []byte(token), cookie: "gpudra-dashboard-" + port}
}

// matches compares in constant time: the time taken says nothing of how
// much of a guess was right.
func (a tokenAuth) matches(got string) bool {
	return got != "" && subtle.ConstantTimeCompare([]byte(got), a.token) == 1
}

// authorize serves requests without the token and says whether the
// request may go on: true when it carries the token (Bearer header or
// cookie). A page load with the token in its URL gets the cookie and is
// redirected to the same URL without it; anything else gets 401.
func (a tokenAuth) authorize(w http.ResponseWriter, r *http.Request) bool {
	q := r.URL.Query()
	if q.Has(TokenParam) && (r.Method == http.MethodGet || r.Method == http.MethodHead) {
		if !a.matches(q.Get(TokenParam)) {
			a.refuse(w, "the URL's token is not this server's (a dashboard started again prints a new one)")
			return false
		}
		http.SetCookie(w, &http.Cookie{Name: a.cookie, Value: string(a.token), Path: "/", HttpOnly: true,
			SameSite: http.SameSiteStrictMode})
		q.Del(TokenParam)
		to := url.URL{Path: r.URL.Path, RawQuery: q.Encode()}
		// The fragment (the page's filters) is the browser's: it keeps it
		// across a redirect whose Location has none.
		http.Redirect(w, r, to.String(), http.StatusSeeOther)
		return false
	}
	if scheme, token, ok := strings.Cut(r.Header.Get("Authorization"), " "); ok && strings.EqualFold(scheme, "Bearer") {
		if a.matches(strings.TrimSpace(token)) {
			return true
		}
		a.refuse(w, "the Authorization header's bearer token is not this server's")
		return false
	}
	if c, err := r.Cookie(a.cookie); err == nil && a.matches(c.Value) {
		return true
	}
	a.refuse(w, "this request carries no token")
	return false
}

func (a tokenAuth) refuse(w http.ResponseWriter, why string) {
	w.Header().Set("WWW-Authenticate", `Bearer realm="gpudra dashboard"`)
	w.Header().Set("Cache-Control", "no-store")
	http.Error(w, fmt.Sprintf("gpudra dashboard: %s. Open the URL with ?%s=... that `gpudra dashboard` "+
		"(or `gpudra local dashboard`) printed on its standard error when it started (\"Serving the dashboard on "+
		"http://...\"); scripts send the token as \"Authorization: Bearer <token>\".", why, TokenParam),
		http.StatusUnauthorized)
}
