package plugin

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/component-base/featuregate"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/klog/v2"

	"github.com/gpudra/gpudra/pkg/cdi"
	"github.com/gpudra/gpudra/pkg/drivertools"
	"github.com/gpudra/gpudra/pkg/features"
	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/sharing"
	"github.com/gpudra/gpudra/pkg/slicebuilder"
)

// Config is everything the kubelet plugin needs; cmd/kubelet-plugin fills it
// from flags.
type Config struct {
	NodeName string
	// Backend is the GPU model, and through its Host everything the plugin
	// needs about the node besides: device majors, MIG capability minors,
	// the compute policy that sets time slices.
	Backend nvdevice.Interface
	Client  kubernetes.Interface
	// RegistrarDir is the kubelet's plugin registry
	// (/var/lib/kubelet/plugins_registry).
	RegistrarDir string
	// PluginDataDir holds the DRA socket and the checkpoint
	// (/var/lib/kubelet/plugins/gpu.gpudra.dev).
	PluginDataDir string
	CDIDir        string
	BootID        string
	// Metrics receive the plugin's measurements; nil disables them.
	Metrics *Metrics
	// PodUID enables rolling updates: old and new plugin pods serve side
	// by side during an upgrade, so a node is never without a plugin.
	PodUID string
	// FractionalGPUs publishes whole GPUs with MIG off as shareable
	// (consumable capacity), each share capped with MPS.
	FractionalGPUs bool
	// DCGMExporterAttributes adds to each MIG device the attributes
	// dcgm-exporter reads (`profile`); off by default, for what it costs
	// kube-scheduler (docs/scale.md).
	DCGMExporterAttributes bool
	// MigDevices says which MIG devices a GPU in MIG mode publishes
	// (--mig-devices; zero: all); the Node's annotation
	// gpu.gpudra.dev/mig-devices overrides it (migpolicy.go).
	MigDevices slicebuilder.MigPolicy
	// MPSControlBinary is nvidia-cuda-mps-control; empty: MPS claims are
	// refused with a message saying so.
	MPSControlBinary string
	// Namespace is the plugin's namespace, where MPS server pods run.
	Namespace string
	// MPSServerImage is the gpudra image that MPS server pods run; empty:
	// MPS servers run as processes of the plugin and die with its
	// container (docs/sharing.md).
	MPSServerImage string
	// MPSServerServiceAccount is the ServiceAccount MPS server pods run
	// as: one with no permissions (the chart's <release>-mps-server). The
	// chart's admission policy refuses any other.
	MPSServerServiceAccount string
	// MPSServerLogArgs make MPS server pods log as the plugin does.
	MPSServerLogArgs []string
	// HostDriverRoot is the driver root on the host, for MPS server pods.
	HostDriverRoot string
	// DriverFilesHostRoot is where the container runtime on the host finds
	// the driver's files that the backend discovered under its own driver
	// root (the plugin's mount of it); empty: where they were found.
	DriverFilesHostRoot string
	// CDIHookPath is the NVIDIA container toolkit's nvidia-cdi-hook on the
	// host: the driver's spec then runs its update-ldcache and
	// create-symlinks hooks. Empty: no hooks; the libraries are also
	// mounted under their sonames (docs/install.md).
	CDIHookPath string
	// DriverTools runs the driver's tools (nvidia-cuda-mps-control) from
	// the driver root, with the host's own loader and libraries.
	DriverTools drivertools.Runner
	// UnhealthyTaintEffect is NoSchedule (default) or NoExecute (pods on an
	// unhealthy GPU are evicted).
	UnhealthyTaintEffect resourceapi.DeviceTaintEffect
	// HealthIgnoredXIDs are the XIDs that count as application errors and
	// leave the GPU healthy; nil: nvdevice.ApplicationXIDs.
	HealthIgnoredXIDs []uint64
	// HealthObserver is told every XID and every change of the unhealthy
	// GPUs the health watch sees (telemetry.HealthMetrics); nil: none.
	HealthObserver HealthObserver
	// FeatureGates turn features on and off (docs/feature-gates.md); nil:
	// every gate at its default.
	FeatureGates featuregate.FeatureGate
}

// Plugin is a running kubelet plugin.
type Plugin struct {
	Driver *Driver
	Helper *kubeletplugin.Helper
	// Sockets are the registration and DRA sockets, for the liveness check.
	Sockets []string
}

// Start starts the plugin: the host's facts from the backend, node state
// from the checkpoint, the gRPC services on their sockets, and the first
// publication of the slices.
func Start(ctx context.Context, cfg Config, cancel context.CancelCauseFunc) (*Plugin, error) {
	logger := klog.FromContext(ctx)
	if err := cfg.CheckFeatures(); err != nil {
		return nil, err
	}
	sockets := cfg.socketPaths()
	if err := socketPathsFit(sockets); err != nil {
		return nil, err
	}
	// Device majors, capability minors and the compute policy come from
	// the backend, once: the simulator stands in for all of them.
	host, err := cfg.Backend.Host(ctx)
	if err != nil {
		return nil, fmt.Errorf("host facts from the GPU backend: %w", err)
	}
	if host.CapMinors == nil {
		return nil, errors.New("host facts from the GPU backend: no MIG capability minors")
	}
	for _, dir := range []string{cfg.PluginDataDir, cfg.RegistrarDir} {
		if err := os.MkdirAll(dir, 0o750); err != nil {
			return nil, fmt.Errorf("plugin directory: %w", err)
		}
	}
	writer, err := cdi.NewWriter(cfg.CDIDir)
	if err != nil {
		return nil, err
	}
	// The driver's files, in the common spec every prepared device
	// references, before any claim is served.
	driverSpec := &driverSpec{backend: cfg.Backend, writer: writer,
		opts: cdi.DriverOptions{HostRoot: cfg.DriverFilesHostRoot, HookPath: cfg.CDIHookPath}}
	if _, err := driverSpec.sync(ctx); err != nil {
		return nil, err
	}
	// Events on the Node, through client-go's recorder; it stops with ctx
	// (a failed start) or at Stop.
	nodeEv, err := startNodeEvents(ctx, cfg.Client, cfg.NodeName)
	if err != nil {
		return nil, err
	}
	sharer, err := newSharing(ctx, cfg, host.ComputePolicy, nodeEv)
	if err != nil {
		return nil, err
	}
	state, err := NewNodeState(ctx, StateOptions{
		Pool: cfg.NodeName, Backend: cfg.Backend, CDI: writer, Majors: host.Majors, CapMinors: host.CapMinors,
		CheckpointPath: filepath.Join(cfg.PluginDataDir, "checkpoint.json"), BootID: cfg.BootID, Sharing: sharer,
		FeatureGates:     cfg.FeatureGates,
		OnPreparedClaims: cfg.Metrics.onPreparedClaims(),
		OnPrepareStep:    cfg.Metrics.onPrepareStep(),
		Claims: ClaimsOfPool(func(ctx context.Context) ([]resourceapi.ResourceClaim, error) {
			list, err := cfg.Client.ResourceV1().ResourceClaims(metav1.NamespaceAll).List(ctx, metav1.ListOptions{})
			if err != nil {
				return nil, err
			}
			return list.Items, nil
		}, cfg.NodeName),
		OnRebuild: func(ctx context.Context, r RebuildReport) {
			logger.Error(r.Cause, "Node state rebuilt from the node and the API", "movedTo", r.MovedAside, "adopted", r.Adopted, "unknown", r.Unknown)
			nodeEv.checkpointRebuilt(r)
		},
	})
	if err != nil {
		return nil, err
	}
	d := &Driver{state: state, backend: cfg.Backend, pool: cfg.NodeName, cancel: cancel, metrics: cfg.Metrics,
		client: cfg.Client, fractional: cfg.FractionalGPUs, dcgmExporterAttributes: cfg.DCGMExporterAttributes, migPolicy: nodeMigPolicy(ctx, cfg.Client, cfg.NodeName, cfg.MigDevices, nodeEv), existingMigOnly: !features.Enabled(cfg.FeatureGates, features.DynamicMIG),
		taintEffect: cfg.UnhealthyTaintEffect,
		xidPolicy:   nvdevice.NewXIDPolicy(cfg.HealthIgnoredXIDs), events: nodeEv, driverSpec: driverSpec, healthObs: cfg.HealthObserver}
	// With the DeviceHealth gate off nothing is tainted, not even the GPUs
	// recorded unhealthy before: no watch would ever clear those taints.
	healthOn := features.Enabled(cfg.FeatureGates, features.DeviceHealth)
	if healthOn {
		d.restoreHealth(ctx, filepath.Join(cfg.PluginDataDir, HealthFile), cfg.BootID)
	} else {
		logger.Info("GPU health is not watched and no device is tainted: feature gate DeviceHealth is off")
	}
	opts := []kubeletplugin.Option{
		kubeletplugin.KubeClient(cfg.Client),
		kubeletplugin.NodeName(cfg.NodeName),
		kubeletplugin.DriverName(slicebuilder.DriverName),
		kubeletplugin.RegistrarDirectoryPath(cfg.RegistrarDir),
		kubeletplugin.PluginDataDirectoryPath(cfg.PluginDataDir),
	}
	if cfg.PodUID != "" {
		opts = append(opts, kubeletplugin.RollingUpdate(types.UID(cfg.PodUID)))
	}
	helper, err := kubeletplugin.Start(ctx, d, opts...)
	if err != nil {
		return nil, fmt.Errorf("start kubelet plugin: %w", err)
	}
	d.publish = func(ctx context.Context) error {
		res, _, err := d.Resources(ctx)
		if err != nil {
			return err
		}
		return helper.PublishResources(ctx, res)
	}
	if err := d.publish(ctx); err != nil {
		helper.Stop()
		return nil, fmt.Errorf("publish ResourceSlices: %w", err)
	}
	// Every later publish goes through the queue, retried until it works.
	d.startRepublishing(ctx)
	if _, err := d.republishOnWipe(ctx, cfg.Client, cfg.NodeName); err != nil {
		d.stopRepublishing()
		helper.Stop()
		return nil, fmt.Errorf("watch the node's ResourceSlices: %w", err)
	}
	if healthOn {
		if err := d.watchHealth(ctx); err != nil {
			d.stopRepublishing()
			helper.Stop()
			return nil, err
		}
	}
	go d.watchInventory(ctx)
	// A driver upgrade under the running plugin rewrites the common spec.
	go wait.UntilWithContext(ctx, driverSpec.refresh, driverSpecEvery)
	// Rollbacks that failed at start (a lost GPU, say) are retried; the
	// rest of the node works meanwhile.
	go wait.UntilWithContext(ctx, d.retryInterrupted, retryInterruptedEvery)
	// MPS servers that are gone are started again; under the node lock,
	// from the checkpoint, so that a server another instance just stopped
	// is never brought back.
	go wait.UntilWithContext(ctx, state.SuperviseSharing, superviseSharingEvery)
	return &Plugin{Driver: d, Helper: helper, Sockets: sockets}, nil
}

// socketPaths are the DRA and registration sockets the kubelet plugin
// helper makes: per pod UID where there is one (rolling updates).
func (cfg Config) socketPaths() []string {
	if cfg.PodUID == "" {
		return []string{filepath.Join(cfg.PluginDataDir, "dra.sock"), filepath.Join(cfg.RegistrarDir, slicebuilder.DriverName+"-reg.sock")}
	}
	return []string{filepath.Join(cfg.PluginDataDir, "dra-"+cfg.PodUID+".sock"),
		filepath.Join(cfg.RegistrarDir, kubeletplugin.RollingUpdateRegistrarSocketFile(cfg.RegistrarDir, slicebuilder.DriverName, types.UID(cfg.PodUID)))}
}

// maxSocketPath is the longest path a unix socket may have on Linux
// (sun_path holds 108 bytes, the last a NUL).
const maxSocketPath = 107

// socketPathsFit refuses, before anything is done, sockets whose paths
// are too long to bind: otherwise the helper fails later with only
// "bind: invalid argument". A pod UID adds 36 bytes to each name, so a
// long kubelet directory (kubeletPlugin.kubeletDir) meets the limit first.
func socketPathsFit(sockets []string) error {
	for _, s := range sockets {
		if len(s) > maxSocketPath {
			return fmt.Errorf("unix socket %s is %d bytes, over the %d a socket path may have: shorten the kubelet directory (chart value kubeletPlugin.kubeletDir; --plugin-data-dir, --registrar-dir)",
				s, len(s), maxSocketPath)
		}
	}
	return nil
}

// newSharing builds the sharing strategies, time-slicing through the host's
// compute policy; an MPS daemon that had to be started again is logged,
// counted and recorded as an Event on the Node.
func newSharing(ctx context.Context, cfg Config, policy sharing.TimeSlicer, nodeEv *nodeEvents) (*sharing.Manager, error) {
	logger := klog.FromContext(ctx)
	opts := cfg.SharingOptions()
	opts.Policy = policy
	opts.OnDaemonRestart = func(s sharing.MPSServer, err error) {
		cfg.Metrics.mpsRestart(err)
		nodeEv.mpsRestarted(s, err)
		if err != nil {
			logger.Error(err, "MPS server of prepared claims is gone and could not be started again", "server", s.Key, "devices", s.Devices)
			return
		}
		logger.Info("MPS server of prepared claims was gone and was started again; its clients must reconnect", "server", s.Key, "devices", s.Devices)
	}
	return sharing.NewManager(opts)
}

// SharingOptions are where and how the node's MPS servers run, the same in
// both modes of the node agent (the device plugin mode's MPS replicas use
// the DRA side's servers): under PluginDataDir/sharing, the control binary
// run through DriverTools, the servers as pods of their own when
// MPSServerImage is set (processes of the agent otherwise). No time slicer
// and no restart callback: the caller adds its own.
func (cfg Config) SharingOptions() sharing.Options {
	opts := sharing.Options{Root: filepath.Join(cfg.PluginDataDir, "sharing")}
	if cfg.MPSControlBinary != "" {
		opts.MPSControl = sharing.ExecMPSControl{Runner: cfg.DriverTools, Path: cfg.MPSControlBinary}
	}
	if cfg.MPSServerImage != "" {
		opts.MPSServers = &sharing.PodServers{Client: cfg.Client, Namespace: cfg.Namespace, NodeName: cfg.NodeName,
			Image: cfg.MPSServerImage, ImagePullPolicy: corev1.PullIfNotPresent, HostDriverRoot: cfg.HostDriverRoot,
			ServiceAccount: cfg.MPSServerServiceAccount, LogArgs: cfg.MPSServerLogArgs}
	}
	return opts
}

// retryInterruptedEvery spaces retries of failed rollbacks.
const retryInterruptedEvery = 30 * time.Second

// superviseSharingEvery spaces the checks that every prepared MPS claim's
// server exists.
const superviseSharingEvery = 5 * time.Second

// Stop stops the gRPC services; the published slices stay (the kubelet
// removes them if the plugin does not come back).
func (p *Plugin) Stop() {
	// No publish after the helper stopped.
	p.Driver.stopRepublishing()
	p.Helper.Stop()
	p.Driver.events.shutdown()
	_ = p.Driver.state.Close()
}
