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
	"path/filepath"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	"k8s.io/apimachinery/pkg/api/resource"
	"sigs.k8s.io/yaml"

	"github.com/gpudra/gpudra/pkg/drivertools"
	"github.com/gpudra/gpudra/pkg/local"
	"github.com/gpudra/gpudra/pkg/sharing"
)

// localFlags are every gpudra local command's.
type localFlags struct {
	backend       backendFlags
	stateDir      string
	pluginDataDir string
	mpsControl    string
}

func (f *localFlags) register(fs *pflag.FlagSet) {
	f.backend.register(fs)
	fs.StringVar(&f.stateDir, "state-dir", local.DefaultStateDir, "the machine's local state (its permissions and group decide who may allocate; each user's allocations are in a directory only they can write)")
	fs.StringVar(&f.pluginDataDir, "plugin-data-dir", local.DefaultPluginDataDir, "the kubelet plugin's state: where it exists, gpudra local refuses")
	fs.StringVar(&f.mpsControl, "mps-control-binary", "nvidia-cuda-mps-control", "nvidia-cuda-mps-control for --share mps: a name, looked for under --driver-root in "+strings.Join(drivertools.ToolDirs, ", ")+" (the first binary, else the first script), a path under the driver root, or an absolute path outside it")
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
	// MPS control daemons run from the driver root, in their own session:
	// they outlive the command that started them, for the GPU's other
	// clients (sharing.ProcessServers, gpudra without Kubernetes).
	mps := &sharing.ProcessServers{Root: filepath.Join(f.stateDir, "mps"),
		Control: sharing.ExecMPSControl{Runner: drivertools.Runner{Root: f.backend.driverRoot}, Path: f.mpsControl}}
	// The plugin's mark is checked again under the node lock, before every
	// change: the check above only refuses early.
	l, err := local.Open(local.Config{StateDir: f.stateDir, Machine: m, MIG: backend, Closer: backend.Close, MPS: mps, PluginDataDir: f.pluginDataDir})
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
	mpsThreads int32
	mpsPinned  string
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
	fs.StringVar(&r.share, "share", "", "time-slicing or mps: share the devices with other requests of the same kind, never with an exclusive one (mps: one GPU or MIG device, through its MPS control daemon)")
	fs.Int32Var(&r.mpsThreads, "mps-thread-percentage", 0, "with --share mps: the client's CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
	fs.StringVar(&r.mpsPinned, "mps-pinned-memory", "", "with --share mps: the client's CUDA_MPS_PINNED_DEVICE_MEM_LIMIT (40Gi)")
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
	case "", local.ShareTimeSlicing:
	case local.ShareMPS:
		req.MPS = &local.MPSLimits{ThreadPercentage: r.mpsThreads}
		if r.mpsPinned != "" {
			q, err := resource.ParseQuantity(r.mpsPinned)
			if err != nil {
				return req, fmt.Errorf("--mps-pinned-memory %q: %w", r.mpsPinned, err)
			}
			req.MPS.PinnedMiB = (q.Value() + (1 << 20) - 1) >> 20
		}
	default:
		return req, fmt.Errorf("--share %q: want time-slicing or mps", r.share)
	}
	req.Share = r.share
	var err error
	if r.file != "" {
		data, rerr := os.ReadFile(r.file)
		if rerr != nil {
			return req, fmt.Errorf("--request: %w", rerr)
		}
		if req.Devices, err = local.ParseDevices(data); err != nil {
			return req, fmt.Errorf("--request %s: %w", r.file, err)
		}
		// The claim's GpuConfig says how it shares, as in the cluster.
		share, limits, err := local.SharingOf(req.Devices)
		if err != nil {
			return req, fmt.Errorf("--request %s: %w", r.file, err)
		}
		if r.share != "" && r.share != share {
			return req, fmt.Errorf("--share %s: the request's GpuConfig says %q", r.share, share)
		}
		req.Share, req.MPS = share, limits
		return req, nil
	}
	req.Devices, err = local.Devices(local.Ask{GPUs: r.gpus, MIGProfile: r.mig, SameNVLink: r.sameNVLink, Memory: r.memory})
	return req, err
}

func newLocalCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "local",
		Short: "Share this machine's GPUs without Kubernetes: allocate, run, queue (docs/local.md)",
		Long: `Share this machine's GPUs without Kubernetes: allocate, run, queue (docs/local.md).

Whoever may write the state directory (its owner and its group) may
allocate. Each user's allocations and waiters are in a directory of theirs
in it, which only they can write: another group member can neither release
them through the commands nor change their files, and every command reads
everyone's, so no one is handed a GPU someone else holds. Each user's
command grants their own waiting requests (it creates their MIG devices and
starts MPS daemons); a grant that fails fails the request with its error
(run, allocate and ps show it). Nothing isolates a process from the GPUs it
was not given. Where users do not trust each other with the GPUs themselves,
use the cluster (the DRA kubelet plugin).`,
	}
	cmd.AddCommand(newLocalRunCommand(), newLocalAllocateCommand(), newLocalReleaseCommand(), newLocalPsCommand(),
		newLocalDrainCommand(true), newLocalDrainCommand(false), newLocalReserveCommand(), newLocalPolicyCommand(), newLocalDashboardCommand())
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
			holder, err := local.HolderOf("/proc", os.Getpid())
			if err != nil {
				return err
			}
			req, err := r.request(holder)
			if err != nil {
				return err
			}
			return f.with(cmd, func(ctx context.Context, l *local.Local) error {
				a, err := l.Acquire(ctx, req, waitingLine(cmd, req.Name))
				if err != nil {
					return err
				}
				defer func() { _ = l.Release(context.WithoutCancel(ctx), a.Name, a.User) }()
				return runChild(ctx, cmd, a, args)
			})
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

// acquireCommand is allocate and reserve: wait for devices, print them.
type acquireCommand struct {
	f      localFlags
	r      requestFlags
	output string
	pid    int
	hold   time.Duration
}

func (a *acquireCommand) run(cmd *cobra.Command, reserve bool) error {
	if err := checkOutput(a.output, "table", "json", "yaml"); err != nil {
		return err
	}
	if reserve && a.hold <= 0 {
		return errors.New("--for: a duration above zero is required (2h)")
	}
	var holder local.Holder
	if a.pid != 0 {
		var err error
		if holder, err = local.HolderOf("/proc", a.pid); err != nil {
			return fmt.Errorf("--pid: %w", err)
		}
	}
	req, err := a.r.request(holder)
	if err != nil {
		return err
	}
	if reserve {
		req.ReserveFor = &a.hold
	}
	return a.f.with(cmd, func(ctx context.Context, l *local.Local) error {
		got, err := l.Acquire(ctx, req, waitingLine(cmd, req.Name))
		if err != nil {
			return err
		}
		return printAllocation(cmd.OutOrStdout(), got, a.output)
	})
}

// waitingLine tells the user where their request waits.
func waitingLine(cmd *cobra.Command, name string) func(int) {
	return func(pos int) {
		fmt.Fprintf(cmd.ErrOrStderr(), "gpudra local: %s waits, position %d in the queue\n", name, pos)
	}
}

func newLocalAllocateCommand() *cobra.Command {
	a := &acquireCommand{}
	cmd := &cobra.Command{
		Use:   "allocate",
		Short: "Wait for GPUs and hold them until released (for a service, or a planner that runs its own processes)",
		Args:  cobra.NoArgs,
		RunE:  func(cmd *cobra.Command, _ []string) error { return a.run(cmd, false) },
	}
	a.f.register(cmd.Flags())
	a.r.register(cmd.Flags())
	cmd.Flags().IntVar(&a.pid, "pid", 0, "the process that holds the allocation: freed when it is gone (default: held until released)")
	cmd.Flags().StringVarP(&a.output, "output", "o", "table", "output format: table, json or yaml")
	return cmd
}

func newLocalReserveCommand() *cobra.Command {
	a := &acquireCommand{}
	cmd := &cobra.Command{
		Use:   "reserve --gpus N --for DURATION",
		Short: "Hold GPUs for a planned start; released when the time is up",
		Args:  cobra.NoArgs,
		RunE:  func(cmd *cobra.Command, _ []string) error { return a.run(cmd, true) },
	}
	a.f.register(cmd.Flags())
	a.r.register(cmd.Flags())
	cmd.Flags().DurationVar(&a.hold, "for", 0, "how long to hold the GPUs")
	cmd.Flags().StringVarP(&a.output, "output", "o", "table", "output format: table, json or yaml")
	return cmd
}

// with opens the machine's local state, runs fn, closes it.
func (f *localFlags) with(cmd *cobra.Command, fn func(ctx context.Context, l *local.Local) error) error {
	l, err := f.open(cmd.Context())
	if err != nil {
		return err
	}
	defer l.Close()
	return fn(cmd.Context(), l)
}

// localCommand is a command whose flags are the local flags and whose
// work is one call on the state with its arguments.
func localCommand(use, short string, nargs int, fn func(ctx context.Context, l *local.Local, args []string) error) *cobra.Command {
	var f localFlags
	cmd := &cobra.Command{
		Use: use, Short: short, Args: cobra.ExactArgs(nargs),
		RunE: func(cmd *cobra.Command, args []string) error {
			return f.with(cmd, func(ctx context.Context, l *local.Local) error { return fn(ctx, l, args) })
		},
	}
	f.register(cmd.Flags())
	return cmd
}

func newLocalReleaseCommand() *cobra.Command {
	return localCommand("release NAME", "Release your allocation (or withdraw your waiting request)", 1,
		func(ctx context.Context, l *local.Local, args []string) error {
			return l.Release(ctx, args[0], currentUser())
		})
}

func newLocalDrainCommand(on bool) *cobra.Command {
	use, short := "drain GPU-UUID", "Stop new allocations on a GPU; holders keep theirs"
	if !on {
		use, short = "undrain GPU-UUID", "Allow new allocations on a drained GPU again"
	}
	return localCommand(use, short, 1,
		func(ctx context.Context, l *local.Local, args []string) error { return l.Drain(ctx, args[0], on) })
}

func newLocalPolicyCommand() *cobra.Command {
	return localCommand("policy "+strings.Join(local.Policies, "|"), "Set the order in which waiting requests are served", 1,
		func(ctx context.Context, l *local.Local, args []string) error { return l.SetPolicy(ctx, args[0]) })
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
			return f.with(cmd, func(ctx context.Context, l *local.Local) error {
				for {
					s, err := l.State(ctx)
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
					case <-ctx.Done():
						return nil
					case <-time.After(watch):
					}
				}
			})
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
		if r.Error != "" {
			state = "failed: " + r.Error
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
