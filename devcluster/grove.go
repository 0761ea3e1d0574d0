package devcluster

import (
	"context"
	"time"

	"github.com/gpudra/gpudra/devcluster/controlplane"
	"github.com/gpudra/gpudra/devcluster/groveoperator"
)

// installGrove installs Grove's CRDs and waits until the API server serves
// them.
func (c *Cluster) installGrove(ctx context.Context) error {
	crds, err := groveoperator.CRDs()
	if err != nil {
		return err
	}
	return c.installCRDs(ctx, crds)
}

// startGrove installs Grove's CRDs and runs the stand-in for Grove's
// operator until the cluster stops.
func (c *Cluster) startGrove(ctx context.Context) (<-chan struct{}, error) {
	if err := c.installGrove(ctx); err != nil {
		return nil, err
	}
	// The operator has a client of its own, at controller-runtime's
	// default limits (20 QPS, burst 30).
	cfg := controlplane.Clients{Base: c.apiServer.ClientConfig}.Config(controlplane.ControllerManagerShipped, "grove-operator/devcluster-stand-in")
	g, err := groveoperator.NewOperator(cfg)
	if err != nil {
		return nil, err
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		g.Run(ctx)
	}()
	return done, nil
}

// WaitForGrovePods waits until the stand-in has created every pod of the
// namespace's PodCliqueSets, so that a wait for Running pods that follows
// sees them: they appear only after the token Secret is filled.
func (c *Cluster) WaitForGrovePods(ctx context.Context, namespace string, timeout time.Duration) error {
	return groveoperator.WaitForPods(ctx, c.RESTConfig, c.Client, namespace, timeout)
}
