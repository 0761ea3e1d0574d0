package controller

import (
	"context"
	"errors"
	"fmt"
	"sync"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/metadata"
	"k8s.io/klog/v2"

	"github.com/gpudra/gpudra/pkg/controller/gang"
	"github.com/gpudra/gpudra/pkg/controller/nodehold"
)

// startNodeHold starts, on the leader, the node hold controller
// (cfg.ProtectNodes) or, with it off, one release of the marks an earlier
// leader set: a node it marked would otherwise never be scaled down.
func startNodeHold(ctx context.Context, wg *wait.Group, cfg Config, client kubernetes.Interface, plans *gangPlans, cancel context.CancelCauseFunc) error {
	md := cfg.Metadata
	if md == nil && cfg.RESTConfig != nil {
		var err error
		if md, err = metadata.NewForConfig(cfg.RESTConfig); err != nil {
			return fmt.Errorf("metadata client: %w", err)
		}
	}
	if !cfg.ProtectNodes {
		if md == nil {
			return nil
		}
		wg.StartWithContext(ctx, func(ctx context.Context) {
			n, err := nodehold.Release(ctx, md)
			if n > 0 || err != nil {
				klog.FromContext(ctx).Info("Released gpudra's node marks: protecting nodes from autoscalers is off", "nodes", n, "err", err)
			}
		})
		return nil
	}
	if md == nil {
		return errors.New("node hold controller: it needs a REST configuration for its metadata client")
	}
	nh, err := nodehold.New(nodehold.Options{Client: client, Metadata: md, Registerer: cfg.Registry, Planned: plans.claims})
	if err != nil {
		return err
	}
	plans.setKick(nh.Kick)
	wg.StartWithContext(ctx, func(ctx context.Context) {
		if err := nh.Run(ctx); err != nil {
			cancel(fmt.Errorf("node hold controller: %w", err))
		}
	})
	return nil
}

// gangPlans hands the node hold controller the claims planned for gangs
// being admitted by the gang controller that runs now (runGangs makes a
// new one when the gang path changes), and tells it when they change.
type gangPlans struct {
	mu     sync.Mutex
	gc     *gang.Controller
	notify func()
}

func (p *gangPlans) set(gc *gang.Controller) {
	p.mu.Lock()
	p.gc = gc
	p.mu.Unlock()
	p.kick()
}

func (p *gangPlans) setKick(f func()) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.notify = f
}

func (p *gangPlans) kick() {
	p.mu.Lock()
	f := p.notify
	p.mu.Unlock()
	if f != nil {
		f()
	}
}

func (p *gangPlans) claims() []*resourceapi.ResourceClaim {
	p.mu.Lock()
	gc := p.gc
	p.mu.Unlock()
	if gc == nil {
		return nil
	}
	return gc.HandedClaims()
}
