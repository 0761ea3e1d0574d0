// Command gpudra-probe is the process of devcluster's real containers: it
// reports what the container sees of the GPUs as one JSON document (stdout
// and --report), then keeps running until it is stopped. Arguments after
// -- are a command to run first, its output in the report. Static
// (CGO_ENABLED=0): it needs no image, only itself.
package main

import (
	"context"
	"os"
	"os/signal"
	"slices"
	"syscall"

	"github.com/gpudra/gpudra/pkg/component"
	"github.com/gpudra/gpudra/pkg/probe"
)

func main() {
	c := component.New("gpudra-probe")
	cfg := probe.Config{Out: os.Stdout}
	c.Flags.StringVar(&cfg.ReportFile, "report", "", "also write the report to this file")
	c.Flags.BoolVar(&cfg.Exit, "exit", false, "exit after the report instead of running until stopped")
	// The command after -- is the probe's to run, not arguments of its
	// own (which component refuses: every option of a daemon is a flag).
	args := os.Args[1:]
	if i := slices.Index(args, "--"); i >= 0 {
		args, cfg.Exec = args[:i], args[i+1:]
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := c.Execute(ctx, args, component.IO{Stdout: os.Stdout, Stderr: os.Stderr, LookupEnv: os.LookupEnv},
		func(ctx context.Context) error { return probe.Run(ctx, cfg) })
	stop()
	os.Exit(code)
}
