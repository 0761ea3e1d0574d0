package sharing

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/klog/v2"
)

// Labels and annotations of an MPS server pod.
const (
	MPSServerComponent  = "mps-server"
	labelComponent      = "app.kubernetes.io/component"
	labelName           = "app.kubernetes.io/name"
	labelServerKey      = "gpu.gpudra.dev/mps-server"
	annotationDevices   = "gpu.gpudra.dev/mps-devices"
	annotationServerDir = "gpu.gpudra.dev/mps-dir"
	// containerDriverRoot is where the server pod sees the driver root.
	containerDriverRoot = "/driver-root"
)

// PodServers run each MPS server as a pod of its own on this node,
// created and deleted by the plugin through the API. The daemon is the
// pod's process, not the plugin's: a restart or an upgrade of the plugin's
// container leaves it, and the workloads' MPS clients, running. The pod is
// owned by the Node, so it goes with the Node; the kubelet restarts its
// container if the daemon dies.
type PodServers struct {
	Client    kubernetes.Interface
	Namespace string
	NodeName  string
	// Image is the gpudra image (gpudra-mps-server is in it).
	Image           string
	ImagePullPolicy corev1.PullPolicy
	// HostDriverRoot is the driver root on the host; the pod mounts it at
	// /driver-root.
	HostDriverRoot string
	// ServiceAccount is what the pods run as: one without permissions,
	// and no token is mounted either way. The chart's admission policy
	// refuses any other, so that no server pod can carry another
	// component's credentials.
	ServiceAccount string
	// LogArgs make the server log as the plugin does (--logging-format,
	// -v); none: the server's defaults.
	LogArgs []string
	// StopTimeout bounds the wait for a deleted pod to go; 0: 30 s.
	StopTimeout time.Duration
}

func (p *PodServers) SharedShm() bool { return true }

func (p *PodServers) Describe(s MPSServer) string {
	return "pod " + p.Namespace + "/" + p.podName(s)
}

// podName is unique per node and device set, and a valid DNS label.
func (p *PodServers) podName(s MPSServer) string {
	node := strings.TrimRight(truncate(strings.ReplaceAll(p.NodeName, ".", "-"), 30), "-")
	sum := sha256.Sum256([]byte(p.NodeName + "/" + strings.Join(s.Devices, ",")))
	return "gpudra-mps-" + node + "-" + hex.EncodeToString(sum[:5])
}

func truncate(s string, n int) string {
	if len(s) > n {
		return s[:n]
	}
	return s
}

func (p *PodServers) Ensure(ctx context.Context, s MPSServer) (bool, error) {
	pods := p.Client.CoreV1().Pods(p.Namespace)
	name := p.podName(s)
	pod, err := pods.Get(ctx, name, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
	case err != nil:
		return false, err
	case pod.DeletionTimestamp != nil:
		// Being stopped (the last claim went a moment ago): wait for it
		// to go, then start a new one.
		if err := p.waitGone(ctx, name, pod.UID); err != nil {
			return false, err
		}
	case pod.Status.Phase == corev1.PodFailed || pod.Status.Phase == corev1.PodSucceeded:
		// Evicted, or its node rebooted under it: a pod that ended does
		// not restart. Replace it.
		klog.FromContext(ctx).Info("MPS server pod has ended; replacing it", "pod", klog.KObj(pod), "phase", pod.Status.Phase, "reason", pod.Status.Reason)
		if err := p.Stop(ctx, s); err != nil {
			return false, err
		}
	case pod.Annotations[annotationDevices] != strings.Join(s.Devices, ","):
		return false, fmt.Errorf("pod %s/%s serves devices %q, not %q", p.Namespace, name, pod.Annotations[annotationDevices], strings.Join(s.Devices, ","))
	default:
		return false, nil
	}
	want, err := p.Pod(ctx, s)
	if err != nil {
		return false, err
	}
	if _, err := pods.Create(ctx, want, metav1.CreateOptions{}); err != nil {
		if apierrors.IsAlreadyExists(err) {
			return false, nil // another plugin instance, a moment ago
		}
		return false, fmt.Errorf("create pod %s/%s: %w", p.Namespace, name, err)
	}
	klog.FromContext(ctx).Info("MPS server pod created", "pod", klog.KRef(p.Namespace, name), "devices", s.Devices)
	return true, nil
}

func (p *PodServers) Stop(ctx context.Context, s MPSServer) error {
	name := p.podName(s)
	pod, err := p.Client.CoreV1().Pods(p.Namespace).Get(ctx, name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return nil
	}
	if err != nil {
		return err
	}
	err = p.Client.CoreV1().Pods(p.Namespace).Delete(ctx, name, metav1.DeleteOptions{Preconditions: &metav1.Preconditions{UID: &pod.UID}})
	if err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("delete pod %s/%s: %w", p.Namespace, name, err)
	}
	klog.FromContext(ctx).Info("MPS server pod deleted", "pod", klog.KRef(p.Namespace, name))
	return p.waitGone(ctx, name, pod.UID)
}

// waitGone waits until the pod with uid is gone.
func (p *PodServers) waitGone(ctx context.Context, name string, uid types.UID) error {
	timeout := p.StopTimeout
	if timeout == 0 {
		timeout = 30 * time.Second
	}
	err := wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, timeout, true, func(ctx context.Context) (bool, error) {
		pod, err := p.Client.CoreV1().Pods(p.Namespace).Get(ctx, name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return true, nil
		}
		if err != nil {
			return false, nil
		}
		return pod.UID != uid, nil
	})
	if err != nil {
		return fmt.Errorf("pod %s/%s is still terminating after %s: %w", p.Namespace, name, timeout, err)
	}
	return nil
}

func (p *PodServers) List(ctx context.Context) ([]MPSServer, error) {
	list, err := p.Client.CoreV1().Pods(p.Namespace).List(ctx, metav1.ListOptions{
		LabelSelector: labels.SelectorFromSet(labels.Set{labelComponent: MPSServerComponent, labelName: "gpudra"}).String(),
		FieldSelector: fields.OneTermEqualSelector("spec.nodeName", p.NodeName).String(),
	})
	if err != nil {
		return nil, err
	}
	out := make([]MPSServer, 0, len(list.Items))
	for _, pod := range list.Items {
		if pod.Spec.NodeName != p.NodeName {
			continue // a client that ignores the field selector
		}
		s := MPSServer{Key: pod.Labels[labelServerKey], Dir: pod.Annotations[annotationServerDir]}
		if d := pod.Annotations[annotationDevices]; d != "" {
			s.Devices = strings.Split(d, ",")
		}
		out = append(out, s)
	}
	return out, nil
}

// ServerContainerDir is where an MPS server pod has its server's directory:
// a short path, whatever the host's (the kubelet directory, possibly deep),
// since the daemon's sockets must fit in a unix socket path
// (mpsserver.CheckPipeDir).
const ServerContainerDir = "/mps"

// Pod is the server pod Ensure creates: privileged (the daemon opens every /dev/nvidia*
// of its GPU, and the GPU's MIG devices), on this node, owned by the Node,
// with the server's directory at ServerContainerDir and its shm directory
// as /dev/shm.
func (p *PodServers) Pod(ctx context.Context, s MPSServer) (*corev1.Pod, error) {
	node, err := p.Client.CoreV1().Nodes().Get(ctx, p.NodeName, metav1.GetOptions{})
	if err != nil {
		return nil, fmt.Errorf("get Node %s, the owner of its MPS server pods: %w", p.NodeName, err)
	}
	args := []string{"--driver-root=" + containerDriverRoot, "--dir=" + ServerContainerDir, "--devices=" + strings.Join(s.Devices, ",")}
	// No --control-binary: the server runs the driver root's own
	// nvidia-cuda-mps-control (looked for in drivertools.ToolDirs),
	// read-only; the admission policy
	// refuses the flag, which could name any binary.
	args = append(args, p.LogArgs...)
	hostDir := corev1.HostPathDirectoryOrCreate
	privileged := true
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{
			Name: p.podName(s), Namespace: p.Namespace,
			Labels: map[string]string{labelName: "gpudra", labelComponent: MPSServerComponent, labelServerKey: s.Key},
			Annotations: map[string]string{annotationDevices: strings.Join(s.Devices, ","), annotationServerDir: s.Dir,
				"gpu.gpudra.dev/node": p.NodeName},
			OwnerReferences: []metav1.OwnerReference{{APIVersion: "v1", Kind: "Node", Name: node.Name, UID: node.UID}},
		},
		Spec: corev1.PodSpec{
			NodeName:                      p.NodeName,
			ServiceAccountName:            p.ServiceAccount,
			RestartPolicy:                 corev1.RestartPolicyAlways,
			PriorityClassName:             "system-node-critical",
			Tolerations:                   []corev1.Toleration{{Operator: corev1.TolerationOpExists}},
			AutomountServiceAccountToken:  ptr(false),
			EnableServiceLinks:            ptr(false),
			TerminationGracePeriodSeconds: ptr[int64](30),
			Containers: []corev1.Container{{
				Name: "mps-server", Image: p.Image, ImagePullPolicy: p.ImagePullPolicy,
				Command: []string{"gpudra-mps-server"},
				Args:    args,
				// Root, explicitly: the image's default user is the
				// controller's non-root 65532 (docs/image.md).
				SecurityContext: &corev1.SecurityContext{Privileged: &privileged, RunAsUser: ptr[int64](0)},
				VolumeMounts: []corev1.VolumeMount{
					{Name: "server", MountPath: ServerContainerDir},
					{Name: "shm", MountPath: "/dev/shm"},
					{Name: "driver-root", MountPath: containerDriverRoot, ReadOnly: true},
				},
			}},
			Volumes: []corev1.Volume{
				{Name: "server", VolumeSource: corev1.VolumeSource{HostPath: &corev1.HostPathVolumeSource{Path: s.Dir, Type: &hostDir}}},
				{Name: "shm", VolumeSource: corev1.VolumeSource{HostPath: &corev1.HostPathVolumeSource{Path: s.ShmDir(), Type: &hostDir}}},
				{Name: "driver-root", VolumeSource: corev1.VolumeSource{HostPath: &corev1.HostPathVolumeSource{Path: p.HostDriverRoot}}},
			},
		},
	}, nil
}

func ptr[T any](v T) *T { return &v }
