package controlplane

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"fmt"

	"k8s.io/client-go/informers"
	"k8s.io/klog/v2"
	sacontroller "k8s.io/kubernetes/pkg/controller/serviceaccount"
	"k8s.io/kubernetes/pkg/serviceaccount"
)

// newServiceAccountControllers builds kube-controller-manager's
// service-account controller (a "default" ServiceAccount in every
// namespace) and its token controller, which fills Secrets of type
// kubernetes.io/service-account-token. Operators wait on such Secrets:
// Grove creates no PodClique until its `<pcs>-ic-sat` Secret has a token.
// Wired as cmd/kube-controller-manager/app (service_accounts.go, core.go)
// wires them in k8s.io/kubernetes v1.37.1, with a signing key of its own:
// the test API server verifies tokens with its own key only, so these
// tokens do not authenticate anyone here, which nothing in devcluster
// needs (the ServiceAccount admission plugin stays off, see StartAPIServer).
// The returned functions run them, keyed by kube-controller-manager's
// controller names.
func newServiceAccountControllers(logger klog.Logger, clients Clients, factory informers.SharedInformerFactory) (map[string]func(context.Context), error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("service-account signing key: %w", err)
	}
	generator, err := serviceaccount.JWTTokenGenerator(serviceaccount.LegacyIssuer, key)
	if err != nil {
		return nil, fmt.Errorf("service-account token generator: %w", err)
	}
	tokenCfg, tokenClient, err := clients.controllerClient("tokens-controller")
	if err != nil {
		return nil, err
	}
	tokens, err := sacontroller.NewTokensController(logger, factory.Core().V1().ServiceAccounts(), factory.Core().V1().Secrets(),
		tokenClient, sacontroller.TokensControllerOptions{TokenGenerator: generator, RootCA: tokenCfg.CAData})
	if err != nil {
		return nil, fmt.Errorf("create token controller: %w", err)
	}
	_, saClient, err := clients.controllerClient("service-account-controller")
	if err != nil {
		return nil, err
	}
	accounts, err := sacontroller.NewServiceAccountsController(logger, factory.Core().V1().ServiceAccounts(),
		factory.Core().V1().Namespaces(), saClient, sacontroller.DefaultServiceAccountsControllerOptions())
	if err != nil {
		return nil, fmt.Errorf("create service-account controller: %w", err)
	}
	return map[string]func(context.Context){
		// ConcurrentSATokenSyncs defaults to 5, the service-account
		// controller runs one worker (kube-controller-manager's defaults).
		"serviceaccount-token-controller": func(ctx context.Context) { tokens.Run(ctx, 5) },
		"serviceaccount-controller":       func(ctx context.Context) { accounts.Run(ctx, 1) },
	}, nil
}
