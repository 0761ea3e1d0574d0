// Command gpudra-probe is the process of devcluster's real containers: it
// reports what the container sees of the GPUs as one JSON document (stdout
// and --report), then keeps running until it is stopped. Arguments after
// -- are a command to run first, its output in the report. Static
// (CGO_ENABLED=0): it needs no image, only itself.
package main

import (
	"context"
	"os"

	"github.com/gpudra/gpudra/pkg/component"
	"github.com/gpudra/gpudra/pkg/probe"
)

func main() {
	c := component.New("gpudra-probe")
	cfg := probe.Config{Out: os.Stdout}
	c.Flags.StringVar(&cfg.ReportFile, "report", "", "also write the report to this file")
	c.Flags.BoolVar(&cfg.Exit, "exit", false, "exit after the report instead of running until stopped")
	c.Main(func(ctx context.Context) error {
		cfg.Exec = c.Flags.Args()
		return probe.Run(ctx, cfg)
	})
}
