//go:build cgo && linux

package nvml

import (
	"context"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"k8s.io/klog/v2"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

// readLinks reads the GPU's NVLink links: state, and for active links the PCI
// bus id and kind of the device at the far end (an NVSwitch on HGX H100,
// another GPU on NVLink-bridged PCIe cards). A GPU without NVLink answers
// NOT_SUPPORTED and has no links; links past the GPU's count answer
// INVALID_ARGUMENT.
func (b *Backend) readLinks(dev nvml.Device, g *nvdevice.GPU) ([]nvdevice.NVLinkLink, error) {
	var links []nvdevice.NVLinkLink
	for l := range nvml.NVLINK_MAX_LINKS {
		state, ret := dev.GetNvLinkState(l)
		if absent(ret, "nvmlDeviceGetNvLinkState") || ret == nvml.ERROR_INVALID_ARGUMENT {
			continue
		}
		if ret == nvml.ERROR_GPU_IS_LOST {
			return nil, check(ret, "read NVLink %d of GPU %d (%s)", l, g.Index, g.UUID)
		}
		if ret != nvml.SUCCESS {
			continue // one unreadable link does not make the others unknown
		}
		link := nvdevice.NVLinkLink{Index: l, Active: state == nvml.FEATURE_ENABLED}
		if link.Active {
			link.RemoteKind = nvdevice.RemoteUnknown
			if pci, ret := dev.GetNvLinkRemotePciInfo(l); ret == nvml.SUCCESS {
				link.RemoteBusID = normalizeBusID(pci.BusId[:])
			}
			if b.hasSymbol("nvmlDeviceGetNvLinkRemoteDeviceType") {
				if t, ret := dev.GetNvLinkRemoteDeviceType(l); ret == nvml.SUCCESS {
					link.RemoteKind = remoteKind(t)
				}
			}
		}
		links = append(links, link)
	}
	return links, nil
}

func remoteKind(t nvml.IntNvLinkDeviceType) nvdevice.RemoteKind {
	switch t {
	case nvml.NVLINK_DEVICE_TYPE_GPU:
		return nvdevice.RemoteGPU
	case nvml.NVLINK_DEVICE_TYPE_SWITCH:
		return nvdevice.RemoteNVSwitch
	}
	return nvdevice.RemoteUnknown
}

// readFabric reads the GPU's multi-node NVLink fabric membership. It is nil
// when the driver predates the call (it came after the first Hopper
// drivers, and calling a missing symbol kills the process), when the GPU has
// no fabric (NOT_SUPPORTED), or while the fabric manager has not finished
// registering the GPU. A zero cluster UUID (HGX H100) is passed on: the model
// reads it as "no multi-node fabric".
func (b *Backend) readFabric(ctx context.Context, dev nvml.Device, g *nvdevice.GPU) (*nvdevice.FabricInfo, error) {
	if !b.hasSymbol("nvmlDeviceGetGpuFabricInfo") {
		return nil, nil
	}
	fi, ret := dev.GetGpuFabricInfo()
	switch {
	case ret == nvml.SUCCESS:
	case absent(ret, "nvmlDeviceGetGpuFabricInfo"):
		return nil, nil
	case ret == nvml.ERROR_GPU_IS_LOST:
		return nil, check(ret, "read fabric info of GPU %d (%s)", g.Index, g.UUID)
	default:
		klog.FromContext(ctx).Error(check(ret, "read fabric info"), "NVLink fabric membership unknown", "index", g.Index, "uuid", g.UUID)
		return nil, nil
	}
	if fi.State != nvml.GPU_FABRIC_STATE_COMPLETED || nvml.Return(fi.Status) != nvml.SUCCESS {
		klog.FromContext(ctx).V(2).Info("GPU is not (yet) registered with the NVLink fabric", "index", g.Index, "uuid", g.UUID,
			"state", fi.State, "status", nvml.Return(fi.Status).Error())
		return nil, nil
	}
	return &nvdevice.FabricInfo{ClusterUUID: fi.ClusterUuid, CliqueID: fi.CliqueId}, nil
}
