package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"os/user"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	"sigs.k8s.io/yaml"

	"github.com/gpudra/gpudra/pkg/local"
)

// localFlags are every gpudra local command's.
type localFlags struct {
	backend       backendFlags
	stateDir      string
	pluginDataDir string
}

func (f *localFlags) register(fs *pflag.FlagSet) {
	f.backend.register(fs)
	fs.StringVar(&f.stateDir, "state-dir", local.DefaultStateDir, "the machine's local state (its permissions and group decide who may allocate)")
	fs.StringVar(&f.pluginDataDir, "plugin-data-dir", local.DefaultPluginDataDir, "the kubelet plugin's state: where it exists, gpudra local refuses")
}

// open checks that no kubelet plugin owns the GPUs, then opens the state.
func (f *localFlags) open(ctx context.Context) (*local.Local, error) {
	if err := local.CheckNoPlugin(f.pluginDataDir); err != nil {
		return nil, err
	}
	backend, err := f.backend.open(ctx)
	if err != nil {
		return nil, err
	}
	inv, err := backend.Inventory(ctx)
	if err != nil {
		_ = backend.Close()
		return nil, err
	}
	// MIG devices a request asks for are created on GPUs in MIG mode (and
	// destroyed when it ends), through the backend, kept open for it.
	m, err := local.NewMachine(inv, f.backend.nodeName, true)
	if err != nil {
		_ = backend.Close()
		return nil, err
	}
	l, err := local.Open(local.Config{StateDir: f.stateDir, Machine: m, MIG: backend, Closer: backend.Close})
	if err != nil {
		_ = backend.Close()
	}
	return l, err
}

func currentUser() string {
	if u, err := user.Current(); err == nil {
		return u.Username
	}
	return fmt.Sprint(os.Getuid())
}

// requestFlags build a Request.
type requestFlags struct {
	gpus       int64
	mig        string
	sameNVLink bool
	memory     string
	share      string
	priority   int32
	duration   time.Duration
	name       string
	file       string
}

func (r *requestFlags) register(fs *pflag.FlagSet) {
	fs.Int64Var(&r.gpus, "gpus", 1, "how many whole GPUs")
	fs.StringVar(&r.mig, "mig", "", "a MIG device of this profile instead of whole GPUs: an existing one, or one created on a GPU in MIG mode and destroyed when the allocation ends")
	fs.BoolVar(&r.sameNVLink, "same-nvlink", false, "all GPUs in one NVLink domain")
	fs.StringVar(&r.memory, "memory", "", "GPUs (or MIG devices) with at least this much memory (80Gi)")
	fs.StringVar(&r.share, "share", "", "time-slicing: share the devices with other time-slicing requests (never with an exclusive one); mps is not supported locally yet")
	fs.Int32Var(&r.priority, "priority", 0, "priority under the Priority policy")
	fs.DurationVar(&r.duration, "duration", 0, "declared run time, for the ShortestJobFirst policy")
	fs.StringVar(&r.name, "name", "", "name of the allocation (default: <user>-<pid>)")
	fs.StringVar(&r.file, "request", "", "a file holding the devices part of a ResourceClaim spec (or a whole ResourceClaim or template): a claim written for the cluster, unchanged")
}

func (r *requestFlags) request(holder local.Holder) (local.Request, error) {
	req := local.Request{Name: r.name, User: currentUser(), Priority: r.priority, Holder: holder}
	if req.Name == "" {
		req.Name = fmt.Sprintf("%s-%d", req.User, os.Getpid())
	}
	if r.duration > 0 {
		d := r.duration
		req.Duration = &d
	}
	switch r.share {
	case "":
	case local.ShareTimeSlicing:
		req.Share = r.share
	case "mps":
		return req, errors.New("--share mps: not supported by gpudra local yet (it would need an MPS control daemon per GPU); use --share time-slicing, or a MIG device")
	default:
		return req, fmt.Errorf("--share %q: want time-slicing", r.share)
	}
	var err error
	if r.file != "" {
		data, rerr := os.ReadFile(r.file)
		if rerr != nil {
			return req, fmt.Errorf("--request: %w", rerr)
		}
		req.Devices, err = local.ParseDevices(data)
		if err != nil {
			return req, fmt.Errorf("--request %s: %w", r.file, err)
		}
		return req, nil
	}
	req.Devices, err = local.Devices(local.Ask{GPUs: r.gpus, MIGProfile: r.mig, SameNVLink: r.sameNVLink, Memory: r.memory})
	return req, err
}

func newLocalCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "local",
		Short: "Share this machine's GPUs without Kubernetes: allocate, run, queue (docs/local.md)",
	}
	cmd.AddCommand(newLocalRunCommand(), newLocalAllocateCommand(), newLocalReleaseCommand(), newLocalPsCommand(),
		newLocalDrainCommand(true), newLocalDrainCommand(false), newLocalReserveCommand(), newLocalPolicyCommand())
	return cmd
}

// exitCodeError makes gpudra exit with a child's exit code.
type exitCodeError struct{ code int }

func (e exitCodeError) Error() string { return fmt.Sprintf("exit status %d", e.code) }

func newLocalRunCommand() *cobra.Command {
	var f localFlags
	var r requestFlags
	cmd := &cobra.Command{
		Use:   "run [flags] -- CMD ARGS...",
		Short: "Wait for GPUs, run CMD with CUDA_VISIBLE_DEVICES set to them, release them when it exits",
		Args:  cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx := cmd.Context()
			l, err := f.open(ctx)
			if err != nil {
				return err
			}
			defer l.Close()
			holder, err := local.HolderOf("/proc", os.Getpid())
			if err != nil {
				return err
			}
			req, err := r.request(holder)
			if err != nil {
				return err
			}
			a, err := l.Acquire(ctx, req, func(pos int) {
				fmt.Fprintf(cmd.ErrOrStderr(), "gpudra local: %s waits, position %d in the queue\n", req.Name, pos)
			})
			if err != nil {
				return err
			}
			defer func() { _ = l.Release(context.WithoutCancel(ctx), a.Name, a.User) }()
			return runChild(ctx, cmd, a, args)
		},
	}
	f.register(cmd.Flags())
	r.register(cmd.Flags())
	return cmd
}

// runChild runs the command with the allocation's environment, passing
// signals on, and returns its exit code as an exitCodeError.
func runChild(ctx context.Context, cmd *cobra.Command, a local.Allocation, args []string) error {
	child := exec.Command(args[0], args[1:]...) //nolint:gosec // the user's own command
	child.Env = append(os.Environ(), local.Env(a)...)
	child.Stdin, child.Stdout, child.Stderr = os.Stdin, cmd.OutOrStdout(), cmd.ErrOrStderr()
	// Signals go to the child; this process waits for it and releases.
	signals := make(chan os.Signal, 4)
	signal.Notify(signals, syscall.SIGINT, syscall.SIGTERM, syscall.SIGHUP, syscall.SIGQUIT, syscall.SIGUSR1, syscall.SIGUSR2)
	defer signal.Stop(signals)
	if err := child.Start(); err != nil {
		return fmt.Errorf("start %s: %w", args[0], err)
	}
	done := make(chan error, 1)
	go func() { done <- child.Wait() }()
	for {
		select {
		case s := <-signals:
			_ = child.Process.Signal(s)
		case <-ctx.Done():
			// main's context ends on SIGINT/SIGTERM too: already passed on.
			ctx = context.Background()
		case err := <-done:
			var exit *exec.ExitError
			if errors.As(err, &exit) {
				code := exit.ExitCode()
				if code < 0 {
					code = 128 + int(exit.Sys().(syscall.WaitStatus).Signal())
				}
				return exitCodeError{code: code}
			}
			return err
		}
	}
}

func newLocalAllocateCommand() *cobra.Command {
	var f localFlags
	var r requestFlags
	var output string
	var pid int
	cmd := &cobra.Command{
		Use:   "allocate",
		Short: "Wait for GPUs and hold them until released (for a service, or a planner that runs its own processes)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := checkOutput(output, "table", "json", "yaml"); err != nil {
				return err
			}
			ctx := cmd.Context()
			l, err := f.open(ctx)
			if err != nil {
				return err
			}
			defer l.Close()
			var holder local.Holder
			if pid != 0 {
				if holder, err = local.HolderOf("/proc", pid); err != nil {
					return fmt.Errorf("--pid: %w", err)
				}
			}
			req, err := r.request(holder)
			if err != nil {
				return err
			}
			a, err := l.Acquire(ctx, req, func(pos int) {
				fmt.Fprintf(cmd.ErrOrStderr(), "gpudra local: %s waits, position %d in the queue\n", req.Name, pos)
			})
			if err != nil {
				return err
			}
			return printAllocation(cmd.OutOrStdout(), a, output)
		},
	}
	f.register(cmd.Flags())
	r.register(cmd.Flags())
	cmd.Flags().IntVar(&pid, "pid", 0, "the process that holds the allocation: freed when it is gone (default: held until released)")
	cmd.Flags().StringVarP(&output, "output", "o", "table", "output format: table, json or yaml")
	return cmd
}

func newLocalReserveCommand() *cobra.Command {
	var f localFlags
	var r requestFlags
	var output string
	var hold time.Duration
	cmd := &cobra.Command{
		Use:   "reserve --gpus N --for DURATION",
		Short: "Hold GPUs for a planned start; released when the time is up",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if hold <= 0 {
				return errors.New("--for: a duration above zero is required (2h)")
			}
			ctx := cmd.Context()
			l, err := f.open(ctx)
			if err != nil {
				return err
			}
			defer l.Close()
			req, err := r.request(local.Holder{})
			if err != nil {
				return err
			}
			req.ReserveFor = &hold
			a, err := l.Acquire(ctx, req, nil)
			if err != nil {
				return err
			}
			return printAllocation(cmd.OutOrStdout(), a, output)
		},
	}
	f.register(cmd.Flags())
	r.register(cmd.Flags())
	cmd.Flags().DurationVar(&hold, "for", 0, "how long to hold the GPUs")
	cmd.Flags().StringVarP(&output, "output", "o", "table", "output format: table, json or yaml")
	return cmd
}

func newLocalReleaseCommand() *cobra.Command {
	var f localFlags
	return withLocalFlags(&f, &cobra.Command{
		Use:   "release NAME",
		Short: "Release your allocation (or withdraw your waiting request)",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			l, err := f.open(cmd.Context())
			if err != nil {
				return err
			}
			defer l.Close()
			return l.Release(cmd.Context(), args[0], currentUser())
		},
	})
}

func newLocalDrainCommand(on bool) *cobra.Command {
	var f localFlags
	use, short := "drain GPU-UUID", "Stop new allocations on a GPU; holders keep theirs"
	if !on {
		use, short = "undrain GPU-UUID", "Allow new allocations on a drained GPU again"
	}
	return withLocalFlags(&f, &cobra.Command{
		Use: use, Short: short, Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			l, err := f.open(cmd.Context())
			if err != nil {
				return err
			}
			defer l.Close()
			return l.Drain(cmd.Context(), args[0], on)
		},
	})
}

func newLocalPolicyCommand() *cobra.Command {
	var f localFlags
	return withLocalFlags(&f, &cobra.Command{
		Use:   "policy " + strings.Join(local.Policies, "|"),
		Short: "Set the order in which waiting requests are served",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			l, err := f.open(cmd.Context())
			if err != nil {
				return err
			}
			defer l.Close()
			return l.SetPolicy(cmd.Context(), args[0])
		},
	})
}

func withLocalFlags(f *localFlags, cmd *cobra.Command) *cobra.Command {
	f.register(cmd.Flags())
	return cmd
}

func newLocalPsCommand() *cobra.Command {
	var f localFlags
	var output string
	var watch time.Duration
	cmd := &cobra.Command{
		Use:   "ps",
		Short: "Holders and waiters: devices, age, queue position",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := checkOutput(output, "table", "json", "yaml"); err != nil {
				return err
			}
			l, err := f.open(cmd.Context())
			if err != nil {
				return err
			}
			defer l.Close()
			for {
				s, err := l.State(cmd.Context())
				if err != nil {
					return err
				}
				if err := printPs(cmd.OutOrStdout(), local.Ps(s, l.Order(s), time.Now(), l.Capacity()), output); err != nil {
					return err
				}
				if watch <= 0 {
					return nil
				}
				select {
				case <-cmd.Context().Done():
					return nil
				case <-time.After(watch):
				}
			}
		},
	}
	f.register(cmd.Flags())
	cmd.Flags().StringVarP(&output, "output", "o", "table", "output format: table, json or yaml")
	cmd.Flags().DurationVar(&watch, "watch", 0, "print again at this interval")
	return cmd
}

func printAllocation(w io.Writer, a local.Allocation, output string) error {
	return printPs(w, local.Ps(&local.State{Allocations: []local.Allocation{a}}, nil, time.Now(), 0), output)
}

func printPs(w io.Writer, rows []local.PsRow, output string) error {
	switch output {
	case "json":
		b, err := json.MarshalIndent(rows, "", "  ")
		if err != nil {
			return err
		}
		_, err = fmt.Fprintln(w, string(b))
		return err
	case "yaml":
		b, err := yaml.Marshal(rows)
		if err != nil {
			return err
		}
		_, err = w.Write(b)
		return err
	}
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "NAME\tUSER\tSTATE\tDEVICES\tAGE\tPID\tESTIMATED START")
	for _, r := range rows {
		state := r.State
		if r.Position > 0 {
			state = fmt.Sprintf("waiting (%d)", r.Position)
		}
		devices := strings.Join(r.UUIDs, ",")
		if devices == "" {
			devices = r.Asks
		}
		pid := "-"
		if r.PID != 0 {
			pid = fmt.Sprint(r.PID)
		}
		start := "-"
		switch {
		case r.EstimatedStart != nil:
			start = r.EstimatedStart.Local().Format(time.DateTime)
		case r.State == "Waiting":
			start = "unknown"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\n", r.Name, r.User, state, devices, r.Age, pid, start)
	}
	return tw.Flush()
}
