// Package cloud is devcluster's cloud: machines of the types gpudra knows
// (pkg/machinetype), each a simulated GPU node that runs the real plugin,
// bought and terminated through an API (devcluster/cloudapi) on a unix
// socket, as an autoscaler's cloud provider buys machines from its cloud.
//
// A machine is a devcluster node (nodeagent): its Node object is created
// by its "kubelet" with the labels and taints the buyer asked for and the
// provider ID cloudapi.ProviderIDPrefix+name; terminating it stops its
// kubelet and plugin and leaves the Node object to whoever manages nodes,
// as on a cloud.
package cloud

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"net"
	"net/http"
	"os"
	"slices"
	"sync"
	"time"

	v1 "k8s.io/api/core/v1"
	"k8s.io/klog/v2"

	"github.com/gpudra/gpudra/devcluster/cloudapi"
	"github.com/gpudra/gpudra/devcluster/nodeagent"
	"github.com/gpudra/gpudra/pkg/machinetype"
	"github.com/gpudra/gpudra/pkg/slicebuilder"
)

// Nodes is what runs the machines: devcluster.Cluster.
type Nodes interface {
	AddNode(ctx context.Context, opts nodeagent.NodeOptions) (*nodeagent.Node, error)
	RemoveNode(name string) error
}

// Cloud serves the machine API. Close it to stop serving; the machines
// stay until the cluster stops.
type Cloud struct {
	// Socket is the API's unix socket (cloudapi.SocketEnv).
	Socket string

	ctx    context.Context
	nodes  Nodes
	server *http.Server

	mu       sync.Mutex
	machines map[string]*machine
}

// machine is a machine the cloud runs, and its lifecycle.
type machine struct {
	cloudapi.Machine
	// started is closed once its node's kubelet and plugin run (or
	// failed to start: err).
	started chan struct{}
	err     error
}

// Start serves the machine API on socket until ctx ends or Close. Nodes
// the cloud starts live in ctx.
func Start(ctx context.Context, socket string, nodes Nodes) (*Cloud, error) {
	_ = os.Remove(socket)
	ln, err := net.Listen("unix", socket)
	if err != nil {
		return nil, fmt.Errorf("devcluster cloud: %w", err)
	}
	if err := os.Chmod(socket, 0o600); err != nil {
		_ = ln.Close()
		return nil, fmt.Errorf("devcluster cloud: %w", err)
	}
	c := &Cloud{Socket: socket, ctx: ctx, nodes: nodes, machines: map[string]*machine{}}
	mux := http.NewServeMux()
	mux.HandleFunc("GET "+cloudapi.InstanceTypesPath, c.instanceTypes)
	mux.HandleFunc("GET "+cloudapi.MachinesPath, c.list)
	mux.HandleFunc("POST "+cloudapi.MachinesPath, c.create)
	mux.HandleFunc("GET "+cloudapi.MachinesPath+"/{name}", c.get)
	mux.HandleFunc("DELETE "+cloudapi.MachinesPath+"/{name}", c.delete)
	c.server = &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second,
		BaseContext: func(net.Listener) context.Context { return ctx }}
	go func() { _ = c.server.Serve(ln) }()
	go func() {
		<-ctx.Done()
		_ = c.server.Close()
	}()
	return c, nil
}

// Close stops serving.
func (c *Cloud) Close() error { return c.server.Close() }

// Machines are the machines the cloud runs, by name.
func (c *Cloud) Machines() []cloudapi.Machine {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make([]cloudapi.Machine, 0, len(c.machines))
	for _, name := range slices.Sorted(maps.Keys(c.machines)) {
		out = append(out, c.machines[name].Machine)
	}
	return out
}

// pricePerGPUHour are devcluster's prices, in the proportions of the
// clouds' on-demand prices of 2026: what orders the types for an
// autoscaler, so that the cheapest type that fits is the one to buy.
var pricePerGPUHour = map[string]float64{"NVIDIA H100 80GB HBM3": 3.9, "NVIDIA H200": 4.9, "NVIDIA H100 PCIe": 2.9, "NVIDIA GH200 480GB": 5.5}

// InstanceTypes are the types on sale under a configuration: the cloud
// types of machinetype.Types, with the templates of a fresh node
// of the type (machinetype.TemplatesOf, what `gpudra slices -o karpenter`
// prints).
func InstanceTypes(ctx context.Context, cfg cloudapi.Configuration) ([]cloudapi.InstanceType, error) {
	policyName := cfg.MIGDevices
	if policyName == "" {
		policyName = slicebuilder.MigPolicyAll
	}
	policy, err := slicebuilder.ParseMigPolicy(policyName)
	if err != nil {
		return nil, fmt.Errorf("migDevices: %w", err)
	}
	var out []cloudapi.InstanceType
	for _, t := range machinetype.Types() {
		// The cloud types only: each has a machine with MIG mode off and
		// one with it on; the simulator's machines have the mode they are
		// built with.
		if t.Provider == "" || t.GPUs == 0 {
			continue
		}
		tmpl, err := machinetype.TemplatesOf(ctx, t, cfg.MIGMode, policyName, slicebuilder.Options{FractionalGPUs: cfg.FractionalGPUs, Mig: policy})
		if err != nil {
			return nil, fmt.Errorf("instance type %s: %w", t.Name, err)
		}
		raw, err := json.Marshal(tmpl)
		if err != nil {
			return nil, err
		}
		price, ok := pricePerGPUHour[t.GPUProduct]
		if !ok {
			price = 2
		}
		out = append(out, cloudapi.InstanceType{Name: t.Name, GPUs: t.GPUs, GPUProduct: t.GPUProduct,
			CPU: nodeagent.NodeCPU, Memory: nodeagent.NodeMemory, Pods: "110", EphemeralStorage: nodeagent.NodeEphemeralStorage,
			PricePerHour: price * float64(t.GPUs), Templates: raw})
	}
	return out, nil
}

func (c *Cloud) instanceTypes(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	cfg := cloudapi.Configuration{MIGMode: q.Get("migMode") == "true", MIGDevices: q.Get("migDevices"), FractionalGPUs: q.Get("fractionalGPUs") == "true"}
	types, err := InstanceTypes(r.Context(), cfg)
	if err != nil {
		fail(w, http.StatusBadRequest, err)
		return
	}
	answer(w, http.StatusOK, types)
}

func (c *Cloud) list(w http.ResponseWriter, _ *http.Request) { answer(w, http.StatusOK, c.Machines()) }

func (c *Cloud) get(w http.ResponseWriter, r *http.Request) {
	c.mu.Lock()
	m, ok := c.machines[r.PathValue("name")]
	var out cloudapi.Machine
	if ok {
		out = m.Machine
	}
	c.mu.Unlock()
	if !ok {
		fail(w, http.StatusNotFound, fmt.Errorf("machine %q: not found", r.PathValue("name")))
		return
	}
	answer(w, http.StatusOK, out)
}

// create buys a machine: it answers at once, with the machine's provider
// ID, and boots the machine behind the answer, as a cloud does.
func (c *Cloud) create(w http.ResponseWriter, r *http.Request) {
	var req cloudapi.MachineRequest
	dec := json.NewDecoder(r.Body)
	dec.DisallowUnknownFields()
	if err := dec.Decode(&req); err != nil {
		fail(w, http.StatusBadRequest, fmt.Errorf("machine request: %w", err))
		return
	}
	opts, err := nodeOptions(req)
	if err != nil {
		fail(w, http.StatusBadRequest, err)
		return
	}
	c.mu.Lock()
	if _, dup := c.machines[req.Name]; dup {
		c.mu.Unlock()
		fail(w, http.StatusConflict, fmt.Errorf("machine %q exists already", req.Name))
		return
	}
	m := &machine{Machine: cloudapi.Machine{MachineRequest: req, ProviderID: opts.ProviderID, Created: time.Now()}, started: make(chan struct{})}
	c.machines[req.Name] = m
	out := m.Machine
	c.mu.Unlock()
	go c.boot(m, opts)
	answer(w, http.StatusCreated, out)
}

// boot starts the machine's node, then records when its plugin has
// published every slice (Machine.Ready).
func (c *Cloud) boot(m *machine, opts nodeagent.NodeOptions) {
	logger := klog.FromContext(c.ctx).WithValues("machine", m.Name, "instanceType", m.InstanceType)
	n, err := c.nodes.AddNode(c.ctx, opts)
	m.err = err
	close(m.started)
	if err != nil {
		logger.Error(err, "Machine did not boot")
		return
	}
	logger.Info("Machine booted")
	if err := n.WaitForSlices(c.ctx); err != nil {
		logger.Error(err, "Machine's node published no complete pool")
		return
	}
	c.mu.Lock()
	m.Ready = time.Now()
	c.mu.Unlock()
}

// delete terminates a machine: 404 once it is gone.
func (c *Cloud) delete(w http.ResponseWriter, r *http.Request) {
	name := r.PathValue("name")
	c.mu.Lock()
	m, ok := c.machines[name]
	c.mu.Unlock()
	if !ok {
		fail(w, http.StatusNotFound, fmt.Errorf("machine %q: not found", name))
		return
	}
	select {
	case <-m.started:
	case <-r.Context().Done():
		fail(w, http.StatusServiceUnavailable, fmt.Errorf("machine %q is still booting", name))
		return
	}
	if m.err == nil {
		if err := c.nodes.RemoveNode(name); err != nil {
			fail(w, http.StatusInternalServerError, fmt.Errorf("terminate machine %q: %w", name, err))
			return
		}
	}
	c.mu.Lock()
	delete(c.machines, name)
	c.mu.Unlock()
	klog.FromContext(c.ctx).Info("Machine terminated", "machine", name)
	w.WriteHeader(http.StatusNoContent)
}

// nodeOptions are the node a machine request runs as.
func nodeOptions(req cloudapi.MachineRequest) (nodeagent.NodeOptions, error) {
	if req.Name == "" {
		return nodeagent.NodeOptions{}, errors.New("machine request: name is empty")
	}
	t, err := machinetype.Lookup(req.InstanceType)
	if err != nil {
		return nodeagent.NodeOptions{}, fmt.Errorf("machine request %s: instanceType: %w", req.Name, err)
	}
	sim, err := t.Machine(req.Configuration.MIGMode)
	if err != nil {
		return nodeagent.NodeOptions{}, fmt.Errorf("machine request %s: configuration.migMode: %w", req.Name, err)
	}
	policyName := req.Configuration.MIGDevices
	if policyName == "" {
		policyName = slicebuilder.MigPolicyAll
	}
	policy, err := slicebuilder.ParseMigPolicy(policyName)
	if err != nil {
		return nodeagent.NodeOptions{}, fmt.Errorf("machine request %s: configuration.migDevices: %w", req.Name, err)
	}
	labels := maps.Clone(req.Labels)
	if labels == nil {
		labels = map[string]string{}
	}
	// What a cloud's kubelet labels its node with.
	labels[v1.LabelInstanceTypeStable] = t.Name
	labels[v1.LabelTopologyZone] = cloudapi.Zone
	taints := make([]v1.Taint, 0, len(req.Taints))
	for i, t := range req.Taints {
		effect := v1.TaintEffect(t.Effect)
		if effect != v1.TaintEffectNoSchedule && effect != v1.TaintEffectPreferNoSchedule && effect != v1.TaintEffectNoExecute {
			return nodeagent.NodeOptions{}, fmt.Errorf("machine request %s: taints[%d].effect: %q is not NoSchedule, PreferNoSchedule or NoExecute", req.Name, i, t.Effect)
		}
		taints = append(taints, v1.Taint{Key: t.Key, Value: t.Value, Effect: effect})
	}
	return nodeagent.NodeOptions{Name: req.Name, Machine: sim, Labels: labels, Taints: taints,
		ProviderID: cloudapi.ProviderIDPrefix + req.Name, FractionalGPUs: req.Configuration.FractionalGPUs, MigDevices: &policy}, nil
}

func answer(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(v)
}

func fail(w http.ResponseWriter, code int, err error) {
	answer(w, code, cloudapi.Error{Message: err.Error()})
}
