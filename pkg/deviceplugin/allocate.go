package deviceplugin

import (
	"errors"
	"fmt"
	"path"
	"strconv"
	"strings"

	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

// What Allocate answers, by device list strategy (flags.plugin.deviceListStrategy):
//
//	strategy          NVIDIA's part                                   gpudra's CDI-free part
//	envvar (default)  NVIDIA_VISIBLE_DEVICES=<ids>                    DeviceSpecs, Mounts, Envs
//	volume-mounts     NVIDIA_VISIBLE_DEVICES=/var/run/nvidia-container-devices,
//	                  /dev/null mounted at .../<id> per device        DeviceSpecs, Mounts, Envs
//	cdi-annotations   annotation cdi.k8s.io/gpudra-device-plugin_<h>=<CDI names>
//	cdi-cri           CdiDevices: the CDI names
//
// The CDI names are the devices' in the node-wide spec (an MPS replica's:
// its GPU's MPS spec) plus ExtraCDIDevices (the driver's spec). The CDI-free
// part is those CDI devices' edits (cdiview.go), so a container gets its
// GPUs on a runtime without CDI and without NVIDIA's runtime: it is sent
// whenever a strategy other than the CDI ones is listed. Listing only CDI
// strategies declares a CDI-enabled runtime: then only the CDI names go
// (as NVIDIA's plugin does), plus NVIDIA_VISIBLE_DEVICES=void, and the host
// needs no device node (the runtime creates the nodes from the spec's
// type, major and minor). When both go ([envvar, cdi-cri]), a CDI runtime
// applies the CDI edits after the kubelet's devices, mounts and variables
// and replaces each by path, destination or name (the CDI library's
// ContainerEdits.Apply), so nothing is doubled and the CDI value of
// NVIDIA_VISIBLE_DEVICES (void) wins.
//
// NVIDIA_VISIBLE_DEVICES follows NVIDIA's plugin: the list (or the
// volume-mounts root) under envvar or volume-mounts, overriding the CDI
// edits' "void", so that NVIDIA's runtime, where it is the default, injects
// what it injected with NVIDIA's plugin (the same nodes again: harmless).
func (p *Plugin) response(devs []Device) (*pluginapi.ContainerAllocateResponse, error) {
	r := p.opts.Resource.Response
	names := p.cdiNames(devs)
	resp := &pluginapi.ContainerAllocateResponse{}
	if r.Includes(DeviceListCDICRI) {
		for _, n := range names {
			resp.CdiDevices = append(resp.CdiDevices, &pluginapi.CDIDevice{Name: n})
		}
	}
	if r.Includes(DeviceListCDIAnnotations) {
		key, err := r.annotationKey(p.opts.Resource.Name)
		if err != nil {
			return nil, err
		}
		resp.Annotations = map[string]string{key: strings.Join(names, ",")}
	}
	if !r.NeedsDeviceSpecs() {
		resp.Envs = map[string]string{VisibleDevicesEnv: "void"}
		return resp, nil
	}
	e, err := p.cdi.Edits(r, names...)
	if err != nil {
		return nil, err
	}
	resp.Devices, resp.Mounts, resp.Envs = e.Devices, e.Mounts, e.Envs
	ids := runtimeIDs(devs, r)
	if r.Includes(DeviceListEnvVar) {
		resp.Envs[VisibleDevicesEnv] = strings.Join(ids, ",")
	}
	if r.Includes(DeviceListVolumeMounts) {
		resp.Envs[VisibleDevicesEnv] = VolumeMountsRoot
		for _, id := range ids {
			resp.Mounts = append(resp.Mounts, &pluginapi.Mount{HostPath: volumeMountsHostPath, ContainerPath: path.Join(VolumeMountsRoot, id)})
		}
	}
	return resp, nil
}

// cdiNames are the CDI devices of the devices, once each, then the extra
// ones.
func (p *Plugin) cdiNames(devs []Device) []string {
	var names []string
	seen := map[string]bool{}
	for _, d := range devs {
		n := p.cdiName(d)
		if !seen[n] {
			seen[n] = true
			names = append(names, n)
		}
	}
	return append(names, p.opts.ExtraCDIDevices...)
}

// runtimeIDs name the devices for NVIDIA's runtime, once each (a replica
// is its device), as NVIDIA's plugin does: UUIDs, or GPU indexes under the
// index strategy (Resources refuses it for MIG devices).
func runtimeIDs(devs []Device, r Response) []string {
	var ids []string
	seen := map[string]bool{}
	for _, d := range devs {
		id := d.UUID
		if r.IDStrategy == DeviceIDIndex {
			id = strconv.Itoa(d.GPUIndex)
		}
		if !seen[id] {
			seen[id] = true
			ids = append(ids, id)
		}
	}
	return ids
}

// resolveCDI checks, when Allocate will pass the CDI specs' edits, that
// every CDI device the resource can name resolves: a spec missing at
// start is an error there rather than at a container's start.
func (p *Plugin) resolveCDI() error {
	if !p.opts.Resource.Response.NeedsDeviceSpecs() {
		return nil
	}
	if p.opts.CDIDir == "" {
		return errors.New("no CDI directory: the device list strategies pass the CDI specs' edits")
	}
	r, err := newCDIResolver(p.opts.CDIDir)
	if err != nil {
		return err
	}
	p.cdi = r
	seen := map[string]bool{}
	for _, d := range p.opts.Resource.Devices {
		if d.Sharing == MPS && !p.opts.MPS {
			continue // refused at Allocate
		}
		names := append([]string{p.cdiName(d)}, p.opts.ExtraCDIDevices...)
		if seen[names[0]] {
			continue
		}
		seen[names[0]] = true
		e, err := r.Edits(p.opts.Resource.Response, names...)
		if err != nil {
			return fmt.Errorf("device ID %s: %w", d.ID, err)
		}
		p.hooks = max(p.hooks, e.Hooks)
	}
	return nil
}

// cdiName is the CDI device of a device ID: its device in the node-wide
// spec, or for an MPS replica its GPU's MPS spec.
func (p *Plugin) cdiName(d Device) string {
	if d.Sharing == MPS {
		return MPSCDIDeviceName(d.Name)
	}
	return CDIDeviceName(d.Name)
}
