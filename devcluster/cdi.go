package devcluster

import (
	"fmt"
	"sort"
	"strings"

	oci "github.com/opencontainers/runtime-spec/specs-go"
	cdiapi "tags.cncf.io/container-device-interface/pkg/cdi"
)

// ContainerView is what a container would get from its CDI devices: the
// runtime's view after the CDI library edited the OCI spec.
type ContainerView struct {
	CDIDevices  []string          `json:"cdiDevices,omitempty"`
	Env         map[string]string `json:"env,omitempty"`
	DeviceNodes []string          `json:"deviceNodes,omitempty"`
	Mounts      []string          `json:"mounts,omitempty"`
}

// VisibleGPUs is the container's NVIDIA_VISIBLE_DEVICES as a list.
func (v ContainerView) VisibleGPUs() []string {
	s := v.Env["NVIDIA_VISIBLE_DEVICES"]
	if s == "" {
		return nil
	}
	return strings.Split(s, ",")
}

// ResolveCDI injects the named CDI devices from the specs in cdiDir into an
// empty OCI spec, exactly as a CDI-enabled container runtime does.
func ResolveCDI(cdiDir string, ids []string) (ContainerView, error) {
	view := ContainerView{CDIDevices: ids}
	if len(ids) == 0 {
		return view, nil
	}
	cache, err := cdiapi.NewCache(cdiapi.WithSpecDirs(cdiDir), cdiapi.WithAutoRefresh(false))
	if err != nil {
		return view, fmt.Errorf("CDI cache: %w", err)
	}
	spec := &oci.Spec{Process: &oci.Process{}, Linux: &oci.Linux{}}
	if unresolved, err := cache.InjectDevices(spec, ids...); err != nil {
		return view, fmt.Errorf("CDI injection (unresolved %v): %w", unresolved, err)
	}
	view.Env = map[string]string{}
	for _, kv := range spec.Process.Env {
		k, v, _ := strings.Cut(kv, "=")
		view.Env[k] = v
	}
	for _, d := range spec.Linux.Devices {
		view.DeviceNodes = append(view.DeviceNodes, d.Path)
	}
	for _, m := range spec.Mounts {
		view.Mounts = append(view.Mounts, m.Source+":"+m.Destination)
	}
	sort.Strings(view.DeviceNodes)
	sort.Strings(view.Mounts)
	return view, nil
}
