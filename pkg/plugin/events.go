package plugin

import (
	"context"
	"errors"
	"fmt"
	"strings"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/tools/events"
	"k8s.io/klog/v2"

	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/sharing"
)

// Reasons of the Events the plugin records regarding its Node.
const (
	// ReasonCheckpointCorrupt and ReasonCheckpointLost: the node state was
	// rebuilt from the node and the API (the note names the adopted claims).
	ReasonCheckpointCorrupt = "CheckpointCorrupt"
	ReasonCheckpointLost    = "CheckpointLost"
	// ReasonGPUUnhealthy: a GPU's devices were tainted; ReasonGPURecovered:
	// the taint went.
	ReasonGPUUnhealthy = "GPUUnhealthy"
	ReasonGPURecovered = "GPURecovered"
	// ReasonMPSServerRestarted: the MPS server of prepared claims was gone
	// and was started again; ReasonMPSServerRestartFailed: it could not be.
	ReasonMPSServerRestarted     = "MPSServerRestarted"
	ReasonMPSServerRestartFailed = "MPSServerRestartFailed"
	// ReasonMIGCreationFailed: a prepare could not create a MIG device.
	ReasonMIGCreationFailed = "MIGCreationFailed"
)

// EventsReportingController is the reportingController of the plugin's
// Events.
const EventsReportingController = "gpu.gpudra.dev/kubelet-plugin"

// maxNote is the API server's limit on an events.k8s.io/v1 note.
const maxNote = 1024

// nodeEvents records Events regarding the plugin's Node through client-go's
// events.k8s.io/v1 recorder: writes happen in the background, are retried
// while the API server is away, and repeats are folded into a series by
// the library instead of one object each. A nil *nodeEvents records
// nothing (drivers that tests build without a client).
type nodeEvents struct {
	broadcaster events.EventBroadcaster
	recorder    events.EventRecorderLogger
	node        corev1.ObjectReference
}

// startNodeEvents starts the recorder; it stops when ctx ends or at
// shutdown. The Node's UID is read once, so that `kubectl describe node`
// finds the Events; without it they still name the Node.
func startNodeEvents(ctx context.Context, client kubernetes.Interface, nodeName string) (*nodeEvents, error) {
	logger := klog.FromContext(ctx)
	ref := corev1.ObjectReference{APIVersion: "v1", Kind: "Node", Name: nodeName}
	if node, err := client.CoreV1().Nodes().Get(ctx, nodeName, metav1.GetOptions{}); err != nil {
		logger.Error(err, "Could not read the Node: its Events will name it without its UID", "node", nodeName)
	} else {
		ref.UID = node.UID
	}
	b := events.NewBroadcaster(&events.EventSinkImpl{Interface: client.EventsV1()})
	if err := b.StartRecordingToSinkWithContext(ctx); err != nil {
		return nil, fmt.Errorf("start recording Events: %w", err)
	}
	// A plugin that fails to start, or whose context ends without Stop,
	// leaves no broadcaster goroutine behind.
	go func() {
		<-ctx.Done()
		b.Shutdown()
	}()
	return &nodeEvents{broadcaster: b, recorder: b.NewRecorder(scheme.Scheme, EventsReportingController).WithLogger(logger), node: ref}, nil
}

// shutdown stops the recorder; Events not written yet are dropped.
func (e *nodeEvents) shutdown() {
	if e != nil {
		e.broadcaster.Shutdown()
	}
}

// record records an Event regarding the Node. part names what on the node
// it is about (a GPU, an MPS server) as the reference's field path: the
// library folds Events with the same regarding object, related object,
// reason and action into one series whatever their notes say, so without
// it a second GPU's fault would only count up the first GPU's Event.
// `kubectl get events -o wide` shows it as the subobject. related is nil
// or the object the Event also concerns (a claim).
func (e *nodeEvents) record(part string, related runtime.Object, eventType, reason, action, note string) {
	if e == nil {
		return
	}
	regarding := e.node
	regarding.FieldPath = part
	if len(note) > maxNote {
		note = note[:maxNote-3] + "..."
	}
	e.recorder.Eventf(&regarding, related, eventType, reason, action, "%s", note)
}

// checkpointRebuilt records the rebuild of a lost or corrupt checkpoint.
func (e *nodeEvents) checkpointRebuilt(r RebuildReport) {
	reason := ReasonCheckpointLost
	if r.MovedAside != "" {
		reason = ReasonCheckpointCorrupt
	}
	e.record("", nil, corev1.EventTypeWarning, reason, "RebuildCheckpoint", r.Message())
}

// gpuHealth records that a GPU's devices were tainted (ev is the event
// that decided it) or untainted (ev is the recovery). device is the GPU's
// device name, or its UUID when the driver never published it.
func (e *nodeEvents) gpuHealth(ev nvdevice.HealthEvent, device, taint string) {
	what := "GPU " + device
	if device != ev.GPUUUID {
		what += " (" + ev.GPUUUID + ")"
	}
	part := "devices{" + device + "}"
	if ev.Kind == nvdevice.HealthRecovered {
		e.record(part, nil, corev1.EventTypeNormal, ReasonGPURecovered, "UntaintDevices",
			fmt.Sprintf("%s recovered (%s): the taint %s was removed from its devices", what, ev.Message, UnhealthyTaintKey))
		return
	}
	cause := string(ev.Kind)
	if ev.Kind == nvdevice.HealthXID {
		cause = fmt.Sprintf("XID %d", ev.XID)
	}
	if ev.Message != "" {
		cause += " (" + ev.Message + ")"
	}
	e.record(part, nil, corev1.EventTypeWarning, ReasonGPUUnhealthy, "TaintDevices",
		fmt.Sprintf("%s is unhealthy: %s; its devices are tainted %s; %s", what, cause, taint, recoveryNote(ev.Recovery())))
}

// recoveryNote tells an admin what the GPU needs before the taint goes.
func recoveryNote(r nvdevice.Recovery) string {
	switch r {
	case nvdevice.RecoverGPUReset:
		return "it needs a GPU reset (nvidia-smi -r) before it is trusted again"
	case nvdevice.RecoverNodeReboot:
		return "it needs a reboot of the node before it is trusted again"
	}
	return "it is trusted again once it answers and has been quiet for a while"
}

// mpsRestarted records that the MPS server of prepared claims was gone and
// was started again (err nil), or could not be.
func (e *nodeEvents) mpsRestarted(s sharing.MPSServer, err error) {
	part := "mpsServers{" + s.Key + "}"
	devices := strings.Join(s.Devices, ",")
	if err != nil {
		e.record(part, nil, corev1.EventTypeWarning, ReasonMPSServerRestartFailed, "StartMPSServer",
			fmt.Sprintf("MPS server %s of prepared claims (devices %s) is gone and could not be started again: %v", s.Key, devices, err))
		return
	}
	e.record(part, nil, corev1.EventTypeNormal, ReasonMPSServerRestarted, "StartMPSServer",
		fmt.Sprintf("MPS server %s of prepared claims (devices %s) was gone and was started again; its clients must reconnect", s.Key, devices))
}

// migCreateError is a prepare that failed creating a MIG device; the
// Driver records an Event for it.
type migCreateError struct {
	device string
	err    error
}

func (e *migCreateError) Error() string { return fmt.Sprintf("device %s: %v", e.device, e.err) }
func (e *migCreateError) Unwrap() error { return e.err }

// prepareFailed records an Event for a prepare error an admin must see on
// the node, not only in the claim's pod: a MIG device the GPU refused.
func (e *nodeEvents) prepareFailed(claim *resourceapi.ResourceClaim, err error) {
	var mig *migCreateError
	if !errors.As(err, &mig) {
		return
	}
	related := &corev1.ObjectReference{APIVersion: resourceapi.SchemeGroupVersion.String(), Kind: "ResourceClaim",
		Namespace: claim.Namespace, Name: claim.Name, UID: claim.UID}
	e.record("", related, corev1.EventTypeWarning, ReasonMIGCreationFailed, "CreateMIGDevice",
		fmt.Sprintf("claim %s/%s: creating MIG device %s failed: %v", claim.Namespace, claim.Name, mig.device, mig.err))
}
