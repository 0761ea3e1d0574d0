package telemetry

import (
	"github.com/prometheus/client_golang/prometheus"

	gpuapi "github.com/gpudra/gpudra/api/gpu/v1alpha1"
	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/prepared"
)

// ClaimsFunc returns a copy of the claims prepared on the node (the DRA
// plugin's PreparedClaims); it must not block on anything slower than a
// copy.
type ClaimsFunc func() []prepared.Claim

var (
	descClaimInfo = desc("device_claim_info", "1 for each claim prepared on a device (DRA mode): one series per claim, several on a shared device. Join it to a device series on gpu, dra_device_name and node.",
		heldLabels, labelClaimNS, labelClaimName, labelClaimUID)
	descFree = desc("device_free", "1 when no prepared claim holds the device (DRA mode), 0 when one does; a whole GPU is not free while a claim holds one of its MIG devices or shares.", heldLabels)
)

// SetClaims attributes the devices to the claims f returns, from the next
// scrape on (gpudra_device_claim_info, gpudra_device_free). Without it, as
// in device plugin mode, there are no such series.
func (c *Collector) SetClaims(f ClaimsFunc) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.claims = f
}

// mpsDevicesOf are the devices (the UUIDs containers see: a GPU's or a MIG
// device's) that the claims share with MPS: the only ones whose MPS client
// list a pass reads (nvdevice.TelemetryOptions.MPSDevices). Without the
// claims (device plugin mode) it is nil: every device's is read. A device
// held otherwise can have MPS clients only of an MPS server its holder
// started itself; that server is a compute process of the device, listed
// every pass, in the holder's own pod.
func mpsDevicesOf(claims ClaimsFunc) map[string]bool {
	if claims == nil {
		return nil
	}
	out := map[string]bool{}
	for _, c := range claims() {
		if c.Strategy() != gpuapi.MPS {
			continue
		}
		for _, d := range c.Devices {
			if d.UUID != "" {
				out[d.UUID] = true
			}
		}
	}
	return out
}

// holders are the claims on each device name, and the GPUs (UUIDs) that a
// claimed device is on.
type holders struct {
	byDevice map[string][]*prepared.Claim
	gpus     map[string]bool
}

// holdersOf indexes claims by device. Admin access is no use of a device:
// such a device is not attributed to the claim.
func holdersOf(claims []prepared.Claim) holders {
	h := holders{byDevice: map[string][]*prepared.Claim{}, gpus: map[string]bool{}}
	for i := range claims {
		c := &claims[i]
		for _, d := range c.Devices {
			if d.AdminAccess {
				continue
			}
			if l := h.byDevice[d.Device]; len(l) == 0 || l[len(l)-1] != c {
				h.byDevice[d.Device] = append(l, c) // two shares of one GPU in one claim: one series
			}
			if d.GPUUUID != "" {
				h.gpus[d.GPUUUID] = true
			}
		}
	}
	return h
}

// collectClaims sends the sample's device's claim info series and whether
// it is free.
func (c *Collector) collectClaims(ch chan<- prometheus.Metric, h holders, s *nvdevice.TelemetrySample) {
	d := heldDeviceOf(s)
	held := h.byDevice[d.Device]
	for _, cl := range held {
		ch <- prometheus.MustNewConstMetric(descClaimInfo, prometheus.GaugeValue, 1, d.values(c.node, cl.Namespace, cl.Name, cl.UID)...)
	}
	free := 1.0
	if len(held) > 0 || (!s.IsMIG() && h.gpus[s.UUID]) {
		free = 0
	}
	ch <- prometheus.MustNewConstMetric(descFree, prometheus.GaugeValue, free, d.values(c.node)...)
}
