package devcluster

import (
	"context"
	"errors"
	"slices"
	"strings"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/klog/v2"

	"github.com/gpudra/gpudra/devcluster/nodeagent"
	"github.com/gpudra/gpudra/devcluster/realnode"
	"github.com/gpudra/gpudra/pkg/cdi"
	"github.com/gpudra/gpudra/pkg/nvdevice/sim"
	"github.com/gpudra/gpudra/pkg/probe"
)

// feedRealNodeLoads plays, for a real node's simulated machine, the CUDA
// processes its containers would run: every containers that declares a
// load (nodeagent.SimLoadEnv) is listed, by its host PID (containerd's
// task), on each device its CDI devices named in its environment, in the
// driver root's process feed (sim.ProcessFeedFile), which the machine in
// the plugin's container reads before each telemetry sample. The plugin
// then attributes the process as on any node: its cgroup from the host's
// /proc, its container from the kubelet's /var/log/containers links. It
// runs until ctx ends.
func (c *Cluster) feedRealNodeLoads(ctx context.Context, n *realnode.Node, driverRoot string) {
	logger := klog.FromContext(ctx).WithValues("node", n.Name)
	var last []sim.FedProcess
	for {
		select {
		case <-ctx.Done():
			return
		case <-time.After(500 * time.Millisecond):
		}
		procs, err := c.realNodeProcesses(ctx, n)
		if err != nil {
			if ctx.Err() == nil {
				logger.V(2).Info("Real node: the containers' loads are not fed this round", "err", err)
			}
			continue
		}
		if slices.Equal(procs, last) {
			continue
		}
		if err := sim.WriteProcessFeed(driverRoot, procs); err != nil {
			logger.Error(err, "Real node: write the simulated machine's process feed")
			continue
		}
		last = procs
	}
}

// realNodeProcesses lists the declared loads of the node's running
// containers, in a stable order.
func (c *Cluster) realNodeProcesses(ctx context.Context, n *realnode.Node) ([]sim.FedProcess, error) {
	pods, err := c.Client.CoreV1().Pods(metav1.NamespaceAll).List(ctx, metav1.ListOptions{FieldSelector: "spec.nodeName=" + n.Name})
	if err != nil {
		return nil, err
	}
	pids, err := n.TaskPIDs(ctx)
	if err != nil {
		return nil, err
	}
	var procs []sim.FedProcess
	for i := range pods.Items {
		pod := &pods.Items[i]
		if pod.Status.Phase != v1.PodRunning {
			continue
		}
		for _, ctr := range pod.Spec.Containers {
			var value string
			for _, e := range ctr.Env {
				if e.Name == nodeagent.SimLoadEnv {
					value = e.Value
				}
			}
			if value == "" {
				continue
			}
			load, err := nodeagent.ParseSimLoad(value)
			if err != nil {
				klog.FromContext(ctx).Info("Real node: a container's declared load is unreadable; not fed", "pod", klog.KObj(pod), "container", ctr.Name, "err", err)
				continue
			}
			pid := 0
			for _, cs := range pod.Status.ContainerStatuses {
				if cs.Name == ctr.Name {
					pid = pids[strings.TrimPrefix(cs.ContainerID, "containerd://")]
				}
			}
			if pid == 0 {
				continue
			}
			r, err := n.ProbeReport(pod.Namespace, pod.Name, string(pod.UID), ctr.Name)
			if errors.Is(err, realnode.ErrNoReport) {
				continue
			} else if err != nil {
				return nil, err
			}
			for _, uuid := range DeviceIdentities(r) {
				procs = append(procs, sim.FedProcess{Device: uuid, PID: pid, SMShare: load.SMShare, MemoryBytes: load.MemoryBytes})
			}
		}
	}
	slices.SortFunc(procs, func(a, b sim.FedProcess) int {
		if a.PID != b.PID {
			return a.PID - b.PID
		}
		return strings.Compare(a.Device, b.Device)
	})
	return procs, nil
}

// DeviceIdentities are the GPU and MIG UUIDs gpudra's CDI specs put in a
// container's environment (GPUDRA_<device>_UUID), as its probe saw them.
func DeviceIdentities(r *probe.Report) []string {
	var out []string
	for k, v := range r.Env {
		if strings.HasPrefix(k, cdi.DeviceEnvPrefix) && strings.HasSuffix(k, "_UUID") {
			out = append(out, v)
		}
	}
	slices.Sort(out)
	return out
}
