package submit

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"time"

	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"

	gpudrav1 "github.com/gpudra/gpudra/api/gpudra/v1alpha1"
	"github.com/gpudra/gpudra/pkg/kubeclient"
	"github.com/gpudra/gpudra/pkg/kueue"
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

// CheckKueueQueue says whether the Kueue LocalQueue exists in namespace
// ("" needs none). One that could not be read is not "absent" either.
func (c *Client) CheckKueueQueue(ctx context.Context, namespace, name string) error {
	if name == "" {
		return nil
	}
	if c.Dynamic == nil {
		return fmt.Errorf("--kueue-queue %s: could not tell whether the LocalQueue exists: no client for kueue.x-k8s.io", name)
	}
	_, err := c.Dynamic.Resource(kueue.LocalQueues).Namespace(namespace).Get(ctx, name, metav1.GetOptions{})
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

// ErrRayUnknown says that discovery could not tell whether the cluster
// serves RayJobs: it may or may not.
var ErrRayUnknown = errors.New("could not tell whether ray.io/v1 RayJob is served on this cluster")

// RayJobServed asks discovery whether the cluster serves ray.io/v1
// RayJobs: false (nil error) when the group version or the resource is
// not served; ErrRayUnknown when discovery failed otherwise, never
// "absent".
func (c *Client) RayJobServed(context.Context) (bool, error) {
	served, err := kubeclient.ResourceServed(c.Kube.Discovery(), RayJobs)
	if err != nil {
		return false, fmt.Errorf("%w: %v", ErrRayUnknown, err)
	}
	return served, nil
}

// Submit checks the queue, has the API server check the claim template
// and a pod of the job (dry run: admission, the gang webhook, the
// PriorityClass) and only then creates them: bad input creates nothing.
// The template is owned by the Job (or RayJob), so that deleting it
// deletes the template.
func (c *Client) Submit(ctx context.Context, objs Objects) error {
	logger := klog.FromContext(ctx)
	meta := objs.Meta()
	ns := meta.Namespace
	if objs.RayJob != nil {
		served, err := c.RayJobServed(ctx)
		if err != nil {
			return fmt.Errorf("--ray: %w", err)
		}
		if !served {
			return errors.New("--ray: ray.io/v1 RayJob is not served on this cluster: install KubeRay's operator (v1.5 or later, with its CRDs) first (docs/ray.md)")
		}
		if c.Dynamic == nil {
			return errors.New("--ray: no client for ray.io")
		}
	}
	_, podTemplate := objs.GPUPods()
	if err := c.CheckQueue(ctx, podTemplate.Annotations[gpudrav1.AnnotationQueue]); err != nil {
		return err
	}
	if err := c.CheckKueueQueue(ctx, ns, meta.Labels[gpudrav1.LabelKueueQueue]); err != nil {
		return err
	}
	dry := metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}}
	if _, err := c.Kube.ResourceV1().ResourceClaimTemplates(ns).Create(ctx, objs.Template, dry); err != nil {
		return fmt.Errorf("claim template %s: %w", objs.Template.Name, err)
	}
	pod := &corev1.Pod{ObjectMeta: *podTemplate.ObjectMeta.DeepCopy(), Spec: *podTemplate.Spec.DeepCopy()}
	pod.Name, pod.Namespace = meta.Name+"-0", ns
	if pod.Spec.RestartPolicy == "" {
		pod.Spec.RestartPolicy = corev1.RestartPolicyNever
	}
	if _, err := c.Kube.CoreV1().Pods(ns).Create(ctx, pod, dry); err != nil {
		return fmt.Errorf("the job's pods would be refused: %w", err)
	}
	create := func(opts metav1.CreateOptions) (types.UID, error) {
		if objs.RayJob != nil {
			u, err := runtime.DefaultUnstructuredConverter.ToUnstructured(objs.RayJob)
			if err != nil {
				return "", err
			}
			rj, err := c.Dynamic.Resource(RayJobs).Namespace(ns).Create(ctx, &unstructured.Unstructured{Object: u}, opts)
			if err != nil {
				return "", err
			}
			return rj.GetUID(), nil
		}
		job, err := c.Kube.BatchV1().Jobs(ns).Create(ctx, objs.Job, opts)
		if err != nil {
			return "", err
		}
		return job.UID, nil
	}
	if _, err := create(dry); err != nil {
		return fmt.Errorf("%s %s: %w", objs.Kind(), meta.Name, err)
	}

	tmpl, err := c.Kube.ResourceV1().ResourceClaimTemplates(ns).Create(ctx, objs.Template, metav1.CreateOptions{})
	if err != nil {
		return fmt.Errorf("claim template %s: %w", objs.Template.Name, err)
	}
	uid, err := create(metav1.CreateOptions{})
	if err != nil {
		if derr := c.Kube.ResourceV1().ResourceClaimTemplates(ns).Delete(ctx, tmpl.Name, metav1.DeleteOptions{}); derr != nil && !apierrors.IsNotFound(derr) {
			logger.Error(derr, "Claim template of a job that was not created left behind", "template", klog.KObj(tmpl))
		}
		return fmt.Errorf("%s %s: %w", objs.Kind(), meta.Name, err)
	}
	apiVersion := batchv1.SchemeGroupVersion.String()
	if objs.RayJob != nil {
		apiVersion = RayJobs.GroupVersion().String()
	}
	tmpl.OwnerReferences = append(tmpl.OwnerReferences, metav1.OwnerReference{APIVersion: apiVersion, Kind: objs.Kind(),
		Name: meta.Name, UID: uid, BlockOwnerDeletion: ptr.To(false)})
	if _, err := c.Kube.ResourceV1().ResourceClaimTemplates(ns).Update(ctx, tmpl, metav1.UpdateOptions{}); err != nil {
		// The job runs; gpudra cancel deletes the template by its name.
		logger.Error(err, "Claim template not owned by its job", "template", klog.KObj(tmpl))
	}
	return nil
}

// List returns the submitted jobs of namespace ns ("": all), Jobs and
// RayJobs, sorted by name. Notes say what could not be read (RayJobs,
// where discovery could not tell whether they are served).
func (c *Client) List(ctx context.Context, ns string) ([]JobStatus, []string, error) {
	sel := labels.Set{LabelManagedBy: ManagedBy}.String()
	jobs, err := c.Kube.BatchV1().Jobs(ns).List(ctx, metav1.ListOptions{LabelSelector: sel})
	if err != nil {
		return nil, nil, fmt.Errorf("list jobs: %w", err)
	}
	var notes []string
	var rayJobs []unstructured.Unstructured
	switch served, err := c.RayJobServed(ctx); {
	case err != nil:
		notes = append(notes, "RayJobs not listed: "+err.Error())
	case served && c.Dynamic != nil:
		l, err := c.Dynamic.Resource(RayJobs).Namespace(ns).List(ctx, metav1.ListOptions{LabelSelector: sel})
		if err != nil {
			notes = append(notes, fmt.Sprintf("RayJobs not listed: %v", err))
		} else {
			rayJobs = l.Items
		}
	}
	if len(jobs.Items) == 0 && len(rayJobs) == 0 {
		return nil, notes, nil
	}
	pods, err := c.Kube.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: sel})
	if err != nil {
		return nil, notes, fmt.Errorf("list the jobs' pods: %w", err)
	}
	claims, err := c.Kube.ResourceV1().ResourceClaims(ns).List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, notes, fmt.Errorf("list the jobs' claims: %w", err)
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
	workloads, kueueNote := c.kueueWorkloads(ctx, ns, jobs.Items, rayJobs)
	if kueueNote != "" {
		notes = append(notes, kueueNote)
	}
	out := make([]JobStatus, 0, len(jobs.Items)+len(rayJobs))
	for i := range jobs.Items {
		j := &jobs.Items[i]
		st := Status(j, podsOf[types.NamespacedName{Namespace: j.Namespace, Name: j.Name}], byNS[j.Namespace], now())
		out = append(out, WithKueue(st, j.Labels[gpudrav1.LabelKueueQueue], workloads[j.UID]))
	}
	for i := range rayJobs {
		rj := &rayJobs[i]
		st := RayJobStatus(rj, podsOf[types.NamespacedName{Namespace: rj.GetNamespace(), Name: rj.GetName()}], byNS[rj.GetNamespace()], now())
		out = append(out, WithKueue(st, rj.GetLabels()[gpudrav1.LabelKueueQueue], workloads[rj.GetUID()]))
	}
	slices.SortFunc(out, func(a, b JobStatus) int {
		return cmp.Or(cmp.Compare(a.Namespace, b.Namespace), cmp.Compare(a.Name, b.Name), cmp.Compare(a.Kind, b.Kind))
	})
	return out, notes, nil
}

// kueueWorkloads are Kueue's Workloads of the jobs labelled for a Kueue
// LocalQueue, by their job's UID; none are read when no job is. A list
// that fails is a note: the jobs are listed without Kueue's word.
func (c *Client) kueueWorkloads(ctx context.Context, ns string, jobs []batchv1.Job, rayJobs []unstructured.Unstructured) (map[types.UID]*unstructured.Unstructured, string) {
	kueued := slices.ContainsFunc(jobs, func(j batchv1.Job) bool { return j.Labels[gpudrav1.LabelKueueQueue] != "" }) ||
		slices.ContainsFunc(rayJobs, func(j unstructured.Unstructured) bool { return j.GetLabels()[gpudrav1.LabelKueueQueue] != "" })
	if !kueued {
		return nil, ""
	}
	if c.Dynamic == nil {
		return nil, "Kueue's Workloads not read: no client for kueue.x-k8s.io"
	}
	list, err := c.Dynamic.Resource(kueue.Workloads).Namespace(ns).List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, fmt.Sprintf("Kueue's Workloads not read (a job Kueue queues shows no reason from it): %v", err)
	}
	return kueue.ByOwner(list.Items), ""
}

// Cancel deletes a submitted job (a Job, else a RayJob of that name), its
// pods (and with them their claims) and its claim template. An object
// that submit did not make is left alone.
func (c *Client) Cancel(ctx context.Context, ns, name string) error {
	job, err := c.Kube.BatchV1().Jobs(ns).Get(ctx, name, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		return c.cancelRayJob(ctx, ns, name)
	case err != nil:
		return fmt.Errorf("job %s/%s: %w", ns, name, err)
	}
	if job.Labels[LabelManagedBy] != ManagedBy {
		// KubeRay's submitter Job has its RayJob's name: that RayJob,
		// if submit made it, is the one to cancel.
		if err := c.cancelRayJob(ctx, ns, name); err == nil || !errors.Is(err, errNotFound) {
			return err
		}
		return fmt.Errorf("job %s/%s was not made by gpudra submit (label %s=%s): delete it with kubectl", ns, name, LabelManagedBy, ManagedBy)
	}
	if err := c.Kube.BatchV1().Jobs(ns).Delete(ctx, name, metav1.DeleteOptions{PropagationPolicy: ptr.To(metav1.DeletePropagationBackground),
		Preconditions: &metav1.Preconditions{UID: &job.UID}}); err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("delete job %s/%s: %w", ns, name, err)
	}
	return c.deleteTemplate(ctx, ns, name)
}

// errNotFound: no job of that name that submit could have made.
var errNotFound = errors.New("not found")

// cancelRayJob deletes the RayJob of that name: KubeRay's finalizer stops
// the Ray job, and the garbage collector deletes its cluster, pods and
// their claims.
func (c *Client) cancelRayJob(ctx context.Context, ns, name string) error {
	notFound := fmt.Errorf("job %s/%s: %w (gpudra jobs lists yours)", ns, name, errNotFound)
	served, err := c.RayJobServed(ctx)
	switch {
	case err != nil:
		return fmt.Errorf("job %s/%s: no Job of that name, and %w", ns, name, err)
	case !served || c.Dynamic == nil:
		return notFound
	}
	rj, err := c.Dynamic.Resource(RayJobs).Namespace(ns).Get(ctx, name, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		return notFound
	case err != nil:
		return fmt.Errorf("RayJob %s/%s: %w", ns, name, err)
	}
	if rj.GetLabels()[LabelManagedBy] != ManagedBy {
		return fmt.Errorf("RayJob %s/%s was not made by gpudra submit (label %s=%s): delete it with kubectl", ns, name, LabelManagedBy, ManagedBy)
	}
	uid := rj.GetUID()
	if err := c.Dynamic.Resource(RayJobs).Namespace(ns).Delete(ctx, name, metav1.DeleteOptions{PropagationPolicy: ptr.To(metav1.DeletePropagationBackground),
		Preconditions: &metav1.Preconditions{UID: &uid}}); err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("delete RayJob %s/%s: %w", ns, name, err)
	}
	return c.deleteTemplate(ctx, ns, name)
}

// deleteTemplate deletes the job's claim template: its owner's deletion
// deletes it too, in case that reference was never written.
func (c *Client) deleteTemplate(ctx context.Context, ns, name string) error {
	err := c.Kube.ResourceV1().ResourceClaimTemplates(ns).Delete(ctx, TemplateName(name), metav1.DeleteOptions{})
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
		// The job's container: the first (a Ray pod's is Ray's).
		rc, err := c.Kube.CoreV1().Pods(ns).GetLogs(p.Name, &corev1.PodLogOptions{Container: p.Spec.Containers[0].Name}).Stream(ctx)
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
