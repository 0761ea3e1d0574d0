// Package cli is the commands gpudra submit, jobs, cancel and logs, apart
// from cmd/gpudra so that the end-to-end tests run them in-process as a
// user of their own.
package cli

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"math/big"
	"os/user"
	"regexp"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"sigs.k8s.io/yaml"

	"github.com/gpudra/gpudra/pkg/submit"
)

// Clients are what the commands act with: the user's own.
type Clients struct {
	Submit *submit.Client
	// Namespace is the kubeconfig context's.
	Namespace string
	// Usage reads the utilization of devices (<node>/<device>) from the
	// plugins' telemetry (nil: not read), found in pluginNamespace or, when
	// "", by the chart's labels in any namespace. Notes say what could not
	// be read.
	Usage UsageFunc
}

// UsageFunc reads devices' utilization (0 to 1) by <node>/<device>.
type UsageFunc func(ctx context.Context, pluginNamespace string, devices []string) (map[string]float64, []string)

// ClientFactory makes Clients from --kubeconfig and --context.
type ClientFactory func(kubeconfig, context string) (Clients, error)

// KubeconfigClients loads the kubeconfig as kubectl does: --kubeconfig,
// else $KUBECONFIG, else ~/.kube/config, else in-cluster. usage, when not
// nil, makes the utilization reader from the same config.
func KubeconfigClients(usage func(*rest.Config) UsageFunc) ClientFactory {
	return func(kubeconfig, kubeContext string) (Clients, error) {
		rules := clientcmd.NewDefaultClientConfigLoadingRules()
		rules.ExplicitPath = kubeconfig
		cc := clientcmd.NewNonInteractiveDeferredLoadingClientConfig(rules, &clientcmd.ConfigOverrides{CurrentContext: kubeContext})
		ns, _, err := cc.Namespace()
		if err != nil {
			return Clients{}, fmt.Errorf("kubeconfig: %w", err)
		}
		rc, err := cc.ClientConfig()
		if err != nil {
			return Clients{}, fmt.Errorf("kubeconfig: %w", err)
		}
		return ClientsFor(rc, ns, usage)
	}
}

// ClientsFor makes Clients from a REST config.
func ClientsFor(rc *rest.Config, ns string, usage func(*rest.Config) UsageFunc) (Clients, error) {
	rc = rest.CopyConfig(rc)
	rc.UserAgent = "gpudra-submit"
	kube, err := kubernetes.NewForConfig(rc)
	if err != nil {
		return Clients{}, fmt.Errorf("API client: %w", err)
	}
	dyn, err := dynamic.NewForConfig(rc)
	if err != nil {
		return Clients{}, fmt.Errorf("API client for gpudra.dev: %w", err)
	}
	c := Clients{Submit: &submit.Client{Kube: kube, Dynamic: dyn}, Namespace: ns}
	if usage != nil {
		c.Usage = usage(rc)
	}
	return c, nil
}

// clusterFlags are every command's.
type clusterFlags struct {
	kubeconfig, context, namespace string
}

func (f *clusterFlags) register(fs *pflag.FlagSet) {
	fs.StringVar(&f.kubeconfig, "kubeconfig", "", "path to the kubeconfig file; default: $KUBECONFIG, ~/.kube/config or in-cluster")
	fs.StringVar(&f.context, "context", "", "kubeconfig context to use")
	fs.StringVarP(&f.namespace, "namespace", "n", "", "the namespace; default: the kubeconfig context's")
}

func (f *clusterFlags) clients(newClients ClientFactory) (Clients, string, error) {
	c, err := newClients(f.kubeconfig, f.context)
	if err != nil {
		return c, "", err
	}
	ns := f.namespace
	if ns == "" {
		ns = c.Namespace
	}
	if ns == "" {
		ns = "default"
	}
	return c, ns, nil
}

// Commands are submit, jobs, cancel and logs.
func Commands(newClients ClientFactory) []*cobra.Command {
	return []*cobra.Command{newSubmitCommand(newClients), newJobsCommand(newClients), newCancelCommand(newClients), newLogsCommand(newClients)}
}

func newSubmitCommand(newClients ClientFactory) *cobra.Command {
	var f clusterFlags
	var s submit.Spec
	var mps, ray, dryRun bool
	var output string
	cmd := &cobra.Command{
		Use:   "submit --gpus N --image IMG [flags] -- CMD ARGS...",
		Short: "Run CMD on the cluster's GPUs as a Job: the words of gpudra local run (docs/submit.md)",
		Long: `submit creates a Job in your namespace whose pods ask for GPUs through a ResourceClaimTemplate,
with your own kubeconfig and rights, and prints its name and place in gpudra's queue.

The flags mean what they mean in gpudra local run. Where the cluster differs:
  --share      also takes a fraction of one GPU (0.25): a share of a GPU published for fractional
               shares (a plugin run with --fractional-gpus), its memory and SMs that fraction of the
               smallest supported GPU's (H100 80GB: 81559Mi; the fewest SMs of a supported GPU)
  --priority   names a PriorityClass (kubectl get priorityclasses): the pods' priority, which
               gpudra's Priority policy orders by; gpudra local takes a number
  --duration   is declared for ShortestJobFirst, as locally, and also each pod's
               activeDeadlineSeconds: a pod still running that long after it started is stopped
  --queue      names a GpuQueue (kubectl get gpuqueues)
  --kueue-queue names a Kueue LocalQueue instead (kubectl get localqueues): Kueue admits the job
               against its team's quota, then gpudra places it, in no GpuQueue (docs/queues.md)
More GPUs than one node has (--gpus-per-node, 8) make a gang of several pods (an Indexed Job,
JOB_COMPLETION_INDEX in each pod) that start all or nothing. Every job is a gpudra gang, so it
waits in gpudra's queue, in order, and says why.

--ray makes a KubeRay RayJob instead (ray.io/v1; KubeRay's operator must run on the cluster): a
head without GPUs and one worker group whose workers hold the GPUs (as many workers as the Job
would have pods), head and workers one gang, CMD the job's entrypoint; --image is a Ray image;
--duration is declared only (no pod deadline: KubeRay would make a stopped Ray pod again).

Nothing is created unless everything checks: the flags here, then the queue, the claim
template and one of the job's pods on the API server (dry run).`,
		RunE: func(cmd *cobra.Command, args []string) error {
			s.Ray = ray
			if mps {
				if s.Share != "" && s.Share != submit.ShareMPS {
					return fmt.Errorf("--mps and --share %s exclude each other", s.Share)
				}
				s.Share = submit.ShareMPS
			}
			if output != "" && output != "yaml" {
				return fmt.Errorf("-o %s: want yaml", output)
			}
			if output != "" && !dryRun {
				return errors.New("-o yaml: only with --dry-run (what would be created)")
			}
			s.Command = args
			if s.Name == "" {
				s.Name = defaultName()
			}
			if err := s.Validate(); err != nil {
				return err
			}
			if dryRun {
				// What would be created: in -n's namespace, else the
				// kubeconfig's if there is one, else none.
				s.Namespace = f.namespace
				if s.Namespace == "" {
					if _, ns, err := f.clients(newClients); err == nil {
						s.Namespace = ns
					}
				}
				objs, err := submit.Build(s)
				if err != nil {
					return err
				}
				return printYAML(cmd.OutOrStdout(), objs)
			}
			c, ns, err := f.clients(newClients)
			if err != nil {
				return err
			}
			s.Namespace = ns
			objs, err := submit.Build(s)
			if err != nil {
				return err
			}
			if err := c.Submit.Submit(cmd.Context(), objs); err != nil {
				return err
			}
			return printSubmitted(cmd.Context(), cmd.OutOrStdout(), c.Submit, objs)
		},
	}
	f.register(cmd.Flags())
	fs := cmd.Flags()
	fs.Int64Var(&s.GPUs, "gpus", 1, "how many whole GPUs (or MIG devices with --mig)")
	fs.Int64Var(&s.GPUsPerNode, "gpus-per-node", submit.DefaultGPUsPerNode, "the most GPUs one pod asks for: more make a gang of several pods, each with the same number")
	fs.StringVar(&s.MIG, "mig", "", "a MIG device of this profile instead of whole GPUs (1g.10gb, 3g.40gb, ...)")
	fs.BoolVar(&s.SameNVLink, "same-nvlink", false, "each pod's GPUs in one NVLink domain")
	fs.StringVar(&s.Memory, "memory", "", "GPUs (or MIG devices) with at least this much memory (80Gi)")
	fs.StringVar(&s.Share, "share", "", "a fraction of one GPU (0.25), or time-slicing or mps: share the devices with other claims of the same kind")
	fs.BoolVar(&mps, "mps", false, "the same as --share mps")
	fs.Int32Var(&s.MPSThreadPercentage, "mps-thread-percentage", 0, "with --share mps: the client's CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
	fs.StringVar(&s.MPSPinnedMemory, "mps-pinned-memory", "", "with --share mps: the client's CUDA_MPS_PINNED_DEVICE_MEM_LIMIT (40Gi)")
	fs.StringVar(&s.Image, "image", "", "the container image (required)")
	fs.StringVar(&s.PriorityClass, "priority", "", "a PriorityClass name: the pods' priority, which gpudra's Priority policy orders by")
	fs.DurationVar(&s.Duration, "duration", 0, "declared run time, for the ShortestJobFirst policy; also each pod's activeDeadlineSeconds")
	fs.StringVar(&s.Queue, "queue", "", "the GpuQueue to wait in (default: default)")
	fs.StringVar(&s.KueueQueue, "kueue-queue", "", "a Kueue LocalQueue of your namespace: Kueue admits the job against its quota, gpudra places it (whole GPUs only; docs/queues.md)")
	fs.StringVar(&s.Name, "name", "", "the Job's name (default: <user>-<5 random characters>)")
	fs.BoolVar(&ray, "ray", false, "a KubeRay RayJob instead of a Job: a head and GPU workers, one gang, CMD its entrypoint (needs KubeRay's operator)")
	fs.BoolVar(&dryRun, "dry-run", false, "create nothing: with -o yaml, print what would be created")
	fs.StringVarP(&output, "output", "o", "", "with --dry-run: yaml")
	return cmd
}

var nonDNS = regexp.MustCompile(`[^a-z0-9-]+`)

// defaultName is <user>-<5 random characters>, as gpudra local names an
// allocation after its user.
func defaultName() string {
	name := "job"
	if u, err := user.Current(); err == nil {
		if n := strings.Trim(nonDNS.ReplaceAllString(strings.ToLower(u.Username), "-"), "-"); n != "" {
			name = n
		}
	}
	if len(name) > 40 {
		name = strings.TrimRight(name[:40], "-")
	}
	const letters = "abcdefghijklmnopqrstuvwxyz0123456789"
	b := make([]byte, 5)
	for i := range b {
		n, _ := rand.Int(rand.Reader, big.NewInt(int64(len(letters))))
		b[i] = letters[n.Int64()]
	}
	return name + "-" + string(b)
}

func printYAML(w io.Writer, objs submit.Objects) error {
	var obj any = objs.Job
	if objs.RayJob != nil {
		obj = objs.RayJob
	}
	for i, o := range []any{objs.Template, obj} {
		if i > 0 {
			fmt.Fprintln(w, "---")
		}
		b, err := yaml.Marshal(o)
		if err != nil {
			return err
		}
		if _, err := w.Write(b); err != nil {
			return err
		}
	}
	return nil
}

// printSubmitted says what was made and where it waits: the controller
// writes the gang's condition within a round, so submit waits a moment
// for it.
func printSubmitted(ctx context.Context, w io.Writer, c *submit.Client, objs submit.Objects) error {
	meta := objs.Meta()
	what := "job"
	if objs.RayJob != nil {
		what = "RayJob"
	}
	fmt.Fprintf(w, "%s %s/%s submitted: %d GPU(s)\n", what, meta.Namespace, meta.Name, gpusOf(objs))
	var st *submit.JobStatus
	deadline := time.Now().Add(3 * time.Second)
	for {
		jobs, _, err := c.List(ctx, meta.Namespace)
		if err == nil {
			for i := range jobs {
				if jobs[i].Name == meta.Name && jobs[i].Kind == objs.Kind() {
					st = &jobs[i]
				}
			}
		}
		if (st != nil && (st.Position > 0 || st.State != submit.StateWaiting)) || time.Now().After(deadline) {
			break
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(250 * time.Millisecond):
		}
	}
	switch {
	case st == nil || (st.State == submit.StateWaiting && st.Reason == ""):
		fmt.Fprintf(w, "waiting in queue %s (no place yet: gpudra jobs shows it)\n", queueOf(objs))
	case st.State == submit.StateWaiting:
		fmt.Fprintf(w, "%s\n", waitLine(*st))
	default:
		fmt.Fprintf(w, "%s\n", strings.ToLower(st.State))
	}
	return nil
}

func waitLine(st submit.JobStatus) string {
	s := "waiting in queue " + st.Queue
	if st.Position > 0 {
		s += fmt.Sprintf(", position %d", st.Position)
	}
	if st.Reason != "" {
		s += ": " + st.Reason
	}
	if st.Message != "" {
		s += " (" + st.Message + ")"
	}
	return s
}

func gpusOf(objs submit.Objects) int64 {
	pods, _ := objs.GPUPods()
	n := int64(pods)
	var per int64
	for _, r := range objs.Template.Spec.Spec.Devices.Requests {
		if r.Exactly != nil {
			per += max(r.Exactly.Count, 1)
		}
	}
	return n * per
}

func queueOf(objs submit.Objects) string {
	_, t := objs.GPUPods()
	if q := t.Annotations["gpudra.dev/queue"]; q != "" {
		return q
	}
	return "default"
}

func newJobsCommand(newClients ClientFactory) *cobra.Command {
	var f clusterFlags
	var all bool
	var output, pluginNamespace string
	cmd := &cobra.Command{
		Use:   "jobs",
		Short: "List your jobs made by gpudra submit: state, place in the queue, why they wait, devices, utilization",
		Long: `jobs lists the Jobs gpudra submit made in your namespace (-A: in every namespace, where you may
list them): their state, their place in gpudra's queue and why they wait (the gang's condition, or
the scheduler's reason), the devices they were allocated (<node>/<device>) and, once running, the
GPUs' mean utilization where you may read the plugins' /metrics (through the API server's pods
proxy); "-" where it could not be read. No estimated start: the controller publishes none, and
the one the dashboard shows needs every namespace's queue.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if output != "" && output != "wide" {
				return fmt.Errorf("-o %s: want wide", output)
			}
			c, ns, err := f.clients(newClients)
			if err != nil {
				return err
			}
			if all {
				ns = ""
			}
			jobs, notes, err := c.Submit.List(cmd.Context(), ns)
			if err != nil {
				if all {
					return fmt.Errorf("-A: %w", err)
				}
				return err
			}
			if c.Usage != nil {
				var devices []string
				for _, j := range jobs {
					if j.State == submit.StateRunning {
						devices = append(devices, j.Devices...)
					}
				}
				if len(devices) > 0 {
					var util map[string]float64
					var usageNotes []string
					util, usageNotes = c.Usage(cmd.Context(), pluginNamespace, devices)
					notes = append(notes, usageNotes...)
					for i := range jobs {
						jobs[i].Utilization = meanOf(jobs[i], util)
					}
				}
			}
			return printJobs(cmd.OutOrStdout(), jobs, all, output == "wide", notes)
		},
	}
	f.register(cmd.Flags())
	cmd.Flags().BoolVarP(&all, "all-namespaces", "A", false, "every namespace (where you may list Jobs there)")
	cmd.Flags().StringVarP(&output, "output", "o", "", "wide: the whole reason")
	cmd.Flags().StringVar(&pluginNamespace, "plugin-namespace", "", "the namespace of gpudra's kubelet plugin pods, whose /metrics give the utilization; default: found by the chart's labels in any namespace")
	return cmd
}

func meanOf(j submit.JobStatus, util map[string]float64) *float64 {
	if j.State != submit.StateRunning || len(j.Devices) == 0 {
		return nil
	}
	var sum float64
	for _, d := range j.Devices {
		u, ok := util[d]
		if !ok {
			return nil
		}
		sum += u
	}
	m := sum / float64(len(j.Devices))
	return &m
}

func printJobs(w io.Writer, jobs []submit.JobStatus, all, wide bool, notes []string) error {
	if len(jobs) == 0 {
		fmt.Fprintln(w, "No jobs made by gpudra submit.")
		return nil
	}
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	if all {
		fmt.Fprint(tw, "NAMESPACE\t")
	}
	fmt.Fprintln(tw, "NAME\tKIND\tSTATE\tPODS\tQUEUE\tPOSITION\tREASON\tDEVICES\tGPU UTIL\tAGE")
	for _, j := range jobs {
		if all {
			fmt.Fprintf(tw, "%s\t", j.Namespace)
		}
		pos, util, devices := "-", "-", "-"
		if j.Position > 0 {
			pos = fmt.Sprint(j.Position)
		}
		if j.Utilization != nil {
			util = fmt.Sprintf("%.0f%%", *j.Utilization*100)
		}
		if len(j.Devices) > 0 {
			devices = strings.Join(j.Devices, ",")
		}
		reason := j.Reason
		if j.Message != "" {
			msg := j.Message
			if !wide && len(msg) > 60 {
				msg = msg[:57] + "..."
			}
			reason += ": " + msg
		}
		if reason == "" {
			reason = "-"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", j.Name, j.Kind, j.State, j.Pods, j.Queue, pos, reason, devices, util, j.Age)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	for _, n := range notes {
		fmt.Fprintln(w, "note: "+n)
	}
	return nil
}

func newCancelCommand(newClients ClientFactory) *cobra.Command {
	var f clusterFlags
	cmd := &cobra.Command{
		Use:   "cancel NAME...",
		Short: "Delete jobs made by gpudra submit: their pods, claims (the GPUs go back) and claim templates",
		Args:  cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, ns, err := f.clients(newClients)
			if err != nil {
				return err
			}
			for _, name := range args {
				if err := c.Submit.Cancel(cmd.Context(), ns, name); err != nil {
					return err
				}
				fmt.Fprintf(cmd.OutOrStdout(), "job %s/%s cancelled\n", ns, name)
			}
			return nil
		},
	}
	f.register(cmd.Flags())
	return cmd
}

func newLogsCommand(newClients ClientFactory) *cobra.Command {
	var f clusterFlags
	cmd := &cobra.Command{
		Use:   "logs NAME",
		Short: "Print the logs of a job made by gpudra submit (every pod's, through the API server)",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, ns, err := f.clients(newClients)
			if err != nil {
				return err
			}
			return c.Submit.Logs(cmd.Context(), ns, args[0], cmd.OutOrStdout())
		},
	}
	f.register(cmd.Flags())
	return cmd
}
