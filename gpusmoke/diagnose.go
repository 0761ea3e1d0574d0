package gpusmoke

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"os"
	"sort"
	"strings"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"sigs.k8s.io/yaml"

	"github.com/gpudra/gpudra/devcluster/chart"
)

// lastErrors is how many of the log's error lines the diagnostics show.
const lastErrors = 20

// diagnose prints, while the cluster still runs, what a person needs to
// see why the run failed, and keeps it in the results: the DeviceClasses,
// each pod's phase, conditions and events, each claim's allocation, the
// GPU node's slices, and the last errors in the log (the plugin's among
// them).
func (s *session) diagnose(ctx context.Context, failure error) {
	var b strings.Builder
	fmt.Fprintf(&b, "\n== diagnostics (gpu-smoke failed: %v)\n", failure)
	diagnoseCluster(ctx, &b, s.cluster.Client, []string{namespace, chart.PluginNamespace}, GPUNode)
	if s.cfg.LogFile != "" {
		fmt.Fprintf(&b, "\n-- the last %d errors in the log (%s):\n", lastErrors, s.cfg.LogFile)
		errs, err := lastErrorLines(s.cfg.LogFile, lastErrors)
		switch {
		case err != nil:
			fmt.Fprintf(&b, "   (could not read the log: %v)\n", err)
		case len(errs) == 0:
			fmt.Fprintln(&b, "   (none)")
		default:
			for _, e := range errs {
				fmt.Fprintf(&b, "   %s\n", e)
			}
		}
	}
	fmt.Fprint(s.w, b.String())
	_ = s.res.write("diagnostics.txt", b.String())
}

// diagnoseCluster writes the DeviceClasses, the pods of the namespaces with their
// conditions and events, the claims with their allocations, and node's
// ResourceSlices. A read that fails is said, and the rest still written.
func diagnoseCluster(ctx context.Context, w io.Writer, client kubernetes.Interface, namespaces []string, node string) {
	classes, err := client.ResourceV1().DeviceClasses().List(ctx, metav1.ListOptions{})
	if err != nil {
		fmt.Fprintf(w, "-- DeviceClasses: could not list: %v\n", err)
	} else {
		var names []string
		for _, c := range classes.Items {
			names = append(names, c.Name)
		}
		fmt.Fprintf(w, "-- DeviceClasses: %s\n", orNone(names))
	}
	for _, ns := range namespaces {
		pods, err := client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
		if err != nil {
			fmt.Fprintf(w, "-- pods in %s: could not list: %v\n", ns, err)
			continue
		}
		events, err := client.CoreV1().Events(ns).List(ctx, metav1.ListOptions{})
		if err != nil {
			fmt.Fprintf(w, "-- events in %s: could not list: %v\n", ns, err)
			events = &v1.EventList{}
		}
		for i := range pods.Items {
			writePod(w, &pods.Items[i], events.Items)
		}
		claims, err := client.ResourceV1().ResourceClaims(ns).List(ctx, metav1.ListOptions{})
		if err != nil {
			fmt.Fprintf(w, "-- claims in %s: could not list: %v\n", ns, err)
			continue
		}
		for i := range claims.Items {
			writeClaim(w, &claims.Items[i])
		}
	}
	slices, err := client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{FieldSelector: resourceapi.ResourceSliceSelectorNodeName + "=" + node})
	if err != nil {
		fmt.Fprintf(w, "-- ResourceSlices of node %s: could not list: %v\n", node, err)
		return
	}
	fmt.Fprintf(w, "-- ResourceSlices of node %s: %d\n", node, len(slices.Items))
	for _, sl := range slices.Items {
		var devices []string
		for _, d := range sl.Spec.Devices {
			name := d.Name
			if len(d.Taints) > 0 {
				name += fmt.Sprintf(" (tainted %s)", d.Taints[0].Key)
			}
			devices = append(devices, name)
		}
		fmt.Fprintf(w, "   %s: pool %s generation %d: %s\n", sl.Name, sl.Spec.Pool.Name, sl.Spec.Pool.Generation, orNone(devices))
	}
}

func writePod(w io.Writer, p *v1.Pod, events []v1.Event) {
	fmt.Fprintf(w, "-- pod %s/%s: %s on %q\n", p.Namespace, p.Name, p.Status.Phase, p.Spec.NodeName)
	for _, c := range p.Status.Conditions {
		line := fmt.Sprintf("   condition %s=%s", c.Type, c.Status)
		if c.Reason != "" || c.Message != "" {
			line += fmt.Sprintf(" %s: %s", c.Reason, c.Message)
		}
		fmt.Fprintln(w, line)
	}
	var mine []v1.Event
	for _, e := range events {
		if e.InvolvedObject.Kind == "Pod" && e.InvolvedObject.Name == p.Name {
			mine = append(mine, e)
		}
	}
	sort.Slice(mine, func(i, j int) bool { return eventTime(mine[i]).Time.Before(eventTime(mine[j]).Time) })
	for _, e := range mine {
		fmt.Fprintf(w, "   event %s %s (%s, x%d): %s\n", e.Type, e.Reason, e.Source.Component, max(e.Count, 1), e.Message)
	}
}

func eventTime(e v1.Event) metav1.Time {
	if !e.LastTimestamp.IsZero() {
		return e.LastTimestamp
	}
	return metav1.NewTime(e.EventTime.Time)
}

func writeClaim(w io.Writer, c *resourceapi.ResourceClaim) {
	if c.Status.Allocation == nil {
		fmt.Fprintf(w, "-- claim %s/%s: not allocated\n", c.Namespace, c.Name)
		return
	}
	var devices, users []string
	for _, r := range c.Status.Allocation.Devices.Results {
		devices = append(devices, fmt.Sprintf("%s/%s/%s", r.Driver, r.Pool, r.Device))
	}
	for _, r := range c.Status.ReservedFor {
		users = append(users, r.Resource+"/"+r.Name)
	}
	fmt.Fprintf(w, "-- claim %s/%s: allocated %s, reserved for %s\n", c.Namespace, c.Name, orNone(devices), orNone(users))
}

// lastErrorLines are the last n error lines (klog's "E" lines) of the log.
func lastErrorLines(path string, n int) ([]string, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var out []string
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if len(line) > 5 && line[0] == 'E' && line[1] >= '0' && line[1] <= '9' {
			out = append(out, line)
			if len(out) > n {
				out = out[1:]
			}
		}
	}
	return out, sc.Err()
}

// sliceYAML is the node's ResourceSlices as YAML, for the results.
func sliceYAML(ctx context.Context, client kubernetes.Interface, node string) (string, error) {
	list, err := client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{FieldSelector: resourceapi.ResourceSliceSelectorNodeName + "=" + node})
	if err != nil {
		return "", err
	}
	for i := range list.Items {
		list.Items[i].ManagedFields = nil
	}
	b, err := yaml.Marshal(list.Items)
	return string(b), err
}
