// Command gpudra-mps-server is the main process of an MPS server pod: it
// runs one nvidia-cuda-mps-control daemon for a GPU (or a claim's devices),
// independent of the kubelet plugin's container. The kubelet plugin creates
// these pods; nobody runs this by hand.
package main

import (
	"context"
	"flag"
	"os"
	"os/signal"
	"syscall"

	"k8s.io/klog/v2"

	"github.com/gpudra/gpudra/pkg/mpsserver"
)

func main() {
	klog.InitFlags(nil)
	cfg := mpsserver.AddFlags(flag.CommandLine)
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := mpsserver.Run(ctx, *cfg); err != nil {
		klog.FromContext(ctx).Error(err, "gpudra-mps-server failed")
		klog.Flush()
		os.Exit(1)
	}
}
