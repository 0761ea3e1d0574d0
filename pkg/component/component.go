// Package component gives every gpudra daemon the conventions of a
// Kubernetes component, in one place: pflag flags that may mirror
// environment variables (parsed as strictly as the flag), logging through
// k8s.io/component-base (--logging-format=text|json, -v, --vmodule),
// feature gates (--feature-gates, pkg/features), --version, and one log
// line at start saying what runs. A main is then "flags, then Run":
//
//	c := component.New("gpudra-mps-server")
//	cfg := mpsserver.AddFlags(c.Flags)
//	c.Main(func(ctx context.Context) error { return mpsserver.Run(ctx, *cfg) })
//
// Nothing here registers global flags or touches klog before Execute:
// devcluster links the plugin into a process where a Kubernetes test
// package has registered klog's flags already.
package component

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"runtime"
	"sort"
	"syscall"

	"github.com/spf13/pflag"
	"k8s.io/component-base/featuregate"
	logsapi "k8s.io/component-base/logs/api/v1"
	"k8s.io/klog/v2"

	// The JSON log format (--logging-format=json).
	_ "k8s.io/component-base/logs/json/register"

	"github.com/gpudra/gpudra/internal/version"
	"github.com/gpudra/gpudra/pkg/features"
)

// Component is one binary's flags, logging and feature gates.
type Component struct {
	// Name is the binary's name, for usage, --version and logs.
	Name string
	// Flags are the binary's flags; the component's own are registered
	// by New, the binary adds its own before Execute.
	Flags *pflag.FlagSet
	// Logging is the logging configuration the flags fill in.
	Logging *logsapi.LoggingConfiguration
	// Features are gpudra's gates and component-base's logging gates,
	// set by --feature-gates.
	Features featuregate.MutableVersionedFeatureGate

	version bool
}

// New returns a component with its common flags registered: the logging
// flags, --feature-gates and --version.
func New(name string) *Component {
	c := &Component{
		Name:     name,
		Flags:    pflag.NewFlagSet(name, pflag.ContinueOnError),
		Logging:  logsapi.NewLoggingConfiguration(),
		Features: features.New(),
	}
	// ContextualLogging and the logging option gates, as Kubernetes
	// components have them.
	if err := logsapi.AddFeatureGates(c.Features); err != nil {
		panic(err)
	}
	logsapi.AddFlags(c.Logging, c.Flags)
	// AddFlag closes the gate for new features: it comes after every Add.
	c.Features.AddFlag(c.Flags)
	c.Flags.BoolVar(&c.version, "version", false, "print the version and commit, then exit")
	return c
}

// Parse parses the command line (without the program name), then sets every
// flag that is not on it from its environment variable (ApplyEnv). Extra
// arguments are an error: every input of a daemon is a named flag.
func (c *Component) Parse(args []string, lookupEnv func(string) (string, bool)) error {
	if err := c.Flags.Parse(args); err != nil {
		return err
	}
	if c.Flags.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q: every option is a --flag", c.Flags.Args())
	}
	return ApplyEnv(c.Flags, lookupEnv)
}

// IO is a component's outside world: its output streams and environment.
type IO struct {
	Stdout, Stderr io.Writer
	LookupEnv      func(string) (string, bool)
}

// Exit codes of Execute.
const (
	ExitOK      = 0
	ExitFailed  = 1 // run returned an error
	ExitBadArgs = 2 // the command line or the environment was refused
)

// Execute is a binary's main without os.Exit: it parses args and the
// environment, prints the version for --version, applies the logging
// configuration, logs what starts, and calls run with a context carrying
// the logger. An error from run is logged (in the chosen format) and gives
// ExitFailed. Logging is global (klog): Execute applies it once per process.
func (c *Component) Execute(ctx context.Context, args []string, io IO, run func(ctx context.Context) error) int {
	c.Flags.SetOutput(io.Stderr)
	if err := c.Parse(args, io.LookupEnv); err != nil {
		if errors.Is(err, pflag.ErrHelp) {
			return ExitOK
		}
		// Logging is not set up yet (its flags may be what is wrong).
		fmt.Fprintf(io.Stderr, "%s: %v\nRun '%s --help' for the flags.\n", c.Name, err, c.Name)
		return ExitBadArgs
	}
	if c.version {
		fmt.Fprintln(io.Stdout, version.String(c.Name))
		return ExitOK
	}
	opts := &logsapi.LoggingOptions{ErrorStream: io.Stderr, InfoStream: io.Stdout}
	if err := logsapi.ValidateAndApplyWithOptions(c.Logging, opts, c.Features); err != nil {
		fmt.Fprintf(io.Stderr, "%s: logging: %v\n", c.Name, err)
		return ExitBadArgs
	}
	defer klog.Flush()
	logger := klog.Background()
	ctx = klog.NewContext(ctx, logger)
	logger.Info("Starting "+c.Name, "version", version.Version, "commit", version.Commit,
		"goVersion", runtime.Version(), "featureGates", c.EnabledGates())
	if err := run(ctx); err != nil {
		logger.Error(err, c.Name+" failed")
		return ExitFailed
	}
	return ExitOK
}

// Main runs the binary: Execute over os.Args, the process's streams and
// environment, with a context that SIGINT and SIGTERM cancel, then exits
// with its code.
func (c *Component) Main(run func(ctx context.Context) error) {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := c.Execute(ctx, os.Args[1:], IO{Stdout: os.Stdout, Stderr: os.Stderr, LookupEnv: os.LookupEnv}, run)
	stop()
	os.Exit(code)
}

// LoggingArgs are the flags that make a helper process this component
// starts (an MPS server pod) log as the component does.
func (c *Component) LoggingArgs() []string {
	return []string{"--logging-format=" + c.Logging.Format, fmt.Sprintf("-v=%d", c.Logging.Verbosity)}
}

// EnabledGates are the names of the gates that are on, sorted: what the
// start line logs.
func (c *Component) EnabledGates() []string {
	var on []string
	for f := range c.Features.GetAll() {
		if c.Features.Enabled(f) {
			on = append(on, string(f))
		}
	}
	sort.Strings(on)
	return on
}
