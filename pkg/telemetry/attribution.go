package telemetry

import (
	"cmp"
	"context"
	"os"
	"path/filepath"
	"slices"
	"strconv"

	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/klog/v2"

	"github.com/gpudra/gpudra/pkg/metrics"
	"github.com/gpudra/gpudra/pkg/nvdevice"
)

// Process attribution (issue 36): which pod's container uses how much of
// each device, in both of the plugin's modes. Each sampling pass, after the
// device read, lists the kubelet's pod-resources API (who holds which
// device), reads each GPU process's cgroup from the host's /proc (which
// container it runs in) and the kubelet's container log links (which
// container ID is which pod's container), then computes the figures with
// a pure function (attribute). Nothing is ever inferred from names or a
// process's environment, and what could not be told is left out, never
// reported as 0.

// AttributionConfig says where the node's facts are read from.
type AttributionConfig struct {
	PodResourcesSocket string // the kubelet's pod-resources socket (/var/lib/kubelet/pod-resources/kubelet.sock)
	ProcRoot           string // the host's /proc (the plugin runs with hostPID)
	ContainerLogDir    string // the kubelet's /var/log/containers (links <pod>_<namespace>_<container>-<id>.log)
}

// SetAttribution turns process attribution on: from the next sampling pass
// on, every pass also attributes the devices' processes to the containers
// that hold the devices (gpudra_device_pod_info, gpudra_container_gpu_*,
// gpudra_unattributed_gpu_*, gpudra_telemetry_attribution_up and
// gpudra_telemetry_unresolved_processes). In DRA mode, SetClaims tells it
// which claims have admin access (no use of a device).
func (c *Collector) SetAttribution(cfg AttributionConfig) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.attribCfg = &cfg
}

var (
	descPodInfo = desc("device_pod_info", "1 for every container that the kubelet's pod-resources API lists on the device, in both modes (dra_claim_name and dra_claim_namespace: the ResourceClaim's in DRA mode, empty in device plugin mode). Admin-access claims are no use of a device and are left out.",
		containerLabels, labelClaimNS, labelClaimName)
	descContainerMem = desc("container_gpu_memory_used_bytes", "Framebuffer memory held on the device by the container's processes, summed (one series per container that holds the device; left out for a pass in which a process on the device could not be attributed).", containerLabels)
	descContainerSM  = desc("container_gpu_sm_utilization_ratio", "The container's processes' shares of the device's SMs over the last sample period, summed (NVML's per-process utilization; none on MIG devices, where NVML samples none).", containerLabels)
	descContainerPrc = desc("container_gpu_processes", "Compute processes of the container on the device.", containerLabels)
	descUnattrMem    = desc("unattributed_gpu_memory_used_bytes", "Framebuffer memory held on the device by processes in no container that holds it: host processes, or another container's.", heldLabels)
	descUnattrPrc    = desc("unattributed_gpu_processes", "Compute processes on the device in no container that holds it: host processes, or another container's.", heldLabels)
	descAttribUp     = prometheus.NewDesc(prometheus.BuildFQName(metrics.Namespace, "", "telemetry_attribution_up"),
		"1 when the last sampling pass read the kubelet's pod-resources API, 0 when it could not (the pod and container series are then missing).", []string{"node"}, nil)
	descUnresolved = prometheus.NewDesc(prometheus.BuildFQName(metrics.Namespace, "", "telemetry_unresolved_processes"),
		"GPU processes whose container could not be told in the last pass (their /proc entry, or their container's log link, unreadable); their devices' container figures are left out.", []string{"node"}, nil)
)

// attributionDescs are the attribution metrics' descriptions.
func attributionDescs() []*prometheus.Desc {
	return []*prometheus.Desc{descPodInfo, descContainerMem, descContainerSM, descContainerPrc, descUnattrMem, descUnattrPrc, descAttribUp, descUnresolved}
}

// attribution is one pass's result.
type attribution struct {
	// Up says whether the pod-resources API was read; nothing else is set
	// without it.
	Up bool
	// Unresolved counts the processes (distinct PIDs) whose container
	// could not be told.
	Unresolved int
	Devices    []deviceAttribution
}

// deviceAttribution is one device's holders and figures.
type deviceAttribution struct {
	heldDevice
	// Holders are the containers the pod-resources API lists on the
	// device, with their claim (one each per claim).
	Holders []podHold
	// Known says whether every process on the device was attributed (or
	// found in no holder): only then are Containers and Unattributed sent.
	Known bool
	// Containers are the figures of every container that holds the
	// device, processes or not.
	Containers []containerUsage
	// Unattributed are the processes in no container that holds the
	// device; nil on a GPU in MIG mode, whose processes are its MIG
	// devices' (and counted there).
	Unattributed *usage
}

type containerUsage struct {
	containerKey
	usage
}

// usage is processes' figures summed. A figure any process lacks is not
// known for the sum.
type usage struct {
	Memory, SM     float64
	MemoryOK, SMOK bool
	Processes      int
}

func newUsage(sm bool) usage { return usage{MemoryOK: true, SMOK: sm} }

func (u *usage) add(p nvdevice.ProcessSample) {
	u.Processes++
	u.Memory += p.UsedMemoryBytes.Value
	u.MemoryOK = u.MemoryOK && p.UsedMemoryBytes.Supported
	u.SM += p.SMUtilization.Value
	u.SMOK = u.SMOK && p.SMUtilization.Supported
}

// procInfo is what /proc says of one GPU process.
type procInfo struct {
	// Readable is false when /proc/<pid>/cgroup could not be read (the
	// process ended, or the host's /proc is not there): its container is
	// unknown.
	Readable bool
	Cgroup   cgroupInfo
}

// claimDevice names a device of a claim.
type claimDevice struct{ Namespace, Claim, Device string }

// attribInput is everything one pass read.
type attribInput struct {
	Samples []nvdevice.TelemetrySample
	// Holds is what the pod-resources API listed (podHoldsOf).
	Holds []podHold
	// Admin are the claims' devices given with admin access, from the
	// plugin's prepared claims (DRA mode): the pod-resources API does not
	// tell.
	Admin map[claimDevice]bool
	// Procs are the processes' cgroups, by PID.
	Procs map[int]procInfo
	Links containerLinks
}

// outcome is how a process of a device resolved.
type outcome int

const (
	unresolved outcome = iota
	attributed
	unattributed
)

// resolve finds which of the containers in candidates (the device's
// holders) the process pid runs in. A process that is in a container none
// of them is, or on the host, is unattributed; one whose cgroup could not
// be read, that is under kubepods without a container ID the parser knows,
// or whose container ID has no log link at all, is unresolved.
func (in *attribInput) resolve(pid int, candidates []containerKey) (containerKey, outcome) {
	p, ok := in.Procs[pid]
	if !ok || !p.Readable {
		return containerKey{}, unresolved
	}
	if len(p.Cgroup.IDs) == 0 {
		if p.Cgroup.InKubepods {
			return containerKey{}, unresolved
		}
		return containerKey{}, unattributed // a host process
	}
	for _, k := range candidates {
		for _, id := range p.Cgroup.IDs {
			if in.Links.has(k, id) {
				return k, attributed
			}
		}
	}
	for _, id := range p.Cgroup.IDs {
		if in.Links.OK && in.Links.known(id) {
			return containerKey{}, unattributed // another container's
		}
	}
	return containerKey{}, unresolved
}

// attribute computes one pass's attribution from what it read.
func attribute(in attribInput) *attribution {
	out := &attribution{Up: true}
	// A GPU in MIG mode lists no processes of its own: its MIG devices do.
	children := map[string][]*nvdevice.TelemetrySample{}
	for i := range in.Samples {
		if s := &in.Samples[i]; s.IsMIG() {
			children[s.ParentUUID] = append(children[s.ParentUUID], s)
		}
	}
	holders := map[string][]podHold{} // by sample UUID
	for i := range in.Samples {
		s := &in.Samples[i]
		holders[s.UUID] = podHoldersOf(s, in.Holds, in.Admin)
	}
	unresolvedPIDs := map[int]bool{}
	for i := range in.Samples {
		s := &in.Samples[i]
		d := deviceAttribution{heldDevice: heldDeviceOf(s), Holders: holders[s.UUID], Known: true}
		own := containersOf(d.Holders)
		// A process of a container that holds the parent GPU (a whole GPU
		// in MIG mode, as the device plugin's "none" MIG strategy gives
		// it) is that container's on the GPU: not unattributed here.
		candidates := own
		if s.IsMIG() {
			candidates = append(slices.Clone(own), containersOf(holders[s.ParentUUID])...)
		}
		kids, migMode := children[s.UUID]
		procs, read := s.Processes, s.ProcessesRead
		if migMode {
			procs, read = mergeProcesses(kids)
		}
		sm := !s.IsMIG() && !migMode // NVML samples no per-process SMs on MIG
		byContainer := map[containerKey]*usage{}
		for _, k := range own {
			u := newUsage(sm)
			byContainer[k] = &u
		}
		un := newUsage(sm)
		d.Known = read
		for _, p := range procs {
			k, o := in.resolve(p.PID, candidates)
			switch o {
			case attributed:
				if u := byContainer[k]; u != nil {
					u.add(p)
				}
			case unattributed:
				un.add(p)
			case unresolved:
				unresolvedPIDs[p.PID] = true
				d.Known = false
			}
		}
		if d.Known {
			for _, k := range own {
				d.Containers = append(d.Containers, containerUsage{containerKey: k, usage: *byContainer[k]})
			}
			if !migMode {
				d.Unattributed = &un
			}
		}
		out.Devices = append(out.Devices, d)
	}
	out.Unresolved = len(unresolvedPIDs)
	return out
}

// podHoldersOf are the holds on s, admin access left out, one per container
// and claim, sorted.
func podHoldersOf(s *nvdevice.TelemetrySample, holds []podHold, admin map[claimDevice]bool) []podHold {
	name := DeviceName(s)
	var out []podHold
	for _, h := range holds {
		if !(h.UUID != "" && h.UUID == s.UUID) && !(h.Device != "" && h.Device == name) {
			continue
		}
		if h.Device != "" && admin[claimDevice{Namespace: h.ClaimNamespace, Claim: h.Claim, Device: h.Device}] {
			continue
		}
		// Only what labels the series: two replicas or two shares are one.
		out = append(out, podHold{containerKey: h.containerKey, Claim: h.Claim})
	}
	slices.SortFunc(out, func(a, b podHold) int {
		return cmp.Or(cmp.Compare(a.Namespace, b.Namespace), cmp.Compare(a.Pod, b.Pod), cmp.Compare(a.Container, b.Container), cmp.Compare(a.Claim, b.Claim))
	})
	return slices.Compact(out)
}

// containersOf are the holders' containers, each once.
func containersOf(hs []podHold) []containerKey {
	var out []containerKey
	for _, h := range hs {
		if !slices.Contains(out, h.containerKey) {
			out = append(out, h.containerKey)
		}
	}
	return out
}

// mergeProcesses are the processes of a GPU in MIG mode: its MIG devices',
// one per PID (memory summed over the devices), read only when every MIG
// device's were. Their SM figures are not used (NVML has none on MIG).
func mergeProcesses(kids []*nvdevice.TelemetrySample) ([]nvdevice.ProcessSample, bool) {
	var out []nvdevice.ProcessSample
	at := map[int]int{}
	for _, k := range kids {
		if !k.ProcessesRead {
			return nil, false
		}
		for _, p := range k.Processes {
			i, ok := at[p.PID]
			if !ok {
				at[p.PID] = len(out)
				out = append(out, p)
				continue
			}
			m := &out[i].UsedMemoryBytes
			m.Value += p.UsedMemoryBytes.Value
			m.Supported = m.Supported && p.UsedMemoryBytes.Supported
		}
	}
	return out, true
}

// attribute reads what one pass needs and computes its attribution. A
// pod-resources API that cannot be read gives a result that is not Up.
func (c *Collector) attribute(ctx context.Context, cfg AttributionConfig, samples []nvdevice.TelemetrySample, claims ClaimsFunc) *attribution {
	logger := klog.FromContext(ctx)
	resp, err := listPodResources(ctx, cfg.PodResourcesSocket)
	if err != nil {
		logger.Error(err, "Attributing GPU processes to containers failed: no pod or container series this pass")
		return &attribution{}
	}
	in := attribInput{Samples: samples, Holds: podHoldsOf(resp, c.node), Admin: adminDevices(claims), Procs: map[int]procInfo{}}
	for i := range samples {
		for _, p := range samples[i].Processes {
			if _, done := in.Procs[p.PID]; done {
				continue
			}
			data, err := os.ReadFile(filepath.Join(cfg.ProcRoot, strconv.Itoa(p.PID), "cgroup"))
			if err != nil {
				logger.V(4).Info("A GPU process's cgroup is unreadable: its container is unresolved", "pid", p.PID, "err", err)
				in.Procs[p.PID] = procInfo{}
				continue
			}
			in.Procs[p.PID] = procInfo{Readable: true, Cgroup: parseCgroup(string(data))}
		}
	}
	if len(in.Procs) > 0 {
		if in.Links, err = readContainerLinks(cfg.ContainerLogDir); err != nil {
			logger.Error(err, "GPU processes in containers are unresolved this pass")
		}
	}
	return attribute(in)
}

// adminDevices are the devices that claims hold with admin access.
func adminDevices(claims ClaimsFunc) map[claimDevice]bool {
	if claims == nil {
		return nil
	}
	out := map[claimDevice]bool{}
	for _, cl := range claims() {
		for _, d := range cl.Devices {
			if d.AdminAccess {
				out[claimDevice{Namespace: cl.Namespace, Claim: cl.Name, Device: d.Device}] = true
			}
		}
	}
	return out
}

// collectAttribution sends a pass's attribution; a collector without
// SetAttribution sends none of it.
func (c *Collector) collectAttribution(ch chan<- prometheus.Metric, configured bool, a *attribution) {
	if !configured {
		return
	}
	gauge := prometheus.GaugeValue
	if a == nil || !a.Up {
		ch <- prometheus.MustNewConstMetric(descAttribUp, gauge, 0, c.node)
		return
	}
	ch <- prometheus.MustNewConstMetric(descAttribUp, gauge, 1, c.node)
	ch <- prometheus.MustNewConstMetric(descUnresolved, gauge, float64(a.Unresolved), c.node)
	for _, d := range a.Devices {
		for _, h := range d.Holders {
			claimNS := ""
			if h.Claim != "" {
				claimNS = h.Namespace // a pod's claims are in its namespace
			}
			ch <- prometheus.MustNewConstMetric(descPodInfo, gauge, 1, d.values(c.node, h.Namespace, h.Pod, h.Container, claimNS, h.Claim)...)
		}
		for _, u := range d.Containers {
			l := d.values(c.node, u.Namespace, u.Pod, u.Container)
			if u.MemoryOK {
				ch <- prometheus.MustNewConstMetric(descContainerMem, gauge, u.Memory, l...)
			}
			if u.SMOK {
				ch <- prometheus.MustNewConstMetric(descContainerSM, gauge, u.SM, l...)
			}
			ch <- prometheus.MustNewConstMetric(descContainerPrc, gauge, float64(u.Processes), l...)
		}
		if u := d.Unattributed; u != nil {
			if u.MemoryOK {
				ch <- prometheus.MustNewConstMetric(descUnattrMem, gauge, u.Memory, d.values(c.node)...)
			}
			ch <- prometheus.MustNewConstMetric(descUnattrPrc, gauge, float64(u.Processes), d.values(c.node)...)
		}
	}
}
