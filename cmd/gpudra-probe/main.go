// Command gpudra-probe is the process of devcluster's real containers: it
// reports what the container sees of the GPUs as one JSON document (stdout
// and --report), then keeps running until it is stopped, or exits (--exit,
// --exit-after) as a job's container does. Arguments after -- are a command
// to run first, its output in the report. Static (CGO_ENABLED=0): it needs
// no image, only itself.
package main

import (
	"context"
	"fmt"
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
	var exitCodeFile string
	c.Flags.StringVar(&cfg.ReportFile, "report", "", "also write the report to this file")
	c.Flags.BoolVar(&cfg.Exit, "exit", false, "exit after the report instead of running until stopped")
	c.Flags.DurationVar(&cfg.ExitAfter, "exit-after", 0, "exit this long after the report (a job's container that completes); 0: run until stopped, unless --exit")
	c.Flags.StringVar(&exitCodeFile, "exit-code-file", "", "write the exit code here before exiting: devcluster's kubelet reads it, as a runtime reports a container's exit code")
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
	if exitCodeFile != "" {
		// Written to a temporary name and renamed: a reader sees a whole
		// code or none.
		tmp := exitCodeFile + ".tmp"
		if err := os.WriteFile(tmp, []byte(fmt.Sprint(code)), 0o644); err == nil {
			_ = os.Rename(tmp, exitCodeFile)
		}
	}
	os.Exit(code)
}
