package telemetry

import (
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/prometheus/common/expfmt"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	gpuapi "github.com/gpudra/gpudra/api/gpu/v1alpha1"
	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/prepared"
)

// otherGPU is a second whole GPU, gpu-4.
var otherGPU = nvdevice.TelemetrySample{UUID: "GPU-c", Minor: 4, ProductName: "NVIDIA H100 80GB HBM3", PowerLimitWatts: nvdevice.Read(700)}

func TestClaimAttribution(t *testing.T) {
	mig := DeviceName(&migSample) // gpu-3-mig-1g-10gb-me-6
	whole := func(uid, name, device, gpu string) prepared.Claim {
		return prepared.Claim{UID: uid, Namespace: "ns", Name: name, State: prepared.PrepareCompleted,
			Devices: []prepared.Device{{Pool: "n1", Device: device, UUID: gpu, GPUUUID: gpu}}}
	}
	// The DRA names of the device, as dcgm-exporter labels them.
	dra := func(device string) string {
		migL := `dra_mig_device_uuid="",dra_mig_profile=""`
		if device == mig {
			migL = `dra_mig_device_uuid="MIG-b",dra_mig_profile="1g.10gb+me"`
		}
		return `dra_device_name="` + device + `",dra_driver_name="gpu.gpudra.dev",` + migL + `,dra_pool_name="n1"`
	}
	info := func(gpu, device, name, uid string) string {
		return `gpudra_device_claim_info{claim_uid="` + uid + `",dra_claim_name="` + name + `",dra_claim_namespace="ns",` + dra(device) + `,gpu="` + gpu + `",node="n1"} 1`
	}
	free := func(gpu, device, v string) string {
		return `gpudra_device_free{` + dra(device) + `,gpu="` + gpu + `",node="n1"} ` + v
	}
	shared := whole("u2", "b", "gpu-4", "GPU-c")
	shared.Devices = append(shared.Devices, shared.Devices[0]) // two shares of gpu-4 in one claim
	admin := whole("u3", "monitor", "gpu-3", "GPU-a")
	admin.Devices[0].AdminAccess = true
	for _, tc := range []struct {
		name     string
		claims   []prepared.Claim
		noClaims bool // SetClaims never called (device plugin mode)
		info     []string
		free     []string // gpu-3, its MIG device, gpu-4
	}{
		{name: "a claimed whole GPU", claims: []prepared.Claim{whole("u1", "a", "gpu-3", "GPU-a")},
			info: []string{info("GPU-a", "gpu-3", "a", "u1")},
			free: []string{free("GPU-a", "gpu-3", "0"), free("GPU-a", mig, "1"), free("GPU-c", "gpu-4", "1")}},
		{name: "no claim: every device free",
			free: []string{free("GPU-a", "gpu-3", "1"), free("GPU-a", mig, "1"), free("GPU-c", "gpu-4", "1")}},
		{name: "a claimed MIG device, its GPU not free",
			claims: []prepared.Claim{{UID: "u1", Namespace: "ns", Name: "a", State: prepared.PrepareCompleted,
				Devices: []prepared.Device{{Pool: "n1", Device: mig, UUID: "MIG-b", GPUUUID: "GPU-a", Mig: true}}}},
			info: []string{info("GPU-a", mig, "a", "u1")},
			free: []string{free("GPU-a", "gpu-3", "0"), free("GPU-a", mig, "0"), free("GPU-c", "gpu-4", "1")}},
		{name: "a shared GPU: one series per claim", claims: []prepared.Claim{whole("u1", "a", "gpu-4", "GPU-c"), shared},
			info: []string{info("GPU-c", "gpu-4", "a", "u1"), info("GPU-c", "gpu-4", "b", "u2")},
			free: []string{free("GPU-a", "gpu-3", "1"), free("GPU-a", mig, "1"), free("GPU-c", "gpu-4", "0")}},
		{name: "admin access is no use", claims: []prepared.Claim{admin},
			free: []string{free("GPU-a", "gpu-3", "1"), free("GPU-a", mig, "1"), free("GPU-c", "gpu-4", "1")}},
		{name: "device plugin mode: no attribution", noClaims: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := sampled(&fakeReader{samples: []nvdevice.TelemetrySample{gpuSample, migSample, otherGPU}}, "n1")
			if !tc.noClaims {
				c.SetClaims(func() []prepared.Claim { return tc.claims })
			}
			series := func(metric string, want []string) {
				t.Helper()
				got, err := testutil.CollectAndFormat(c, expfmt.TypeTextPlain, metric)
				require.NoError(t, err, "no duplicate series")
				var lines []string
				for _, l := range strings.Split(string(got), "\n") {
					if l != "" && !strings.HasPrefix(l, "#") {
						lines = append(lines, l)
					}
				}
				assert.ElementsMatch(t, want, lines, metric)
			}
			series("gpudra_device_claim_info", tc.info)
			series("gpudra_device_free", tc.free)
			problems, err := testutil.CollectAndLint(c)
			require.NoError(t, err)
			assert.Empty(t, problems)
		})
	}
}

func TestClaimsReadPerScrape(t *testing.T) {
	c := sampled(&fakeReader{samples: []nvdevice.TelemetrySample{gpuSample}}, "n1")
	var claims []prepared.Claim
	calls := 0
	c.SetClaims(func() []prepared.Claim { calls++; return claims })
	count := func() int { return testutil.CollectAndCount(c, "gpudra_device_claim_info") }
	assert.Equal(t, 0, count())
	claims = []prepared.Claim{{UID: "u1", Namespace: "ns", Name: "a", Devices: []prepared.Device{{Device: "gpu-3"}}}}
	assert.Equal(t, 1, count(), "a claim prepared since the sample shows at the next scrape")
	assert.Equal(t, 2, calls, "one read of the claims per scrape")

	empty := NewCollector(&fakeReader{}, "n1", 0)
	empty.SetClaims(func() []prepared.Claim { t.Fatal("claims read without a sample"); return nil })
	assert.Equal(t, 1, testutil.CollectAndCount(empty), "telemetry_up only before the first sample")
}

// TestMPSDevicesOf: the devices whose MPS client list a pass reads are
// those of the claims shared with MPS, by the UUID containers see (a
// GPU's or a MIG device's); without claims (device plugin mode) every
// device's (nil); with claims but none shared with MPS, none.
func TestMPSDevicesOf(t *testing.T) {
	claim := func(strategy gpuapi.SharingStrategy, devices ...prepared.Device) prepared.Claim {
		c := prepared.Claim{UID: "u", Namespace: "ns", Name: "c", State: prepared.PrepareCompleted, Devices: devices}
		if strategy != "" {
			c.Sharing = &gpuapi.Sharing{Strategy: strategy}
		}
		return c
	}
	gpu := prepared.Device{Pool: "n1", Device: "gpu-0", UUID: "GPU-a", GPUUUID: "GPU-a"}
	mig := prepared.Device{Pool: "n1", Device: "gpu-1-mig-1g-18gb-0", UUID: "MIG-b", GPUUUID: "GPU-c", Mig: true}
	noUUID := prepared.Device{Pool: "n1", Device: "gpu-2"}
	for _, tc := range []struct {
		name   string
		claims ClaimsFunc
		want   map[string]bool
	}{
		{name: "no claims func (device plugin mode): every device's", claims: nil, want: nil},
		{name: "no claims: none", claims: func() []prepared.Claim { return nil }, want: map[string]bool{}},
		{name: "an MPS claim on a GPU and a MIG device", claims: func() []prepared.Claim {
			return []prepared.Claim{claim(gpuapi.MPS, gpu, mig)}
		}, want: map[string]bool{"GPU-a": true, "MIG-b": true}},
		{name: "time-slicing and exclusive claims: none", claims: func() []prepared.Claim {
			return []prepared.Claim{claim(gpuapi.TimeSlicing, gpu), claim("", mig)}
		}, want: map[string]bool{}},
		{name: "a device without a UUID is left out", claims: func() []prepared.Claim {
			return []prepared.Claim{claim(gpuapi.MPS, noUUID, gpu)}
		}, want: map[string]bool{"GPU-a": true}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := mpsDevicesOf(tc.claims)
			assert.Equal(t, tc.want, got)
			assert.Equal(t, tc.want == nil, got == nil, "nil (every device) is not empty (none)")
		})
	}
}
