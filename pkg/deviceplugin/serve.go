package deviceplugin

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"k8s.io/klog/v2"

	"github.com/gpudra/gpudra/pkg/cdi"
	"github.com/gpudra/gpudra/pkg/nvdevice"
)

// Backend is what the device plugin needs of the GPU model (nvdevice.Interface
// has it all).
type Backend interface {
	nvdevice.Inventorier
	nvdevice.HealthWatcher
	Host(ctx context.Context) (nvdevice.Host, error)
}

// ServeOptions configure the device plugin mode of the node agent.
type ServeOptions struct {
	Backend Backend
	// Resources say what to advertise (GPU resource name, config file).
	Resources ResourceOptions
	// CDI writes the node-wide spec Allocate's CDI names resolve in: the
	// same writer (and directory) as the DRA side.
	CDI *cdi.Writer
	// XIDPolicy decides which health events make a device unhealthy.
	XIDPolicy nvdevice.XIDPolicy
	// MPS runs the MPS replicas' servers (sharing.mps).
	MPS MPSOptions
	// Metrics record what the plugins do and serve /healthz; nil: none.
	Metrics *Metrics
	// PluginDir, ExtraCDIDevices and PollInterval go to every resource's
	// plugin (Options).
	PluginDir       string
	ExtraCDIDevices []string
	PollInterval    time.Duration
}

// Serve is the device plugin mode: it reads the inventory once, writes the
// node-wide CDI spec, and runs one plugin per resource (each registered with
// the kubelet, fed by its own health watch) until ctx is done or one fails.
// A change of MIG layout or of the config needs a restart, as with NVIDIA's
// plugin.
func Serve(ctx context.Context, o ServeOptions) error {
	logger := klog.FromContext(ctx)
	inv, err := o.Backend.Inventory(ctx)
	if err != nil {
		return fmt.Errorf("device plugin: inventory: %w", err)
	}
	host, err := o.Backend.Host(ctx)
	if err != nil {
		return fmt.Errorf("device plugin: host: %w", err)
	}
	resources, err := Resources(inv, o.Resources)
	if err != nil {
		return fmt.Errorf("device plugin: %w", err)
	}
	if o.CDI == nil {
		return errors.New("device plugin: no CDI writer")
	}
	if len(resources) == 0 {
		// Nothing to advertise (every GPU in MIG mode without MIG
		// devices): no CDI spec either, since a spec without devices is
		// invalid.
		logger.Info("No GPU or MIG device to advertise; waiting", "gpus", len(inv.GPUs))
		<-ctx.Done()
		return nil
	}
	if err := WriteCDISpec(o.CDI, inv, host); err != nil {
		return err
	}
	if o.Metrics != nil {
		onRestart := o.MPS.OnRestart
		o.MPS.OnRestart = func(g MPSGPU, err error) {
			o.Metrics.mpsRestarted(err)
			if onRestart != nil {
				onRestart(g, err)
			}
		}
	}
	mps, err := startMPS(ctx, o.MPS, o.CDI, inv, host, resources)
	if err != nil {
		return fmt.Errorf("device plugin: %w", err)
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go mps.supervise(ctx)
	var plugins []*Plugin
	for _, r := range resources {
		health, err := HealthUpdates(ctx, o.Backend, o.XIDPolicy)
		if err != nil {
			return err
		}
		p, err := New(Options{Resource: r, PluginDir: o.PluginDir, Health: health, ExtraCDIDevices: o.ExtraCDIDevices,
			CDIDir: o.CDI.Dir(), MPS: len(mps.gpus) > 0, PollInterval: o.PollInterval, Metrics: o.Metrics})
		if err != nil {
			return err
		}
		plugins = append(plugins, p)
		logger.Info("Advertising resource", "resource", r.Name, "devices", len(r.Devices))
	}
	sockets := make([]string, 0, len(plugins))
	for _, p := range plugins {
		sockets = append(sockets, p.SocketPath())
	}
	o.Metrics.serving(sockets)
	defer o.Metrics.serving(nil)
	var wg sync.WaitGroup
	errs := make([]error, len(plugins))
	for i, p := range plugins {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := p.Run(ctx); err != nil {
				errs[i] = err
				cancel()
			}
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}
