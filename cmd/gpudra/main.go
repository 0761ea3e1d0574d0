// Command gpudra inspects a GPU node: what it has (inventory) and the
// ResourceSlices the kubelet plugin would publish for it (slices).
package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"syscall"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := newRootCommand().ExecuteContext(ctx); err != nil {
		// gpudra local run exits as its command did.
		var code exitCodeError
		if errors.As(err, &code) {
			stop()
			os.Exit(code.code)
		}
		fmt.Fprintln(os.Stderr, "gpudra:", err)
		os.Exit(1)
	}
}
