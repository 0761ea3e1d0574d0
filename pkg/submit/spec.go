// Package submit is gpudra submit, jobs and cancel: a researcher's job on the
// cluster in the words of gpudra local run (--gpus, --mig, --share,
// --same-nvlink, --priority, --duration, --queue). Build is a pure function
// from a Spec to the objects (a batch/v1 Job whose pods are one gpudra gang,
// and the ResourceClaimTemplate of their GPUs); Client creates, lists and
// deletes them with the user's own credentials (docs/submit.md).
package submit

import (
	"fmt"
	"maps"
	"math"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/yaml"

	gpuapi "github.com/gpudra/gpudra/api/gpu/v1alpha1"
	gpudrav1 "github.com/gpudra/gpudra/api/gpudra/v1alpha1"
	"github.com/gpudra/gpudra/pkg/local"
)

// Labels and names of what submit makes.
const (
	// LabelManagedBy marks every object submit creates, so that gpudra jobs
	// lists only those.
	LabelManagedBy = "app.kubernetes.io/managed-by"
	ManagedBy      = "gpudra-submit"
	// LabelJob names the submitted job on its Job, pods and claim template.
	LabelJob = "gpudra.dev/submit-job"
	// ClaimName is the pod's claim (and the container's) for its GPUs.
	ClaimName = "gpus"
	// ContainerName is the job's one container.
	ContainerName = "main"
	// DefaultGPUsPerNode is what one node of the supported machines has
	// (8 H100 or H200): more GPUs than that make a gang of several pods.
	DefaultGPUsPerNode = 8
	// FractionalToleration is the taint key devcluster (and the fractional
	// example) keeps whole-GPU pods off fractional nodes with.
	FractionalToleration = "gpu.gpudra.dev/fractional"
)

// Share modes besides a fraction, as gpudra local run names them.
const (
	ShareTimeSlicing = local.ShareTimeSlicing
	ShareMPS         = local.ShareMPS
)

// Spec is what the user asked for, flag by flag.
type Spec struct {
	// Name of the Job (and of the gang); the claim template is
	// <Name>-gpus.
	Name, Namespace string
	// GPUs is how many whole GPUs (or MIG devices with MIG, or shares).
	GPUs int64
	// GPUsPerNode is the most GPUs one pod asks for; more make a gang of
	// several pods (DefaultGPUsPerNode when 0).
	GPUsPerNode int64
	// MIG is a MIG profile ("1g.10gb").
	MIG string
	// Share is a fraction of one GPU ("0.25"), time-slicing, or mps.
	Share string
	// MPSThreadPercentage and MPSPinnedMemory are the MPS client's limits
	// (--share mps).
	MPSThreadPercentage int32
	MPSPinnedMemory     string
	// SameNVLink keeps each pod's GPUs in one NVLink domain.
	SameNVLink bool
	// Memory: GPUs (or MIG devices) with at least this much memory.
	Memory string
	Image  string
	// Command is the container's command and arguments.
	Command []string
	// PriorityClass names a PriorityClass: the pods' priority, which is
	// the gang's under gpudra's Priority policy.
	PriorityClass string
	// Duration is the declared run time (ShortestJobFirst), also each
	// pod's activeDeadlineSeconds.
	Duration time.Duration
	// Queue names a GpuQueue ("": default).
	Queue string
	// KueueQueue names a Kueue LocalQueue of the namespace: Kueue admits
	// the job against its quota, gpudra then places it, in no GpuQueue
	// (docs/queues.md). Excludes Queue.
	KueueQueue string
	// Ray makes a KubeRay RayJob instead of a Job: a head and one worker
	// group whose workers hold the GPUs, one gang, the command its
	// entrypoint.
	Ray bool
}

// FieldError is bad input, naming the flag.
type FieldError struct {
	Flag, Value, Detail string
}

func (e *FieldError) Error() string {
	if e.Value == "" {
		return fmt.Sprintf("--%s: %s", e.Flag, e.Detail)
	}
	return fmt.Sprintf("--%s %s: %s", e.Flag, e.Value, e.Detail)
}

func flagErr(flag, value, format string, args ...any) error {
	return &FieldError{Flag: flag, Value: value, Detail: fmt.Sprintf(format, args...)}
}

// fractionRE is a share of one GPU: 0.5, .25, 1.
var fractionRE = regexp.MustCompile(`^(0?\.[0-9]+|[01](\.[0-9]*)?)$`)

// Fraction parses --share when it is a fraction; ok is false for a mode
// (time-slicing, mps).
func (s Spec) Fraction() (f float64, ok bool, err error) {
	if s.Share == "" || s.Share == ShareTimeSlicing || s.Share == ShareMPS {
		return 0, false, nil
	}
	if !fractionRE.MatchString(s.Share) {
		return 0, false, flagErr("share", s.Share, "want a fraction of one GPU in (0, 1] (0.25), %s or %s", ShareTimeSlicing, ShareMPS)
	}
	f, err = strconv.ParseFloat(s.Share, 64)
	if err != nil || f <= 0 || f > 1 {
		return 0, false, flagErr("share", s.Share, "a fraction of one GPU must be more than 0 and at most 1")
	}
	return f, true, nil
}

// Validate checks everything that needs no cluster, each error naming its
// flag.
func (s Spec) Validate() error {
	if s.GPUs < 1 {
		return flagErr("gpus", strconv.FormatInt(s.GPUs, 10), "at least 1")
	}
	if s.Name != "" {
		if errs := validation.IsDNS1123Label(s.Name); len(errs) > 0 {
			return flagErr("name", s.Name, "%s", strings.Join(errs, "; "))
		}
		// The claim template is <name>-gpus, and the Job's pods carry
		// the name in a label of at most 63 characters.
		if len(s.Name) > 63-len("-"+ClaimName) {
			return flagErr("name", s.Name, "at most %d characters", 63-len("-"+ClaimName))
		}
	}
	_, isFraction, err := s.Fraction()
	if err != nil {
		return err
	}
	if s.MIG != "" {
		if !slices.Contains(KnownMIGProfiles(), s.MIG) {
			return flagErr("mig", s.MIG, "not a MIG profile of the supported GPUs; want one of %s", strings.Join(KnownMIGProfiles(), ", "))
		}
		if isFraction {
			return flagErr("share", s.Share, "a fraction of a GPU and a MIG device (--mig %s) exclude each other: a MIG device is already a fixed part of a GPU", s.MIG)
		}
	}
	if isFraction && s.GPUs != 1 {
		return flagErr("share", s.Share, "a fractional share is part of one GPU: --gpus must be 1 (got %d)", s.GPUs)
	}
	if isFraction && s.SameNVLink {
		return flagErr("same-nvlink", "", "a fractional share is part of one GPU")
	}
	if s.Share != ShareMPS && (s.MPSThreadPercentage != 0 || s.MPSPinnedMemory != "") {
		return flagErr("mps-thread-percentage", "", "only with --share mps (or --mps)")
	}
	if s.MPSThreadPercentage < 0 || s.MPSThreadPercentage > 100 {
		return flagErr("mps-thread-percentage", strconv.Itoa(int(s.MPSThreadPercentage)), "want 1 to 100")
	}
	if s.MPSPinnedMemory != "" {
		if _, err := resource.ParseQuantity(s.MPSPinnedMemory); err != nil {
			return flagErr("mps-pinned-memory", s.MPSPinnedMemory, "%v", err)
		}
	}
	if s.Memory != "" {
		if _, err := resource.ParseQuantity(s.Memory); err != nil {
			return flagErr("memory", s.Memory, "%v", err)
		}
	}
	if s.Image == "" {
		return flagErr("image", "", "required: the container image the job runs")
	}
	if len(s.Command) == 0 {
		return &FieldError{Flag: "", Detail: "the command to run is missing: put it after --, as in gpudra submit --gpus 1 --image IMG -- python train.py"}
	}
	if s.PriorityClass != "" {
		if _, err := strconv.Atoi(s.PriorityClass); err == nil {
			return flagErr("priority", s.PriorityClass, "on a cluster a pod's priority comes from a PriorityClass: name one (kubectl get priorityclasses), not a number as gpudra local takes")
		}
		if errs := validation.IsDNS1123Subdomain(s.PriorityClass); len(errs) > 0 {
			return flagErr("priority", s.PriorityClass, "not a PriorityClass name: %s", strings.Join(errs, "; "))
		}
	}
	if s.Duration < 0 || (s.Duration > 0 && s.Duration < time.Second) {
		return flagErr("duration", s.Duration.String(), "want at least 1s")
	}
	if s.Queue != "" {
		if errs := validation.IsDNS1123Subdomain(s.Queue); len(errs) > 0 {
			return flagErr("queue", s.Queue, "not a GpuQueue name: %s", strings.Join(errs, "; "))
		}
	}
	if err := s.validateKueue(); err != nil {
		return err
	}
	if _, _, err := s.layout(); err != nil {
		return err
	}
	return nil
}

// validateKueue checks what Kueue can admit: one queue per job, and
// claims Kueue v0.17 can count against quota (a number of devices of a
// DeviceClass: it refuses a claim with selectors, constraints or config as
// "not supported", and the job would never start).
func (s Spec) validateKueue() error {
	if s.KueueQueue == "" {
		return nil
	}
	if errs := validation.IsDNS1123Subdomain(s.KueueQueue); len(errs) > 0 {
		return flagErr("kueue-queue", s.KueueQueue, "not a LocalQueue name: %s", strings.Join(errs, "; "))
	}
	if s.Queue != "" {
		return flagErr("queue", s.Queue, "a job Kueue admits (--kueue-queue %s) waits in no GpuQueue: one job, one queue (docs/queues.md)", s.KueueQueue)
	}
	unsupported := map[string]bool{"mig": s.MIG != "", "memory": s.Memory != "", "share": s.Share != "", "same-nvlink": s.SameNVLink}
	for _, f := range []string{"mig", "memory", "share", "same-nvlink"} {
		if unsupported[f] {
			return flagErr(f, "", "not with --kueue-queue: Kueue v0.17 counts only a number of whole GPUs of a DeviceClass against quota, and refuses a claim with selectors, constraints or config as not supported (docs/queues.md)")
		}
	}
	return nil
}

// layout splits the GPUs over pods: one pod for up to GPUsPerNode, else
// as few pods as hold them, each the same size.
func (s Spec) layout() (pods, perPod int64, err error) {
	per := s.GPUsPerNode
	if per <= 0 {
		per = DefaultGPUsPerNode
	}
	if s.GPUs <= per || s.MIG != "" || s.Share != "" {
		// MIG devices and shares are parts of GPUs: one pod holds them.
		return 1, s.GPUs, nil
	}
	pods = (s.GPUs + per - 1) / per
	if s.GPUs%pods != 0 {
		return 0, 0, flagErr("gpus", strconv.FormatInt(s.GPUs, 10),
			"more than one node's %d, so the job is a gang of %d pods, which must each ask for the same number of GPUs: ask for a multiple of %d (%d or %d)",
			per, pods, pods, s.GPUs/pods*pods, (s.GPUs/pods+1)*pods)
	}
	return pods, s.GPUs / pods, nil
}

// Objects are what submit creates, in this order: the claim template,
// then the Job or (--ray) the RayJob.
type Objects struct {
	Template *resourceapi.ResourceClaimTemplate
	Job      *batchv1.Job
	RayJob   *RayJob
}

// Meta is the Job's or the RayJob's metadata.
func (o Objects) Meta() *metav1.ObjectMeta {
	if o.RayJob != nil {
		return &o.RayJob.ObjectMeta
	}
	return &o.Job.ObjectMeta
}

// Kind is "Job" or "RayJob".
func (o Objects) Kind() string {
	if o.RayJob != nil {
		return KindRayJob
	}
	return "Job"
}

// GPUPods are the pods that hold GPUs, and the template they are made
// from: the Job's pods, or the RayJob's workers.
func (o Objects) GPUPods() (int32, *corev1.PodTemplateSpec) {
	if o.RayJob != nil {
		g := &o.RayJob.Spec.RayClusterSpec.WorkerGroupSpecs[0]
		return ptr.Deref(g.Replicas, 1), &g.Template
	}
	return ptr.Deref(o.Job.Spec.Completions, 1), &o.Job.Spec.Template
}

// TemplateName is the claim template of job name.
func TemplateName(job string) string { return job + "-" + ClaimName }

// Build computes the objects of a valid Spec.
func Build(s Spec) (Objects, error) {
	if err := s.Validate(); err != nil {
		return Objects{}, err
	}
	if s.Name == "" {
		return Objects{}, flagErr("name", "", "required")
	}
	pods, perPod, _ := s.layout()
	devices, err := s.devices(perPod)
	if err != nil {
		return Objects{}, err
	}
	labels := map[string]string{LabelManagedBy: ManagedBy, LabelJob: s.Name}
	tmpl := &resourceapi.ResourceClaimTemplate{
		TypeMeta:   metav1.TypeMeta{APIVersion: resourceapi.SchemeGroupVersion.String(), Kind: "ResourceClaimTemplate"},
		ObjectMeta: metav1.ObjectMeta{Name: TemplateName(s.Name), Namespace: s.Namespace, Labels: labels},
		Spec:       resourceapi.ResourceClaimTemplateSpec{Spec: resourceapi.ResourceClaimSpec{Devices: devices}},
	}
	jobLabels := maps.Clone(labels)
	if s.KueueQueue != "" {
		// Kueue reads it on the Job (or RayJob); gpudra on the pods
		// (podTemplate), so that their gang waits in no GpuQueue.
		jobLabels[gpudrav1.LabelKueueQueue] = s.KueueQueue
	}
	if s.Ray {
		// The head waits with its workers: one gang of 1 + pods.
		return Objects{Template: tmpl, RayJob: s.rayJob(jobLabels, pods, perPod, tmpl.Name)}, nil
	}
	job := &batchv1.Job{
		TypeMeta:   metav1.TypeMeta{APIVersion: batchv1.SchemeGroupVersion.String(), Kind: "Job"},
		ObjectMeta: metav1.ObjectMeta{Name: s.Name, Namespace: s.Namespace, Labels: jobLabels},
		Spec: batchv1.JobSpec{
			Parallelism: ptr.To(int32(pods)), Completions: ptr.To(int32(pods)),
			CompletionMode: ptr.To(batchv1.IndexedCompletion),
			// A gang's pod that fails fails the job: a replacement would
			// start alone, outside its gang.
			BackoffLimit: ptr.To[int32](0),
			Template:     s.podTemplate(ContainerName, pods, tmpl.Name),
		},
	}
	return Objects{Template: tmpl, Job: job}, nil
}

// podTemplate is a gang pod of gangSize with one container that holds
// the GPUs of the claim template (none when template is "": a Ray head).
func (s Spec) podTemplate(container string, gangSize int64, template string) corev1.PodTemplateSpec {
	podLabels := map[string]string{LabelManagedBy: ManagedBy, LabelJob: s.Name, gpudrav1.LabelGang: s.Name}
	// Every submitted job is a gang, one pod or many: gpudra's queue
	// orders gangs (a plain pod goes to the scheduler at once, in no
	// queue), and a gang of several pods starts all or nothing.
	podAnnotations := map[string]string{gpudrav1.AnnotationGangSize: strconv.FormatInt(gangSize, 10)}
	if s.Queue != "" {
		podAnnotations[gpudrav1.AnnotationQueue] = s.Queue
	}
	if s.KueueQueue != "" {
		podLabels[gpudrav1.LabelKueueQueue] = s.KueueQueue
	}
	pod := corev1.PodSpec{
		RestartPolicy:     corev1.RestartPolicyNever,
		PriorityClassName: s.PriorityClass,
		Containers:        []corev1.Container{{Name: container, Image: s.Image, Command: slices.Clone(s.Command)}},
	}
	if template != "" {
		pod.Containers[0].Resources.Claims = []corev1.ResourceClaim{{Name: ClaimName}}
		pod.ResourceClaims = []corev1.PodResourceClaim{{Name: ClaimName, ResourceClaimTemplateName: ptr.To(template)}}
		if _, isFraction, _ := s.Fraction(); isFraction {
			pod.Tolerations = []corev1.Toleration{{Key: FractionalToleration, Operator: corev1.TolerationOpExists, Effect: corev1.TaintEffectNoSchedule}}
		}
	}
	if s.Duration > 0 {
		podAnnotations[gpudrav1.AnnotationDuration] = s.Duration.String()
		// Counted from the pod's start on its node, not from the
		// submission: the time in the queue does not count.
		pod.ActiveDeadlineSeconds = ptr.To(int64(math.Ceil(s.Duration.Seconds())))
	}
	return corev1.PodTemplateSpec{ObjectMeta: metav1.ObjectMeta{Labels: podLabels, Annotations: podAnnotations}, Spec: pod}
}

// devices is one pod's claim: the words of gpudra local run
// (local.Devices), plus the cluster's sharing config.
func (s Spec) devices(perPod int64) (resourceapi.DeviceClaim, error) {
	dc, err := local.Devices(local.Ask{GPUs: perPod, MIGProfile: s.MIG, SameNVLink: s.SameNVLink, Memory: s.Memory})
	if err != nil {
		return dc, err
	}
	req := dc.Requests[0].Exactly
	fraction, isFraction, _ := s.Fraction()
	var cfg *gpuapi.GpuConfig
	switch {
	case isFraction:
		// As examples/fractional: a device published for shares, and
		// capacity of it. The share is of the smallest supported GPU's
		// memory and SMs, so that it fits on every one.
		memMiB, sms := SmallestGPU()
		req.Selectors = append(req.Selectors, celSelector(`device.attributes["gpu.gpudra.dev"].sharing == "fractional"`))
		req.Capacity = &resourceapi.CapacityRequirements{Requests: map[resourceapi.QualifiedName]resource.Quantity{
			"memory":          *resource.NewQuantity(int64(math.Floor(fraction*float64(memMiB)))<<20, resource.BinarySI),
			"multiprocessors": *resource.NewQuantity(int64(math.Ceil(fraction*float64(sms))), resource.DecimalSI),
		}}
	case s.Share == ShareMPS:
		// As examples/mps: a GPU not published for fractional shares.
		req.Selectors = append(req.Selectors, celSelector(`!("sharing" in device.attributes["gpu.gpudra.dev"])`))
		mps := &gpuapi.MPSConfig{}
		if s.MPSThreadPercentage > 0 {
			mps.ActiveThreadPercentage = ptr.To(s.MPSThreadPercentage)
		}
		if s.MPSPinnedMemory != "" {
			q := resource.MustParse(s.MPSPinnedMemory)
			mps.PinnedMemoryLimit = &q
		}
		cfg = &gpuapi.GpuConfig{Sharing: &gpuapi.Sharing{Strategy: gpuapi.MPS, MPS: mps}}
	case s.Share == ShareTimeSlicing:
		cfg = &gpuapi.GpuConfig{Sharing: &gpuapi.Sharing{Strategy: gpuapi.TimeSlicing}}
	}
	if cfg != nil {
		cfg.TypeMeta = metav1.TypeMeta{APIVersion: gpuapi.APIVersion, Kind: gpuapi.Kind}
		raw, err := yaml.Marshal(cfg)
		if err != nil {
			return dc, err
		}
		js, err := yaml.YAMLToJSON(raw)
		if err != nil {
			return dc, err
		}
		dc.Config = append(dc.Config, resourceapi.DeviceClaimConfiguration{
			Requests: []string{dc.Requests[0].Name},
			DeviceConfiguration: resourceapi.DeviceConfiguration{Opaque: &resourceapi.OpaqueDeviceConfiguration{
				Driver: gpuapi.GroupName, Parameters: runtime.RawExtension{Raw: js}}},
		})
	}
	return dc, nil
}

func celSelector(expr string) resourceapi.DeviceSelector {
	return resourceapi.DeviceSelector{CEL: &resourceapi.CELDeviceSelector{Expression: expr}}
}
