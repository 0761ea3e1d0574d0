package submit

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"

	gpuapi "github.com/gpudra/gpudra/api/gpu/v1alpha1"
	gpudrav1 "github.com/gpudra/gpudra/api/gpudra/v1alpha1"
)

func valid() Spec {
	return Spec{Name: "train", Namespace: "research", GPUs: 2, Image: "cuda", Command: []string{"python", "train.py"}}
}

// TestValidateNamesTheFlag: each bad input is refused before anything is
// built, with the flag it came from.
func TestValidateNamesTheFlag(t *testing.T) {
	for name, tc := range map[string]struct {
		change func(*Spec)
		want   string
	}{
		"no GPUs":               {func(s *Spec) { s.GPUs = 0 }, "--gpus 0: at least 1"},
		"negative GPUs":         {func(s *Spec) { s.GPUs = -2 }, "--gpus -2: at least 1"},
		"unknown MIG profile":   {func(s *Spec) { s.MIG = "5g.40gb" }, "--mig 5g.40gb: not a MIG profile of the supported GPUs"},
		"share above 1":         {func(s *Spec) { s.GPUs = 1; s.Share = "1.5" }, "--share 1.5: a fraction of one GPU must be more than 0 and at most 1"},
		"share of 0":            {func(s *Spec) { s.GPUs = 1; s.Share = "0" }, "--share 0: a fraction of one GPU must be more than 0"},
		"share not a number":    {func(s *Spec) { s.Share = "half" }, "--share half: want a fraction of one GPU in (0, 1]"},
		"MIG with a share":      {func(s *Spec) { s.GPUs = 1; s.MIG = "1g.10gb"; s.Share = "0.5" }, "--share 0.5: a fraction of a GPU and a MIG device (--mig 1g.10gb) exclude each other"},
		"share of two GPUs":     {func(s *Spec) { s.Share = "0.5" }, "--share 0.5: a fractional share is part of one GPU: --gpus must be 1"},
		"no image":              {func(s *Spec) { s.Image = "" }, "--image: required"},
		"no command":            {func(s *Spec) { s.Command = nil }, "the command to run is missing: put it after --"},
		"numeric priority":      {func(s *Spec) { s.PriorityClass = "10" }, "--priority 10: on a cluster a pod's priority comes from a PriorityClass"},
		"bad queue name":        {func(s *Spec) { s.Queue = "Team_A" }, "--queue Team_A: not a GpuQueue name"},
		"bad name":              {func(s *Spec) { s.Name = "Train!" }, "--name Train!:"},
		"sub-second duration":   {func(s *Spec) { s.Duration = time.Millisecond }, "--duration 1ms: want at least 1s"},
		"uneven gang":           {func(s *Spec) { s.GPUs = 9 }, "--gpus 9: more than one node's 8, so the job is a gang of 2 pods"},
		"MPS limit without MPS": {func(s *Spec) { s.MPSThreadPercentage = 50 }, "--mps-thread-percentage: only with --share mps"},
		"bad memory":            {func(s *Spec) { s.Memory = "lots" }, "--memory lots:"},
		"Kueue and a GpuQueue":  {func(s *Spec) { s.KueueQueue = "gpus"; s.Queue = "research" }, "--queue research: a job Kueue admits (--kueue-queue gpus) waits in no GpuQueue"},
		"Kueue with NVLink":     {func(s *Spec) { s.KueueQueue = "gpus"; s.SameNVLink = true }, "--same-nvlink: not with --kueue-queue: Kueue v0.17 counts only"},
		"Kueue with MIG":        {func(s *Spec) { s.KueueQueue = "gpus"; s.MIG = "1g.10gb" }, "--mig: not with --kueue-queue"},
		"Kueue with a share":    {func(s *Spec) { s.KueueQueue = "gpus"; s.GPUs = 1; s.Share = "time-slicing" }, "--share: not with --kueue-queue"},
		"bad LocalQueue name":   {func(s *Spec) { s.KueueQueue = "Team_A" }, "--kueue-queue Team_A: not a LocalQueue name"},
	} {
		t.Run(name, func(t *testing.T) {
			s := valid()
			tc.change(&s)
			require.ErrorContains(t, s.Validate(), tc.want)
			_, err := Build(s)
			require.ErrorContains(t, err, tc.want, "Build refuses it too")
		})
	}
	require.NoError(t, valid().Validate())
}

func TestBuild(t *testing.T) {
	nvlink := resourceapi.FullyQualifiedName("gpu.gpudra.dev/nvlinkDomain")
	for name, tc := range map[string]struct {
		change func(*Spec)
		check  func(t *testing.T, o Objects)
	}{
		"whole GPUs in one NVLink domain, one pod": {func(s *Spec) { s.SameNVLink = true }, func(t *testing.T, o Objects) {
			req := o.Template.Spec.Spec.Devices.Requests[0].Exactly
			assert.Equal(t, "gpu.gpudra.dev", req.DeviceClassName)
			assert.Equal(t, int64(2), req.Count)
			require.Len(t, o.Template.Spec.Spec.Devices.Constraints, 1)
			assert.Equal(t, &nvlink, o.Template.Spec.Spec.Devices.Constraints[0].MatchAttribute)
			assert.Equal(t, int32(1), *o.Job.Spec.Completions)
			assert.Equal(t, "1", o.Job.Spec.Template.Annotations[gpudrav1.AnnotationGangSize], "a single pod is a gang of one: it waits in gpudra's queue")
		}},
		"16 GPUs on 8-GPU nodes: a gang of two pods of 8": {func(s *Spec) { s.GPUs = 16; s.SameNVLink = true }, func(t *testing.T, o Objects) {
			assert.Equal(t, int64(8), o.Template.Spec.Spec.Devices.Requests[0].Exactly.Count)
			assert.Equal(t, int32(2), *o.Job.Spec.Completions)
			assert.Equal(t, int32(2), *o.Job.Spec.Parallelism)
			assert.Equal(t, batchv1.IndexedCompletion, *o.Job.Spec.CompletionMode)
			assert.Equal(t, "2", o.Job.Spec.Template.Annotations[gpudrav1.AnnotationGangSize])
			assert.Equal(t, "train", o.Job.Spec.Template.Labels[gpudrav1.LabelGang])
			assert.Equal(t, int32(0), *o.Job.Spec.BackoffLimit)
		}},
		"12 GPUs: two pods of 6": {func(s *Spec) { s.GPUs = 12 }, func(t *testing.T, o Objects) {
			assert.Equal(t, int64(6), o.Template.Spec.Spec.Devices.Requests[0].Exactly.Count)
			assert.Equal(t, int32(2), *o.Job.Spec.Completions)
		}},
		"MIG profile": {func(s *Spec) { s.GPUs = 1; s.MIG = "3g.40gb" }, func(t *testing.T, o Objects) {
			req := o.Template.Spec.Spec.Devices.Requests[0].Exactly
			assert.Equal(t, "mig.gpudra.dev", req.DeviceClassName)
			assert.Equal(t, `device.attributes["gpu.gpudra.dev"].migProfile == "3g.40gb"`, req.Selectors[0].CEL.Expression)
		}},
		"a quarter of a GPU": {func(s *Spec) { s.GPUs = 1; s.Share = "0.25" }, func(t *testing.T, o Objects) {
			req := o.Template.Spec.Spec.Devices.Requests[0].Exactly
			assert.Equal(t, `device.attributes["gpu.gpudra.dev"].sharing == "fractional"`, req.Selectors[0].CEL.Expression)
			mem := req.Capacity.Requests["memory"]
			sms := req.Capacity.Requests["multiprocessors"]
			assert.Equal(t, int64(20389)<<20, mem.Value(), "a quarter of an H100 80GB's 81559Mi")
			assert.Equal(t, int64(29), sms.Value(), "a quarter of the fewest SMs (H100 PCIe: 114), rounded up")
			assert.Equal(t, FractionalToleration, o.Job.Spec.Template.Spec.Tolerations[0].Key)
		}},
		"MPS with limits": {func(s *Spec) { s.GPUs = 1; s.Share = ShareMPS; s.MPSThreadPercentage = 50; s.MPSPinnedMemory = "40Gi" }, func(t *testing.T, o Objects) {
			dc := o.Template.Spec.Spec.Devices
			assert.Equal(t, `!("sharing" in device.attributes["gpu.gpudra.dev"])`, dc.Requests[0].Exactly.Selectors[0].CEL.Expression)
			require.Len(t, dc.Config, 1)
			cfg, err := gpuapi.Decode(dc.Config[0].Opaque.Parameters.Raw)
			require.NoError(t, err, "the plugin's own decoding accepts it")
			assert.Equal(t, gpuapi.MPS, cfg.Sharing.Strategy)
			assert.Equal(t, int32(50), *cfg.Sharing.MPS.ActiveThreadPercentage)
			assert.Equal(t, "40Gi", cfg.Sharing.MPS.PinnedMemoryLimit.String())
		}},
		"time-slicing": {func(s *Spec) { s.Share = ShareTimeSlicing }, func(t *testing.T, o Objects) {
			cfg, err := gpuapi.Decode(o.Template.Spec.Spec.Devices.Config[0].Opaque.Parameters.Raw)
			require.NoError(t, err)
			assert.Equal(t, gpuapi.TimeSlicing, cfg.Sharing.Strategy)
		}},
		"Kueue's LocalQueue": {func(s *Spec) { s.KueueQueue = "gpus"; s.GPUs = 16 }, func(t *testing.T, o Objects) {
			assert.Equal(t, "gpus", o.Job.Labels[gpudrav1.LabelKueueQueue], "Kueue reads it on the Job")
			assert.Equal(t, "gpus", o.Job.Spec.Template.Labels[gpudrav1.LabelKueueQueue], "gpudra on the gang's pods")
			assert.NotContains(t, o.Job.Spec.Template.Annotations, gpudrav1.AnnotationQueue)
			assert.NotContains(t, o.Template.Labels, gpudrav1.LabelKueueQueue, "the claim template is no job of Kueue's")
			req := o.Template.Spec.Spec.Devices.Requests[0].Exactly
			assert.Empty(t, req.Selectors, "Kueue counts a claim without selectors only")
			assert.Empty(t, o.Template.Spec.Spec.Devices.Constraints)
			assert.Equal(t, int64(8), req.Count)
		}},
		"queue, priority and duration": {func(s *Spec) { s.Queue = "team-a"; s.PriorityClass = "high"; s.Duration = 90 * time.Minute }, func(t *testing.T, o Objects) {
			tmpl := o.Job.Spec.Template
			assert.Equal(t, "team-a", tmpl.Annotations[gpudrav1.AnnotationQueue])
			assert.Equal(t, "1h30m0s", tmpl.Annotations[gpudrav1.AnnotationDuration])
			assert.Equal(t, int64(5400), *tmpl.Spec.ActiveDeadlineSeconds, "counted from the pod's start, not its time in the queue")
			assert.Nil(t, o.Job.Spec.ActiveDeadlineSeconds, "the Job's deadline would count the time in the queue")
			assert.Equal(t, "high", tmpl.Spec.PriorityClassName)
		}},
	} {
		t.Run(name, func(t *testing.T) {
			s := valid()
			tc.change(&s)
			o, err := Build(s)
			require.NoError(t, err)
			assert.Equal(t, "train-gpus", o.Template.Name)
			assert.Equal(t, "research", o.Template.Namespace)
			assert.Equal(t, ManagedBy, o.Job.Labels[LabelManagedBy])
			pod := o.Job.Spec.Template.Spec
			assert.Equal(t, corev1.RestartPolicyNever, pod.RestartPolicy)
			assert.Equal(t, "train-gpus", *pod.ResourceClaims[0].ResourceClaimTemplateName)
			assert.Equal(t, []string{"python", "train.py"}, pod.Containers[0].Command)
			assert.Equal(t, ClaimName, pod.Containers[0].Resources.Claims[0].Name)
			tc.check(t, o)
		})
	}
}
