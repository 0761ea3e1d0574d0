package submit

import (
	"context"
	"errors"
	"fmt"
	"io"
	"time"

	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"

	gpudrav1 "github.com/gpudra/gpudra/api/gpudra/v1alpha1"
)

// Client creates, lists and deletes submitted jobs with the user's own
// credentials.
type Client struct {
	Kube kubernetes.Interface
	// Dynamic reads GpuQueues (nil: a named queue cannot be checked).
	Dynamic dynamic.Interface
	// Now is the clock (time.Now when nil).
	Now func() time.Time
}

// ErrQueueUnknown says that the GpuQueue could not be read: it may or may
// not exist.
var ErrQueueUnknown = errors.New("could not tell whether the GpuQueue exists")

// CheckQueue says whether the GpuQueue exists. The default queue need not
// exist as an object (it is FCFS without one). A queue that could not be
// read (forbidden, a server error, a timeout) is ErrQueueUnknown, never
// "absent".
func (c *Client) CheckQueue(ctx context.Context, name string) error {
	if name == "" || name == gpudrav1.DefaultQueue {
		return nil
	}
	if c.Dynamic == nil {
		return &FieldError{Flag: "queue", Value: name, Detail: ErrQueueUnknown.Error() + ": no client for gpudra.dev"}
	}
	_, err := c.Dynamic.Resource(gpudrav1.GpuQueues).Get(ctx, name, metav1.GetOptions{})
	switch {
	case err == nil:
		return nil
	case apierrors.IsNotFound(err):
		return &FieldError{Flag: "queue", Value: name, Detail: "no GpuQueue of that name (kubectl get gpuqueues; without --queue the job waits in the default queue)"}
	case apierrors.IsForbidden(err):
		return fmt.Errorf("--queue %s: %w: your credentials may not read GpuQueues (the chart's %q ClusterRole grants it to every user unless turned off): %v",
			name, ErrQueueUnknown, "<release>-queue-reader", err)
	default:
		return fmt.Errorf("--queue %s: %w: %v", name, ErrQueueUnknown, err)
	}
}

// LocalQueues are Kueue's LocalQueues (kueue.x-k8s.io/v1beta2, Kueue
// v0.17).
var LocalQueues = schema.GroupVersionResource{Group: "kueue.x-k8s.io", Version: "v1beta2", Resource: "localqueues"}

// CheckKueueQueue says whether the Kueue LocalQueue exists in namespace
// ("" needs none). One that could not be read is not "absent" either.
func (c *Client) CheckKueueQueue(ctx context.Context, namespace, name string) error {
	if name == "" {
		return nil
	}
	if c.Dynamic == nil {
		return fmt.Errorf("--kueue-queue %s: could not tell whether the LocalQueue exists: no client for kueue.x-k8s.io", name)
	}
	_, err := c.Dynamic.Resource(LocalQueues).Namespace(namespace).Get(ctx, name, metav1.GetOptions{})
	switch {
	case err == nil:
		return nil
	case apierrors.IsNotFound(err):
		return &FieldError{Flag: "kueue-queue", Value: name, Detail: fmt.Sprintf(
			"no LocalQueue of that name in namespace %s, or Kueue (kueue.x-k8s.io/v1beta2) is not installed (kubectl get localqueues -n %s)", namespace, namespace)}
	case apierrors.IsForbidden(err):
		return fmt.Errorf("--kueue-queue %s: could not tell whether the LocalQueue exists: your credentials may not read LocalQueues in %s (Kueue's kueue-batch-user-role grants it): %w",
			name, namespace, err)
	default:
		return fmt.Errorf("--kueue-queue %s: could not tell whether the LocalQueue exists: %w", name, err)
	}
}

// Submit checks the queue, has the API server check the claim template
// and a pod of the job (dry run: admission, the gang webhook, the
// PriorityClass) and only then creates them: bad input creates nothing.
// The template is owned by the Job, so that deleting the Job deletes it.
func (c *Client) Submit(ctx context.Context, objs Objects) error {
	logger := klog.FromContext(ctx)
	ns := objs.Job.Namespace
	if err := c.CheckQueue(ctx, objs.Job.Spec.Template.Annotations[gpudrav1.AnnotationQueue]); err != nil {
		return err
	}
	if err := c.CheckKueueQueue(ctx, ns, objs.Job.Labels[gpudrav1.LabelKueueQueue]); err != nil {
		return err
	}
	dry := metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}}
	if _, err := c.Kube.ResourceV1().ResourceClaimTemplates(ns).Create(ctx, objs.Template, dry); err != nil {
		return fmt.Errorf("claim template %s: %w", objs.Template.Name, err)
	}
	pod := &corev1.Pod{ObjectMeta: *objs.Job.Spec.Template.ObjectMeta.DeepCopy(), Spec: *objs.Job.Spec.Template.Spec.DeepCopy()}
	pod.Name, pod.Namespace = objs.Job.Name+"-0", ns
	if _, err := c.Kube.CoreV1().Pods(ns).Create(ctx, pod, dry); err != nil {
		return fmt.Errorf("the job's pods would be refused: %w", err)
	}
	if _, err := c.Kube.BatchV1().Jobs(ns).Create(ctx, objs.Job, dry); err != nil {
		return fmt.Errorf("job %s: %w", objs.Job.Name, err)
	}

	tmpl, err := c.Kube.ResourceV1().ResourceClaimTemplates(ns).Create(ctx, objs.Template, metav1.CreateOptions{})
	if err != nil {
		return fmt.Errorf("claim template %s: %w", objs.Template.Name, err)
	}
	job, err := c.Kube.BatchV1().Jobs(ns).Create(ctx, objs.Job, metav1.CreateOptions{})
	if err != nil {
		if derr := c.Kube.ResourceV1().ResourceClaimTemplates(ns).Delete(ctx, tmpl.Name, metav1.DeleteOptions{}); derr != nil && !apierrors.IsNotFound(derr) {
			logger.Error(derr, "Claim template of a job that was not created left behind", "template", klog.KObj(tmpl))
		}
		return fmt.Errorf("job %s: %w", objs.Job.Name, err)
	}
	tmpl.OwnerReferences = append(tmpl.OwnerReferences, metav1.OwnerReference{APIVersion: batchv1.SchemeGroupVersion.String(), Kind: "Job",
		Name: job.Name, UID: job.UID, BlockOwnerDeletion: ptr.To(false)})
	if _, err := c.Kube.ResourceV1().ResourceClaimTemplates(ns).Update(ctx, tmpl, metav1.UpdateOptions{}); err != nil {
		// The job runs; gpudra cancel deletes the template by its label.
		logger.Error(err, "Claim template not owned by its job", "template", klog.KObj(tmpl))
	}
	return nil
}

// List returns the submitted jobs of namespace ns ("": all), sorted by
// name.
func (c *Client) List(ctx context.Context, ns string) ([]JobStatus, error) {
	sel := labels.Set{LabelManagedBy: ManagedBy}.String()
	jobs, err := c.Kube.BatchV1().Jobs(ns).List(ctx, metav1.ListOptions{LabelSelector: sel})
	if err != nil {
		return nil, fmt.Errorf("list jobs: %w", err)
	}
	if len(jobs.Items) == 0 {
		return nil, nil
	}
	pods, err := c.Kube.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: sel})
	if err != nil {
		return nil, fmt.Errorf("list the jobs' pods: %w", err)
	}
	claims, err := c.Kube.ResourceV1().ResourceClaims(ns).List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, fmt.Errorf("list the jobs' claims: %w", err)
	}
	byNS := map[string]map[string]*resourceapi.ResourceClaim{}
	for i := range claims.Items {
		cl := &claims.Items[i]
		if byNS[cl.Namespace] == nil {
			byNS[cl.Namespace] = map[string]*resourceapi.ResourceClaim{}
		}
		byNS[cl.Namespace][cl.Name] = cl
	}
	podsOf := map[types.NamespacedName][]*corev1.Pod{}
	for i := range pods.Items {
		p := &pods.Items[i]
		k := types.NamespacedName{Namespace: p.Namespace, Name: p.Labels[LabelJob]}
		podsOf[k] = append(podsOf[k], p)
	}
	now := time.Now
	if c.Now != nil {
		now = c.Now
	}
	out := make([]JobStatus, 0, len(jobs.Items))
	for i := range jobs.Items {
		j := &jobs.Items[i]
		out = append(out, Status(j, podsOf[types.NamespacedName{Namespace: j.Namespace, Name: j.Name}], byNS[j.Namespace], now()))
	}
	return out, nil
}

// Cancel deletes a submitted job, its pods (and with them their claims)
// and its claim template. A Job that submit did not make is left alone.
func (c *Client) Cancel(ctx context.Context, ns, name string) error {
	job, err := c.Kube.BatchV1().Jobs(ns).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		if apierrors.IsNotFound(err) {
			return fmt.Errorf("job %s/%s: not found (gpudra jobs lists yours)", ns, name)
		}
		return fmt.Errorf("job %s/%s: %w", ns, name, err)
	}
	if job.Labels[LabelManagedBy] != ManagedBy {
		return fmt.Errorf("job %s/%s was not made by gpudra submit (label %s=%s): delete it with kubectl", ns, name, LabelManagedBy, ManagedBy)
	}
	if err := c.Kube.BatchV1().Jobs(ns).Delete(ctx, name, metav1.DeleteOptions{PropagationPolicy: ptr.To(metav1.DeletePropagationBackground),
		Preconditions: &metav1.Preconditions{UID: &job.UID}}); err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("delete job %s/%s: %w", ns, name, err)
	}
	// The Job owns it; deleted here too in case that reference was never
	// written.
	err = c.Kube.ResourceV1().ResourceClaimTemplates(ns).Delete(ctx, TemplateName(name), metav1.DeleteOptions{})
	if err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("delete claim template %s/%s: %w", ns, TemplateName(name), err)
	}
	return nil
}

// Logs writes the logs of the job's pods to w, each line after its pod's
// name when there are several.
func (c *Client) Logs(ctx context.Context, ns, name string, w io.Writer) error {
	pods, err := c.Kube.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: labels.Set{LabelManagedBy: ManagedBy, LabelJob: name}.String()})
	if err != nil {
		return fmt.Errorf("list the pods of job %s/%s: %w", ns, name, err)
	}
	if len(pods.Items) == 0 {
		return fmt.Errorf("job %s/%s has no pods (yet)", ns, name)
	}
	for _, p := range pods.Items {
		if len(pods.Items) > 1 {
			fmt.Fprintf(w, "==> %s <==\n", p.Name)
		}
		if p.Spec.NodeName == "" {
			fmt.Fprintf(w, "(not started: waiting for its GPUs)\n")
			continue
		}
		rc, err := c.Kube.CoreV1().Pods(ns).GetLogs(p.Name, &corev1.PodLogOptions{Container: ContainerName}).Stream(ctx)
		if err != nil {
			return fmt.Errorf("logs of pod %s/%s: %w", ns, p.Name, err)
		}
		_, err = io.Copy(w, rc)
		_ = rc.Close()
		if err != nil {
			return fmt.Errorf("logs of pod %s/%s: %w", ns, p.Name, err)
		}
	}
	return nil
}
