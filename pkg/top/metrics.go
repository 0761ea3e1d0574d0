package top

import (
	"cmp"
	"fmt"
	"io"
	"slices"
	"strings"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/gpudra/gpudra/pkg/slicebuilder"
)

// ParseMetrics parses a /metrics scrape in the Prometheus text format.
func ParseMetrics(r io.Reader) (map[string]*dto.MetricFamily, error) {
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(r)
	if err != nil {
		return nil, fmt.Errorf("parse the metrics: %w", err)
	}
	return fams, nil
}

// The series top reads from a kubelet plugin's /metrics (docs/metrics.md).
// The attribution series may be missing (a plugin from before them, or
// attribution off): the devices are shown without processes then.
const (
	mUp              = "gpudra_telemetry_up"
	mSampleAge       = "gpudra_telemetry_last_sample_age_seconds"
	mAttributionUp   = "gpudra_telemetry_attribution_up"
	mUnresolved      = "gpudra_telemetry_unresolved_processes"
	mUtil            = "gpudra_gpu_utilization_ratio"
	mGPUSMActive     = "gpudra_gpu_sm_active_ratio"
	mMIGSMActive     = "gpudra_mig_sm_active_ratio"
	mGPUFBUsed       = "gpudra_gpu_framebuffer_used_bytes"
	mGPUFBTotal      = "gpudra_gpu_framebuffer_total_bytes"
	mMIGFBUsed       = "gpudra_mig_framebuffer_used_bytes"
	mMIGFBTotal      = "gpudra_mig_framebuffer_total_bytes"
	mPower           = "gpudra_gpu_power_watts"
	mTemp            = "gpudra_gpu_temperature_celsius"
	mFree            = "gpudra_device_free"
	mClaimInfo       = "gpudra_device_claim_info"
	mPodInfo         = "gpudra_device_pod_info"
	mContainerMem    = "gpudra_container_gpu_memory_used_bytes"
	mContainerSM     = "gpudra_container_gpu_sm_utilization_ratio"
	mContainerProcs  = "gpudra_container_gpu_processes"
	mUnattributedMem = "gpudra_unattributed_gpu_memory_used_bytes"
	mUnattributedN   = "gpudra_unattributed_gpu_processes"
)

// FromMetrics is the snapshot of one scrape of a kubelet plugin (families
// as ParseMetrics returns them).
func FromMetrics(fams map[string]*dto.MetricFamily, source string, at time.Time) *Snapshot {
	s := &Snapshot{Source: source, At: at}
	devs := map[string]*Device{}
	// device returns the series' device, made on first sight; nil for a
	// series without one.
	device := func(l map[string]string) *Device {
		name := l[lDevice]
		if name == "" {
			return nil
		}
		if s.Node == "" {
			s.Node = l["node"]
		}
		d := devs[name]
		if d == nil {
			d = &Device{Name: name}
			devs[name] = d
		}
		switch {
		case strings.Contains(name, "-mig-"):
			d.GPU = l["gpu"] // a MIG device's series name its GPU
			if l[lMigProfile] != "" {
				d.Profile = l[lMigProfile]
			}
		default:
			d.UUID = l["gpu"]
		}
		if l["model"] != "" {
			d.Model = l["model"]
		}
		return d
	}
	each := func(name string, fn func(l map[string]string, v float64)) {
		f := fams[name]
		if f == nil {
			return
		}
		for _, m := range f.GetMetric() {
			fn(labels(m), value(m))
		}
	}
	set := func(name string, field func(d *Device) **float64) {
		each(name, func(l map[string]string, v float64) {
			if d := device(l); d != nil {
				*field(d) = ptr(v)
			}
		})
	}
	set(mUtil, func(d *Device) **float64 { return &d.Utilization })
	set(mGPUSMActive, func(d *Device) **float64 { return &d.SMActive })
	set(mMIGSMActive, func(d *Device) **float64 { return &d.SMActive })
	set(mGPUFBUsed, func(d *Device) **float64 { return &d.MemoryUsedBytes })
	set(mMIGFBUsed, func(d *Device) **float64 { return &d.MemoryUsedBytes })
	set(mGPUFBTotal, func(d *Device) **float64 { return &d.MemoryTotalBytes })
	set(mMIGFBTotal, func(d *Device) **float64 { return &d.MemoryTotalBytes })
	set(mPower, func(d *Device) **float64 { return &d.PowerWatts })
	set(mTemp, func(d *Device) **float64 { return &d.TemperatureC })
	each(mFree, func(l map[string]string, v float64) {
		if d := device(l); d != nil {
			free := v == 1
			d.Free = &free
		}
	})
	each(mClaimInfo, func(l map[string]string, _ float64) {
		if d := device(l); d != nil {
			holder(d, l[lClaimNS]+"/"+l[lClaimName])
		}
	})
	each(mPodInfo, func(l map[string]string, _ float64) {
		d := device(l)
		if d == nil {
			return
		}
		claim := ""
		if l[lClaimName] != "" {
			claim = l[lClaimNS] + "/" + l[lClaimName]
		}
		h := holder(d, claim)
		h.Pods = append(h.Pods, l["namespace"]+"/"+l["pod"]+"/"+l["container"])
	})
	attribution := false
	each(mAttributionUp, func(_ map[string]string, v float64) { attribution = v == 1 })
	// Per-container figures: one Process per container and device.
	procs := map[string]map[string]*Process{}
	proc := func(l map[string]string, unattributed bool) *Process {
		d := device(l)
		if d == nil {
			return nil
		}
		key := "\x00unattributed"
		if !unattributed {
			key = l["namespace"] + "/" + l["pod"] + "/" + l["container"]
		}
		if procs[d.Name] == nil {
			procs[d.Name] = map[string]*Process{}
		}
		p := procs[d.Name][key]
		if p == nil {
			p = &Process{Unattributed: unattributed}
			if !unattributed {
				p.Container = key
			}
			procs[d.Name][key] = p
		}
		return p
	}
	for _, m := range []struct {
		name         string
		unattributed bool
		field        func(p *Process) **float64
	}{
		{mContainerMem, false, func(p *Process) **float64 { return &p.MemoryBytes }},
		{mContainerSM, false, func(p *Process) **float64 { return &p.SMUtilization }},
		{mContainerProcs, false, func(p *Process) **float64 { return &p.Count }},
		{mUnattributedMem, true, func(p *Process) **float64 { return &p.MemoryBytes }},
		{mUnattributedN, true, func(p *Process) **float64 { return &p.Count }},
	} {
		each(m.name, func(l map[string]string, v float64) {
			if p := proc(l, m.unattributed); p != nil {
				*m.field(p) = ptr(v)
			}
		})
	}
	for _, d := range devs {
		d.ProcessesRead = attribution
		for _, key := range sortedKeys(procs[d.Name]) {
			p := procs[d.Name][key]
			if p.Unattributed && (p.Count == nil || *p.Count == 0) {
				continue // nothing outside the device's containers
			}
			d.Processes = append(d.Processes, *p)
		}
		for i := range d.Holders {
			slices.Sort(d.Holders[i].Pods)
		}
		slices.SortFunc(d.Holders, func(a, b Holder) int { return cmp.Compare(a.Claim, b.Claim) })
	}
	s.Devices = sortDevices(devs)

	// Notes: what the scrape says it could not read.
	age := -1.0
	each(mSampleAge, func(_ map[string]string, v float64) { age = v })
	each(mUp, func(_ map[string]string, v float64) {
		switch {
		case v == 1:
		case age < 0:
			s.Notes = append(s.Notes, "the plugin's telemetry is down (no read completed yet, or the last failed): the device figures are missing")
		default:
			s.Notes = append(s.Notes, fmt.Sprintf("the plugin's telemetry is down (the last read, %s ago, failed, or a read hangs): the device figures are missing",
				time.Duration(age*float64(time.Second)).Round(time.Second)))
		}
	})
	switch {
	case fams[mAttributionUp] == nil:
		s.Notes = append(s.Notes, "the plugin exports no process attribution: no processes shown")
	case !attribution:
		s.Notes = append(s.Notes, "the plugin could not read the kubelet's pod-resources API: no processes shown")
	}
	each(mUnresolved, func(_ map[string]string, v float64) {
		if v > 0 {
			s.Notes = append(s.Notes, fmt.Sprintf("%d processes whose container could not be told: their devices' container figures are left out", int(v)))
		}
	})
	return s
}

// holder returns the device's holder of a claim ("" in device plugin
// mode), made on first sight.
func holder(d *Device, claim string) *Holder {
	for i := range d.Holders {
		if d.Holders[i].Claim == claim {
			return &d.Holders[i]
		}
	}
	d.Holders = append(d.Holders, Holder{Claim: claim})
	return &d.Holders[len(d.Holders)-1]
}

// The label names top reads that are dcgm-exporter's (docs/metrics.md).
const (
	lDevice     = "dra_device_name"
	lMigProfile = "dra_mig_profile"
	lClaimName  = "dra_claim_name"
	lClaimNS    = "dra_claim_namespace"
)

// renamed are the names a plugin from before the dcgm-exporter names gave
// the same labels, by today's name.
var renamed = map[string]string{lDevice: "device", lMigProfile: "profile", lClaimName: "claim_name", lClaimNS: "claim_namespace"}

// labels are the series' labels, under today's names also when the plugin
// is older (its device_pod_info's claim is in the pod's namespace).
func labels(m *dto.Metric) map[string]string {
	out := make(map[string]string, len(m.GetLabel()))
	for _, l := range m.GetLabel() {
		out[l.GetName()] = l.GetValue()
	}
	for now, before := range renamed {
		if v, ok := out[before]; ok && out[now] == "" {
			out[now] = v
		}
	}
	if claim := out["claim"]; claim != "" && out[lClaimName] == "" {
		out[lClaimName], out[lClaimNS] = claim, out["namespace"]
	}
	return out
}

func value(m *dto.Metric) float64 {
	switch {
	case m.Gauge != nil:
		return m.GetGauge().GetValue()
	case m.Counter != nil:
		return m.GetCounter().GetValue()
	default:
		return m.GetUntyped().GetValue()
	}
}

// sortDevices orders devices by GPU minor, each GPU before its MIG
// devices, then by name.
func sortDevices(devs map[string]*Device) []Device {
	out := make([]Device, 0, len(devs))
	for _, d := range devs {
		out = append(out, *d)
	}
	slices.SortFunc(out, compareDevices)
	return out
}

func compareDevices(a, b Device) int {
	if c := cmp.Compare(slicebuilder.GPUMinor(a.Name), slicebuilder.GPUMinor(b.Name)); c != 0 {
		return c
	}
	am, bm := strings.Contains(a.Name, "-mig-"), strings.Contains(b.Name, "-mig-")
	if am != bm {
		if am {
			return 1
		}
		return -1
	}
	return cmp.Compare(a.Name, b.Name)
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}
