package plugin

import (
	"context"
	"sort"
	"testing"
	"time"

	drapb "k8s.io/kubelet/pkg/apis/dra/v1"
)

// benchPrepare measures NodePrepareResources + NodeUnprepareResources of one
// claim through the DRA socket, as the kubelet calls them, and reports the
// p50 and p99 of the round trip. Metrics are on, as in the plugin binary, so
// that their cost shows.
func benchPrepare(b *testing.B, device string) {
	e := newEnv(b)
	c := claim("bench", []string{device})
	kubelet, _, _ := startPluginWithMetrics(b, e, NewMetrics(), c)
	req := []*drapb.Claim{{Namespace: c.Namespace, Name: c.Name, Uid: string(c.UID)}}
	ctx := context.Background()
	var prep, unprep []time.Duration
	b.ResetTimer()
	for b.Loop() {
		start := time.Now()
		resp, err := kubelet.dra.NodePrepareResources(ctx, &drapb.NodePrepareResourcesRequest{Claims: req})
		if err != nil || resp.Claims["bench"].Error != "" {
			b.Fatalf("prepare: %v %v", err, resp)
		}
		mid := time.Now()
		un, err := kubelet.dra.NodeUnprepareResources(ctx, &drapb.NodeUnprepareResourcesRequest{Claims: req})
		if err != nil || un.Claims["bench"].Error != "" {
			b.Fatalf("unprepare: %v %v", err, un)
		}
		prep, unprep = append(prep, mid.Sub(start)), append(unprep, time.Since(mid))
	}
	report := func(lat []time.Duration, name string) {
		sort.Slice(lat, func(i, j int) bool { return lat[i] < lat[j] })
		pct := func(p float64) float64 { return float64(lat[int(p*float64(len(lat)-1))].Microseconds()) / 1000 }
		b.ReportMetric(pct(0.50), name+"-p50-ms")
		b.ReportMetric(pct(0.99), name+"-p99-ms")
	}
	report(prep, "prepare")
	report(unprep, "unprepare")
}

func BenchmarkPrepareUnprepareFullGPU(b *testing.B) { benchPrepare(b, "gpu-3") }

func BenchmarkPrepareUnprepareNewMig(b *testing.B) { benchPrepare(b, "gpu-0-mig-3g-40gb-4") }
