// Command gpudra-mps-server is the main process of an MPS server pod: it
// runs one nvidia-cuda-mps-control daemon for a GPU (or a claim's devices),
// independent of the kubelet plugin's container. The kubelet plugin creates
// these pods; nobody runs this by hand.
package main

import (
	"context"

	"github.com/gpudra/gpudra/pkg/component"
	"github.com/gpudra/gpudra/pkg/mpsserver"
)

func main() {
	c := component.New("gpudra-mps-server")
	cfg := mpsserver.AddFlags(c.Flags)
	c.Main(func(ctx context.Context) error { return mpsserver.Run(ctx, *cfg) })
}
