package nodehold

import (
	"context"
	"fmt"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"
	metadatafake "k8s.io/client-go/metadata/fake"
	"k8s.io/client-go/tools/cache"
)

// BenchmarkRound1000Nodes10kClaims: a settled round (every node already
// as it should be: no write) over 1,000 nodes and 10,000 claims of 8 GPUs
// each on the first 500 nodes (claims as the informer keeps them, slimmed).
func BenchmarkRound1000Nodes10kClaims(b *testing.B) {
	nh, err := New(Options{Client: fake.NewClientset(), Metadata: metadatafake.NewSimpleMetadataClient(metadatafake.NewTestScheme())})
	if err != nil {
		b.Fatal(err)
	}
	nh.claims, nh.nodes = cache.NewStore(cache.MetaNamespaceKeyFunc), cache.NewStore(cache.MetaNamespaceKeyFunc)
	for i := range 10000 {
		node := fmt.Sprintf("n%d", i%500)
		var results [][3]string
		for d := range 8 {
			results = append(results, gpu(node, fmt.Sprintf("gpu-%d", d)))
		}
		cl, _ := slimClaim(claim("team", fmt.Sprintf("c%d", i), results...))
		if err := nh.claims.Add(cl); err != nil {
			b.Fatal(err)
		}
	}
	for i := range 1000 {
		name := fmt.Sprintf("n%d", i)
		n := &metav1.PartialObjectMetadata{ObjectMeta: metav1.ObjectMeta{Name: name}}
		if err := nh.nodes.Add(n); err != nil {
			b.Fatal(err)
		}
	}
	// Mark the nodes as a first round would, without the API.
	claims := listClaims(nh.claims)
	for name, h := range NodesHeld(claims, nil) {
		obj, _, _ := nh.nodes.GetByKey(name)
		n := obj.(*metav1.PartialObjectMetadata)
		n.Annotations = apply(nil, Marks(nil, h))
	}
	ctx := context.Background()
	b.ResetTimer()
	for b.Loop() {
		nh.Round(ctx)
	}
	b.StopTimer()
	if got := testutil.ToFloat64(nh.metrics.writes.WithLabelValues(opMark, "success")); got != 0 {
		b.Fatalf("a settled round wrote %v times", got)
	}
	if got := testutil.ToFloat64(nh.metrics.held); got != 500 {
		b.Fatalf("%v nodes held, want 500", got)
	}
}
