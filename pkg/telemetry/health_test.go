package telemetry

import (
	"context"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/nvdevice/sim"
)

func TestInjectedXIDs(t *testing.T) {
	for _, tc := range []struct {
		name        string
		xids        []uint64
		ignored     []uint64 // nil: the default policy
		wantCounts  string   // the GPU's gpudra_gpu_xid_errors_total series
		wantHealthy string
	}{
		{"an application XID counts and leaves the GPU healthy", []uint64{13, 13},
			nil, `xid="13"} 2`, "1"},
		{"a critical XID counts and makes the GPU unhealthy", []uint64{95},
			nil, `xid="95"} 1`, "0"},
		{"both, counted by code", []uint64{13, 48, 13},
			nil, `xid="13"} 2` + "\n" + `xid="48"} 1`, "0"},
		{"an XID the policy ignores does not make it unhealthy", []uint64{95},
			[]uint64{95}, `xid="95"} 1`, "1"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m, err := sim.NewBuiltin("dgx-h100", "n1")
			require.NoError(t, err)
			defer m.Close()
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			inv, err := m.Inventory(ctx)
			require.NoError(t, err)
			h := NewHealthMetrics("n1", inv.GPUs)
			policy := nvdevice.NewXIDPolicy(nil)
			if tc.ignored != nil {
				policy = nvdevice.NewXIDPolicy(tc.ignored)
			}
			require.NoError(t, FollowHealth(ctx, m, h, policy))
			g := inv.GPUs[2]
			for _, xid := range tc.xids {
				require.NoError(t, m.InjectXID(g.UUID, "", xid))
			}
			labels := `{dra_device_name="gpu-2",dra_driver_name="gpu.gpudra.dev",dra_pool_name="n1",gpu="` + g.UUID + `",model="` + g.ProductName + `",node="n1"`
			var want []string
			for _, l := range splitLines(tc.wantCounts) {
				want = append(want, `gpudra_gpu_xid_errors_total`+labels+`,`+l)
			}
			require.Eventually(t, func() bool {
				return series(t, h, "gpudra_gpu_xid_errors_total") == joinLines(want)
			}, 5*time.Second, 5*time.Millisecond, "want %v, have %s", want, series(t, h, "gpudra_gpu_xid_errors_total"))
			healthy := series(t, h, "gpudra_gpu_healthy")
			assert.Contains(t, healthy, `gpudra_gpu_healthy`+labels+`} `+tc.wantHealthy)
			assert.Equal(t, len(inv.GPUs), testutil.CollectAndCount(h, "gpudra_gpu_healthy"), "one series per GPU")
			wantHealthy := len(inv.GPUs)
			if tc.wantHealthy == "0" {
				wantHealthy--
			}
			assert.Equal(t, wantHealthy, countLines(healthy, "} 1"), "the other GPUs stay healthy")
		})
	}
}

func TestSetUnhealthy(t *testing.T) {
	gpus := []nvdevice.GPU{{UUID: "GPU-a", Minor: 0, ProductName: "H"}, {UUID: "GPU-b", Minor: 1, ProductName: "H"}}
	for _, tc := range []struct {
		name      string
		unhealthy [][]string // successive calls
		want      string
	}{
		{"none", nil, `gpudra_gpu_healthy{dra_device_name="gpu-0",dra_driver_name="gpu.gpudra.dev",dra_pool_name="n1",gpu="GPU-a",model="H",node="n1"} 1` + "\n" +
			`gpudra_gpu_healthy{dra_device_name="gpu-1",dra_driver_name="gpu.gpudra.dev",dra_pool_name="n1",gpu="GPU-b",model="H",node="n1"} 1`},
		{"one", [][]string{{"GPU-b"}}, `gpudra_gpu_healthy{dra_device_name="gpu-0",dra_driver_name="gpu.gpudra.dev",dra_pool_name="n1",gpu="GPU-a",model="H",node="n1"} 1` + "\n" +
			`gpudra_gpu_healthy{dra_device_name="gpu-1",dra_driver_name="gpu.gpudra.dev",dra_pool_name="n1",gpu="GPU-b",model="H",node="n1"} 0`},
		{"recovered", [][]string{{"GPU-a", "GPU-b"}, {"GPU-a"}}, `gpudra_gpu_healthy{dra_device_name="gpu-0",dra_driver_name="gpu.gpudra.dev",dra_pool_name="n1",gpu="GPU-a",model="H",node="n1"} 0` + "\n" +
			`gpudra_gpu_healthy{dra_device_name="gpu-1",dra_driver_name="gpu.gpudra.dev",dra_pool_name="n1",gpu="GPU-b",model="H",node="n1"} 1`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := NewHealthMetrics("n1", gpus)
			for _, u := range tc.unhealthy {
				h.SetUnhealthy(u)
			}
			assert.Equal(t, tc.want, series(t, h, "gpudra_gpu_healthy"))
		})
	}
}

func TestHealthMetricsPassLint(t *testing.T) {
	h := NewHealthMetrics("n1", []nvdevice.GPU{{UUID: "GPU-a", ProductName: "H"}})
	h.XID("GPU-a", 79)
	problems, err := testutil.CollectAndLint(h)
	require.NoError(t, err)
	assert.Empty(t, problems)
}
