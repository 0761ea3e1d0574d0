package deviceplugin

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"k8s.io/klog/v2"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

// HealthUpdate changes the health of a GPU (every device ID on it: the GPU,
// its replicas and its MIG devices) or of one MIG device.
type HealthUpdate struct {
	// UUID is a GPU UUID or a MIG device UUID.
	UUID    string
	Healthy bool
	Reason  string
}

// HealthUpdates turns a backend's health events into updates under an XID
// policy: critical events make their GPU (or MIG device) unhealthy, a
// recovery makes it healthy again. One call per plugin: the backend
// supports several watchers. The channel closes when ctx is done.
func HealthUpdates(ctx context.Context, w nvdevice.HealthWatcher, policy nvdevice.XIDPolicy) (<-chan HealthUpdate, error) {
	events, err := w.WatchHealth(ctx)
	if err != nil {
		return nil, fmt.Errorf("watch GPU health: %w", err)
	}
	out := make(chan HealthUpdate)
	go func() {
		defer close(out)
		for ev := range events {
			uuid := ev.GPUUUID
			if ev.MigUUID != "" {
				uuid = ev.MigUUID
			}
			var u HealthUpdate
			switch {
			case ev.Kind == nvdevice.HealthRecovered:
				u = HealthUpdate{UUID: uuid, Healthy: true, Reason: ev.Message}
			case policy.Critical(ev):
				reason := string(ev.Kind)
				if ev.Kind == nvdevice.HealthXID {
					reason = "XID " + strconv.FormatUint(ev.XID, 10)
				}
				u = HealthUpdate{UUID: uuid, Reason: reason}
			default:
				continue
			}
			select {
			case out <- u:
			case <-ctx.Done():
				return
			}
		}
	}()
	return out, nil
}

// Options configure one resource's device plugin.
type Options struct {
	Resource Resource
	// PluginDir holds the kubelet's socket and ours; empty:
	// pluginapi.DevicePluginPath.
	PluginDir string
	// Health delivers health changes; nil: every device stays healthy.
	Health <-chan HealthUpdate
	// ExtraCDIDevices are added to every container's CDI devices
	// (cdi.DriverDeviceID when the driver's common spec is written).
	ExtraCDIDevices []string
	// CDIDir holds the CDI specs the CDI names resolve in (the node-wide
	// spec, the MPS specs, the driver's spec), already written. Required
	// when the resource's Response passes device specs (a non-CDI device
	// list strategy, the default): those are the specs' edits.
	CDIDir string
	// MPS says that the MPS replicas' servers run and their CDI specs
	// (MPSCDIDeviceName) are written; required to allocate MPS replicas.
	MPS bool
	// PollInterval spaces the checks of the kubelet's socket and ours;
	// zero: one second.
	PollInterval time.Duration
	// Metrics records allocations, registrations and device health; nil:
	// none.
	Metrics *Metrics
}

// Plugin is the device plugin of one resource: a
// pluginapi.DevicePluginServer that registers itself with the kubelet.
type Plugin struct {
	pluginapi.UnimplementedDevicePluginServer

	opts    Options
	devices map[string]Device
	// cdi resolves CDI names into container edits; nil when the Response
	// sends CDI names only.
	cdi *cdiResolver
	// hooks counts the CDI hooks the device plugin API cannot carry.
	hooks int

	mu        sync.Mutex
	unhealthy map[string]string // GPU or MIG UUID -> reason
	changed   chan struct{}     // closed and replaced on every health change
}

var _ pluginapi.DevicePluginServer = (*Plugin)(nil)

// New builds the plugin of one resource.
func New(opts Options) (*Plugin, error) {
	if err := ValidResourceName(opts.Resource.Name); err != nil {
		return nil, fmt.Errorf("device plugin: %w", err)
	}
	if len(opts.Resource.Devices) == 0 {
		return nil, fmt.Errorf("device plugin %s: no devices", opts.Resource.Name)
	}
	if opts.PluginDir == "" {
		opts.PluginDir = pluginapi.DevicePluginPath
	}
	if opts.PollInterval <= 0 {
		opts.PollInterval = time.Second
	}
	p := &Plugin{opts: opts, devices: map[string]Device{}, unhealthy: map[string]string{}, changed: make(chan struct{})}
	for _, d := range opts.Resource.Devices {
		if _, dup := p.devices[d.ID]; dup {
			return nil, fmt.Errorf("device plugin %s: device ID %q twice", opts.Resource.Name, d.ID)
		}
		p.devices[d.ID] = d
	}
	if err := p.resolveCDI(); err != nil {
		return nil, fmt.Errorf("device plugin %s: %w", opts.Resource.Name, err)
	}
	opts.Metrics.resource(opts.Resource.Name, len(opts.Resource.Devices), 0)
	return p, nil
}

// ResourceName is the resource the plugin serves.
func (p *Plugin) ResourceName() string { return p.opts.Resource.Name }

// SocketPath is where the plugin serves.
func (p *Plugin) SocketPath() string {
	return filepath.Join(p.opts.PluginDir, SocketName(p.opts.Resource.Name))
}

func (p *Plugin) kubeletSocket() string {
	return filepath.Join(p.opts.PluginDir, filepath.Base(pluginapi.KubeletSocket))
}

// SetHealth applies one health update. A GPU coming back healthy clears
// its MIG devices too.
func (p *Plugin) SetHealth(u HealthUpdate) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if u.Healthy {
		delete(p.unhealthy, u.UUID)
		for _, d := range p.devices {
			if d.GPUUUID == u.UUID {
				delete(p.unhealthy, d.UUID)
			}
		}
	} else {
		p.unhealthy[u.UUID] = u.Reason
	}
	unhealthy := 0
	for _, d := range p.opts.Resource.Devices {
		if _, ok := p.healthLocked(d); !ok {
			unhealthy++
		}
	}
	p.opts.Metrics.setDevices(p.opts.Resource.Name, len(p.opts.Resource.Devices)-unhealthy, unhealthy)
	// Every stream compares the new list with what it sent last.
	close(p.changed)
	p.changed = make(chan struct{})
}

// healthLocked is why a device is unhealthy, "" when it is healthy.
func (p *Plugin) healthLocked(d Device) (string, bool) {
	if r, ok := p.unhealthy[d.GPUUUID]; ok {
		return r, false
	}
	if r, ok := p.unhealthy[d.UUID]; ok {
		return r, false
	}
	return "", true
}

// List is the device list ListAndWatch sends now.
func (p *Plugin) List() []*pluginapi.Device {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.listLocked()
}

func (p *Plugin) listLocked() []*pluginapi.Device {
	out := make([]*pluginapi.Device, 0, len(p.opts.Resource.Devices))
	for _, d := range p.opts.Resource.Devices {
		health := pluginapi.Healthy
		if _, ok := p.healthLocked(d); !ok {
			health = pluginapi.Unhealthy
		}
		dev := &pluginapi.Device{ID: d.ID, Health: health}
		if d.NUMANode >= 0 {
			dev.Topology = &pluginapi.TopologyInfo{Nodes: []*pluginapi.NUMANode{{ID: int64(d.NUMANode)}}}
		}
		out = append(out, dev)
	}
	return out
}

// GetDevicePluginOptions: preferred allocation is available, no
// PreStartContainer call is needed.
func (p *Plugin) GetDevicePluginOptions(context.Context, *pluginapi.Empty) (*pluginapi.DevicePluginOptions, error) {
	return options(), nil
}

func options() *pluginapi.DevicePluginOptions {
	return &pluginapi.DevicePluginOptions{GetPreferredAllocationAvailable: true}
}

// ListAndWatch sends the device list, then again whenever a device's
// health changes, until the kubelet or the plugin stops.
func (p *Plugin) ListAndWatch(_ *pluginapi.Empty, stream grpc.ServerStreamingServer[pluginapi.ListAndWatchResponse]) error {
	var last []*pluginapi.Device
	for {
		p.mu.Lock()
		list, changed := p.listLocked(), p.changed
		p.mu.Unlock()
		if last == nil || !sameList(last, list) {
			if err := stream.Send(&pluginapi.ListAndWatchResponse{Devices: list}); err != nil {
				return err
			}
			last = list
		}
		select {
		case <-changed:
		case <-stream.Context().Done():
			return nil
		}
	}
}

func sameList(a, b []*pluginapi.Device) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i].ID != b[i].ID || a[i].Health != b[i].Health {
			return false
		}
	}
	return true
}

// GetPreferredAllocation answers each container with PreferredAllocation.
func (p *Plugin) GetPreferredAllocation(_ context.Context, req *pluginapi.PreferredAllocationRequest) (*pluginapi.PreferredAllocationResponse, error) {
	resp := &pluginapi.PreferredAllocationResponse{}
	for _, c := range req.ContainerRequests {
		ids := PreferredAllocation(p.opts.Resource.Devices, c.AvailableDeviceIDs, c.MustIncludeDeviceIDs, int(c.AllocationSize))
		resp.ContainerResponses = append(resp.ContainerResponses, &pluginapi.ContainerPreferredAllocationResponse{DeviceIDs: ids})
	}
	return resp, nil
}

// Allocate answers each container by the resource's device list
// strategies (allocate.go) for the GPUs and MIG devices under its device
// IDs (a replica is its device). An unknown or unhealthy ID, or several
// replicas where a replica must come alone, fail the call with an error
// naming the ID.
func (p *Plugin) Allocate(_ context.Context, req *pluginapi.AllocateRequest) (*pluginapi.AllocateResponse, error) {
	resp := &pluginapi.AllocateResponse{}
	for _, c := range req.ContainerRequests {
		cr, err := p.allocate(c.DevicesIds)
		p.opts.Metrics.allocated(p.opts.Resource.Name, err)
		if err != nil {
			return nil, err
		}
		resp.ContainerResponses = append(resp.ContainerResponses, cr)
	}
	return resp, nil
}

func (p *Plugin) allocate(ids []string) (*pluginapi.ContainerAllocateResponse, error) {
	name := p.opts.Resource.Name
	if len(ids) == 0 {
		return nil, status.Errorf(codes.InvalidArgument, "%s: a container request without device IDs", name)
	}
	var devs []Device
	p.mu.Lock()
	for _, id := range ids {
		d, ok := p.devices[id]
		if !ok {
			p.mu.Unlock()
			return nil, status.Errorf(codes.InvalidArgument, "%s: unknown device ID %q", name, id)
		}
		if reason, healthy := p.healthLocked(d); !healthy {
			p.mu.Unlock()
			return nil, status.Errorf(codes.FailedPrecondition, "%s: device ID %q is unhealthy (%s)", name, id, reason)
		}
		devs = append(devs, d)
	}
	p.mu.Unlock()
	for _, d := range devs {
		if d.FailRequestsGreaterThanOne && len(ids) > 1 {
			return nil, status.Errorf(codes.InvalidArgument, "%s: device ID %q is a shared replica and must be requested alone, got %d IDs (request %s: 1)", name, d.ID, len(ids), name)
		}
		if d.Sharing == MPS && !p.opts.MPS {
			// The GPU's MPS spec (its device nodes, its server's pipe
			// directory and the replica's limits) needs the daemon.
			return nil, status.Errorf(codes.FailedPrecondition, "%s: device ID %q is an MPS replica but no MPS control daemon is configured", name, d.ID)
		}
	}
	resp, err := p.response(devs)
	if err != nil {
		return nil, status.Errorf(codes.Internal, "%s: %v", name, err)
	}
	return resp, nil
}

// PreStartContainer is not needed (GetDevicePluginOptions says so).
func (p *Plugin) PreStartContainer(context.Context, *pluginapi.PreStartContainerRequest) (*pluginapi.PreStartContainerResponse, error) {
	return &pluginapi.PreStartContainerResponse{}, nil
}

// Run serves the plugin on its socket and registers it with the kubelet
// until ctx is done. Every poll interval it checks the kubelet's socket and
// its own: a kubelet socket that appears or is recreated (a kubelet
// restart) gets a new registration; its own socket gone (the kubelet
// removes plugin sockets when it restarts) restarts the server and
// registers again. Only failures to serve at all end it with an error.
func (p *Plugin) Run(ctx context.Context) error {
	logger := klog.FromContext(ctx).WithValues("resource", p.opts.Resource.Name)
	ctx = klog.NewContext(ctx, logger)
	if p.hooks > 0 {
		logger.Info("The CDI specs' hooks cannot be passed through the device plugin API: containers on a runtime without CDI do not get them (--nvidia-cdi-hook)",
			"hooks", p.hooks, "strategies", p.opts.Resource.Response.strategies())
	}
	if p.opts.Health != nil {
		go func() {
			for {
				select {
				case u, ok := <-p.opts.Health:
					if !ok {
						return
					}
					logger.Info("Device health changed", "uuid", u.UUID, "healthy", u.Healthy, "reason", u.Reason)
					p.SetHealth(u)
				case <-ctx.Done():
					return
				}
			}
		}()
	}
	ticker := time.NewTicker(p.opts.PollInterval)
	defer ticker.Stop()
	for {
		srv, err := p.serve(ctx)
		if err != nil {
			return err
		}
		var kubelet fileID
		registered := false
		for {
			if _, err := os.Stat(p.SocketPath()); err != nil {
				logger.Info("Our socket is gone (kubelet restart?): serving again", "socket", p.SocketPath())
				break
			}
			id, err := statID(p.kubeletSocket())
			switch {
			case err != nil:
				registered = false
			case !registered || id != kubelet:
				err := p.register(ctx)
				p.opts.Metrics.registered(p.opts.Resource.Name, err)
				if err != nil {
					logger.Error(err, "Registering with the kubelet failed; retrying")
				} else {
					logger.Info("Registered with the kubelet", "endpoint", SocketName(p.opts.Resource.Name))
					registered, kubelet = true, id
				}
			}
			select {
			case <-ctx.Done():
				srv.Stop()
				_ = os.Remove(p.SocketPath())
				return nil
			case <-ticker.C:
			}
		}
		srv.Stop()
	}
}

// fileID tells a recreated file from the one seen before.
type fileID struct {
	dev, ino uint64
	mtime    time.Time
}

func statID(path string) (fileID, error) {
	fi, err := os.Stat(path)
	if err != nil {
		return fileID{}, err
	}
	id := fileID{mtime: fi.ModTime()}
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		id.dev, id.ino = uint64(st.Dev), uint64(st.Ino)
	}
	return id, nil
}

func (p *Plugin) serve(ctx context.Context) (*grpc.Server, error) {
	path := p.SocketPath()
	if err := os.MkdirAll(p.opts.PluginDir, 0o750); err != nil {
		return nil, fmt.Errorf("device plugin directory: %w", err)
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("remove stale socket %s: %w", path, err)
	}
	lis, err := net.Listen("unix", path)
	if err != nil {
		return nil, fmt.Errorf("device plugin %s: listen on %s: %w", p.opts.Resource.Name, path, err)
	}
	srv := grpc.NewServer()
	pluginapi.RegisterDevicePluginServer(srv, p)
	go func() {
		if err := srv.Serve(lis); err != nil {
			klog.FromContext(ctx).Error(err, "Device plugin server stopped")
		}
	}()
	return srv, nil
}

// register calls the kubelet's Registration service.
func (p *Plugin) register(ctx context.Context) error {
	conn, err := grpc.NewClient("unix://"+p.kubeletSocket(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return fmt.Errorf("dial the kubelet at %s: %w", p.kubeletSocket(), err)
	}
	defer func() { _ = conn.Close() }()
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	_, err = pluginapi.NewRegistrationClient(conn).Register(ctx, &pluginapi.RegisterRequest{
		Version:      pluginapi.Version,
		Endpoint:     SocketName(p.opts.Resource.Name),
		ResourceName: p.opts.Resource.Name,
		Options:      options(),
	})
	if err != nil {
		return fmt.Errorf("register %s with the kubelet: %w", p.opts.Resource.Name, err)
	}
	return nil
}
