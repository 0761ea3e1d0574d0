// Command gpudra inspects a GPU node: what it has (inventory) and the
// ResourceSlices the kubelet plugin would publish for it (slices).
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := newRootCommand().ExecuteContext(ctx); err != nil {
		fmt.Fprintln(os.Stderr, "gpudra:", err)
		os.Exit(1)
	}
}
