package nodeagent

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"time"

	oci "github.com/opencontainers/runtime-spec/specs-go"
	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	typedcorev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	corelisters "k8s.io/client-go/listers/core/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/record"
	"k8s.io/client-go/util/workqueue"
	"k8s.io/klog/v2"
	pluginregistrationv1 "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
	"k8s.io/kubernetes/pkg/kubelet/cm/dra"
	"k8s.io/kubernetes/pkg/kubelet/config"
	"k8s.io/kubernetes/pkg/kubelet/pluginmanager"

	"github.com/gpudra/gpudra/devcluster/imagemode"
	"github.com/gpudra/gpudra/devcluster/noderuntime"
)

// ContainersAnnotation is set by the devcluster kubelet on every pod it
// starts: a JSON map from container name to what the container would get
// (noderuntime.ContainerView). Pods are not really run, except process pods
// (processpods.go).
const ContainersAnnotation = "devcluster.gpudra.dev/containers"

// Event reasons, as the real kubelet records them.
const (
	reasonFailedPrepare   = "FailedPrepareDynamicResources"
	reasonFailedUnprepare = "FailedUnprepareDynamicResources"
	reasonStarted         = "Started"
	reasonFailedStart     = "Failed"
	reasonSimLoadIgnored  = "SimLoadIgnored"
	// reasonConfigError is a container's waiting reason when the kubelet
	// cannot configure it.
	reasonConfigError = "CreateContainerConfigError"
)

// kubelet plays the kubelet's part for one simulated node with the
// kubelet's own code where it matters: the plugin manager watches the
// registry directory and registers DRA plugins over pluginregistration/v1,
// and the DRA manager (k8s.io/kubernetes/pkg/kubelet/cm/dra) prepares and
// unprepares claims over dra/v1 and hands out CDI device ids per container.
// The stand-in part is small: it resolves those ids with the CDI library
// and starts the containers in runc (or only resolves them), records the
// result on the pod, and sets the pod Running; a pod whose containers
// exit (termination.go) goes to Succeeded or Failed and its claims are
// unprepared. Process pods (the plugin's MPS servers) are the
// exception: their container runs in-process.
type kubelet struct {
	node string
	// client is the kubelet's own identity (system:node:<node>); reporter
	// the harness's, for what devcluster records on a pod and no kubelet
	// writes (ContainersAnnotation).
	client, reporter kubernetes.Interface
	cdiDir           string
	// devices names the GPUs a container's device nodes give it.
	devices     noderuntime.DeviceIdentifier
	hostDevices noderuntime.HostDevice
	devRoot     string
	dra         *dra.Manager
	// dm is the kubelet's device manager (deviceplugin.go), on every node
	// as on a real one; nil only without kubeletDirs.DevicePlugins.
	dm       *deviceManager
	pods     corelisters.PodLister
	queue    workqueue.TypedRateLimitingInterface[string]
	recorder record.EventRecorder

	mu sync.Mutex
	// gone holds pods deleted without grace (force), so that their claims
	// are unprepared at once rather than by the DRA manager's 60 s sweep.
	gone map[string]*v1.Pod
	// procs are the running containers of process pods, by pod UID.
	procs map[types.UID]*processPod
	// runtime runs the other pods' containers for real (nil: their specs
	// are only resolved), through runner; containers are the ones
	// running, by pod UID; tries counts their starts (newContainerID).
	runtime    *noderuntime.OCIRuntime
	runner     containerRunner
	containers map[types.UID][]runningContainer
	tries      uint64
	// logRoot is the node's /var/log, where the containers' log links are
	// kept ("": none).
	logRoot string
	// sims lists containers' processes on the node's simulated devices
	// (SimLoadEnv); nil where the node's GPUs are not simulated.
	sims simProcesses
}

// kubeletWorkers is how many pods the kubelet syncs at once. More than one:
// preparing a claim can wait for another pod of the node (the MPS server
// pod the plugin creates during NodePrepareResources) to run. The queue
// never hands one pod to two workers at once.
const kubeletWorkers = 4

type kubeletDirs struct {
	Registry string // plugins_registry
	State    string // the DRA manager's checkpoint
	CDI      string
	// Devices names the GPUs a container's device nodes give it.
	Devices noderuntime.DeviceIdentifier
	// HostDevices are the node's device nodes, for a device plugin's
	// DeviceSpecs.
	HostDevices noderuntime.HostDevice
	// DevRoot is where the node's /dev is: "/" for real GPUs, the node's
	// directory for a simulated machine (its dev/ holds the device nodes).
	// A privileged container gets its NVIDIA device nodes.
	DevRoot string
	// DevicePlugins, when set, runs the kubelet's device manager with its
	// registration socket there.
	DevicePlugins string
	// PodResources, when set, is the socket of the kubelet's pod-resources
	// API (podresources.go).
	PodResources string
	// Runtime, when set, runs pods' containers as real containers.
	Runtime *noderuntime.OCIRuntime
	// Logs is the node's /var/log: the containers' log files and links.
	Logs string
	// Processes, when set, takes the containers' declared loads
	// (SimLoadEnv): the node's simulated machine.
	Processes simProcesses
}

// startKubelet runs the node's kubelet until ctx ends; the returned channel
// closes when it has stopped.
func startKubelet(ctx context.Context, node string, client, reporter kubernetes.Interface, dirs kubeletDirs) (*kubelet, <-chan struct{}, error) {
	logger := klog.LoggerWithValues(klog.LoggerWithName(klog.FromContext(ctx), "kubelet"), "node", node)
	ctx = klog.NewContext(ctx, logger)

	broadcaster := record.NewBroadcaster(record.WithContext(ctx))
	broadcaster.StartRecordingToSink(&typedcorev1.EventSinkImpl{Interface: client.CoreV1().Events("")})
	recorder := broadcaster.NewRecorder(scheme.Scheme, v1.EventSource{Component: "kubelet", Host: node})

	manager, err := dra.NewManager(logger, client, dirs.State)
	if err != nil {
		broadcaster.Shutdown()
		return nil, nil, fmt.Errorf("node %s: DRA manager: %w", node, err)
	}
	factory := informers.NewSharedInformerFactoryWithOptions(client, 0, informers.WithTweakListOptions(func(o *metav1.ListOptions) {
		o.FieldSelector = fields.OneTermEqualSelector("spec.nodeName", node).String()
	}))
	podInformer := factory.Core().V1().Pods()
	k := &kubelet{
		node: node, client: client, reporter: reporter, cdiDir: dirs.CDI, devices: dirs.Devices, hostDevices: dirs.HostDevices, devRoot: dirs.DevRoot, dra: manager, pods: podInformer.Lister(),
		queue: workqueue.NewTypedRateLimitingQueueWithConfig(
			workqueue.NewTypedItemExponentialFailureRateLimiter[string](100*time.Millisecond, 5*time.Second),
			workqueue.TypedRateLimitingQueueConfig[string]{Name: "devcluster-kubelet-" + node}),
		recorder: recorder,
		gone:     map[string]*v1.Pod{},
		procs:    map[types.UID]*processPod{},
		runtime:  dirs.Runtime, containers: map[types.UID][]runningContainer{},
		logRoot: dirs.Logs, sims: dirs.Processes,
	}
	if dirs.Runtime != nil {
		k.runner = dirs.Runtime
	}
	if _, err := podInformer.Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { k.enqueue(obj) },
		UpdateFunc: func(_, obj any) { k.enqueue(obj) },
		DeleteFunc: func(obj any) {
			if tomb, ok := obj.(cache.DeletedFinalStateUnknown); ok {
				obj = tomb.Obj
			}
			if pod, ok := obj.(*v1.Pod); ok {
				key := cache.MetaObjectToName(pod).String()
				k.mu.Lock()
				k.gone[key] = pod
				k.mu.Unlock()
				k.queue.Add(key)
			}
		},
	}); err != nil {
		broadcaster.Shutdown()
		return nil, nil, err
	}

	allReady := config.NewSourcesReady(func(sets.Set[string]) bool { return true })
	activePods := func() []*v1.Pod {
		pods, _ := k.pods.List(labels.Everything())
		active := pods[:0:0]
		for _, p := range pods {
			if p.DeletionTimestamp == nil && p.Status.Phase != v1.PodSucceeded && p.Status.Phase != v1.PodFailed {
				active = append(active, p)
			}
		}
		return active
	}
	getNode := func(ctx context.Context) (*v1.Node, error) {
		return client.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{})
	}
	if err := manager.Start(ctx, activePods, getNode, allReady); err != nil {
		broadcaster.Shutdown()
		return nil, nil, fmt.Errorf("node %s: start DRA manager: %w", node, err)
	}
	plugins := pluginmanager.NewPluginManager(dirs.Registry, recorder)
	plugins.AddHandler(pluginregistrationv1.DRAPlugin, manager.GetWatcherHandler())
	if dirs.DevicePlugins != "" {
		if k.dm, err = startDeviceManager(logger, dirs.DevicePlugins, activePods, allReady); err != nil {
			manager.Stop()
			broadcaster.Shutdown()
			return nil, nil, fmt.Errorf("node %s: %w", node, err)
		}
		plugins.AddHandler(pluginregistrationv1.DevicePlugin, k.dm.m.GetWatcherHandler())
	}
	// devcluster pod-resources: the kubelet's pod-resources API.
	var podResourcesStopped func()
	if dirs.PodResources != "" {
		if podResourcesStopped, err = k.servePodResources(ctx, dirs.PodResources, activePods); err != nil {
			if k.dm != nil {
				_ = k.dm.m.Stop(logger)
			}
			manager.Stop()
			broadcaster.Shutdown()
			return nil, nil, fmt.Errorf("node %s: %w", node, err)
		}
	}
	// end devcluster pod-resources

	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(2 + kubeletWorkers)
	if k.dm != nil {
		wg.Add(1)
		go func() { defer wg.Done(); k.syncNodeStatus(ctx) }()
	}
	if k.runner != nil {
		wg.Add(1)
		go func() { defer wg.Done(); k.watchExits(ctx) }()
	}
	go func() { defer wg.Done(); plugins.Run(ctx, allReady, ctx.Done()) }()
	factory.Start(ctx.Done())
	factory.WaitForCacheSync(ctx.Done())
	go func() { defer wg.Done(); <-ctx.Done(); k.queue.ShutDown() }()
	for range kubeletWorkers {
		go func() {
			defer wg.Done()
			for k.processNext(ctx) {
			}
		}()
	}
	go func() {
		wg.Wait()
		// Their contexts ended with ctx; wait for them to quit.
		k.stopAllProcesses(ctx)
		// ctx has ended: runc still has to run to stop the containers.
		k.stopAllContainers(context.WithoutCancel(ctx))
		if podResourcesStopped != nil {
			podResourcesStopped()
		}
		factory.Shutdown()
		if k.dm != nil {
			_ = k.dm.m.Stop(logger)
		}
		manager.Stop()
		broadcaster.Shutdown()
		close(done)
	}()
	return k, done, nil
}

func (k *kubelet) enqueue(obj any) {
	if pod, ok := obj.(*v1.Pod); ok {
		k.queue.Add(cache.MetaObjectToName(pod).String())
	}
}

func (k *kubelet) processNext(ctx context.Context) bool {
	key, shutdown := k.queue.Get()
	if shutdown {
		return false
	}
	defer k.queue.Done(key)
	if err := k.sync(ctx, key); err != nil {
		if ctx.Err() == nil {
			klog.FromContext(ctx).V(2).Info("Pod not ready yet, will retry", "pod", key, "err", err)
		}
		k.queue.AddRateLimited(key)
		return true
	}
	k.queue.Forget(key)
	return true
}

func (k *kubelet) sync(ctx context.Context, key string) error {
	logger := klog.LoggerWithValues(klog.FromContext(ctx), "pod", key)
	ctx = klog.NewContext(ctx, logger)
	namespace, name, err := cache.SplitMetaNamespaceKey(key)
	if err != nil {
		return nil
	}
	pod, err := k.pods.Pods(namespace).Get(name)
	if apierrors.IsNotFound(err) {
		return k.syncGone(ctx, key, "")
	}
	if err != nil {
		return err
	}
	// A pod of this name force-deleted and created again before this sync:
	// the old one is stopped first.
	if err := k.syncGone(ctx, key, pod.UID); err != nil {
		return err
	}

	if pod.Annotations[imagemode.PodAnnotation] != "" {
		// The image runner's (package imagemode), its deletion too: it confirms
		// one once the container is gone.
		return nil
	}
	if pod.DeletionTimestamp != nil {
		// The pod is stopping: stop its process if it has one, unprepare,
		// then confirm the deletion as the kubelet does once the
		// containers are gone.
		k.stopProcess(ctx, pod.UID)
		k.stopContainers(ctx, pod.UID)
		if err := k.dra.UnprepareResources(ctx, pod); err != nil {
			k.recorder.Event(pod, v1.EventTypeWarning, reasonFailedUnprepare, err.Error())
			return err
		}
		err := k.client.CoreV1().Pods(pod.Namespace).Delete(ctx, pod.Name, metav1.DeleteOptions{
			GracePeriodSeconds: ptrTo[int64](0), Preconditions: &metav1.Preconditions{UID: &pod.UID}})
		if err != nil && !apierrors.IsNotFound(err) && !apierrors.IsConflict(err) {
			return fmt.Errorf("confirm deletion: %w", err)
		}
		logger.V(2).Info("Pod stopped and its claims unprepared")
		return nil
	}
	if pod.Status.Phase == v1.PodSucceeded || pod.Status.Phase == v1.PodFailed {
		return k.syncTerminated(ctx, pod)
	}
	if inProcessPod(pod) {
		if pod.Status.Phase == v1.PodRunning {
			return nil
		}
		return k.markRunning(ctx, pod, nil)
	}
	run := processCommand(pod)
	if pod.Status.Phase == v1.PodRunning {
		if run != nil {
			k.startProcess(ctx, pod, run) // no-op unless lost
			return nil
		}
		if exits := k.containerExits(pod.UID); len(exits) > 0 {
			return k.syncExits(ctx, pod, exits)
		}
		return nil
	}
	if running, err := k.startedAndRunning(ctx, pod); err != nil || running {
		return err
	}

	if err := k.dra.PrepareResources(ctx, pod); err != nil {
		k.recorder.Event(pod, v1.EventTypeWarning, reasonFailedPrepare, err.Error())
		return err
	}
	if run != nil {
		k.startProcess(ctx, pod, run)
	}
	views, specs, err := k.containerViews(ctx, pod)
	if err != nil {
		k.recorder.Event(pod, v1.EventTypeWarning, reasonFailedPrepare, err.Error())
		return err
	}
	loads, badContainer, err := podSimLoads(pod)
	if err != nil {
		// As the kubelet treats a container it cannot configure (a
		// missing ConfigMap key): not started, the error on its status.
		k.recordConfigError(ctx, pod, badContainer, err)
		return err
	}
	if k.runtime != nil && run == nil {
		if err := k.startContainers(ctx, pod, views, specs, loads); err != nil {
			k.recorder.Event(pod, v1.EventTypeWarning, reasonFailedStart, err.Error())
			return err
		}
	}
	if len(loads) > 0 && (k.runtime == nil || run != nil || k.sims == nil) {
		// Said, not failed: the same pods run on real GPUs (make
		// gpu-smoke) and on nodes that only resolve containers.
		k.recorder.Event(pod, v1.EventTypeWarning, reasonSimLoadIgnored, SimLoadEnv+
			" ignored: this node runs no real containers, or its GPUs are not simulated")
	}
	if err := k.markRunning(ctx, pod, views); err != nil {
		return err
	}
	logger.V(2).Info("Pod running", "containers", len(views))
	return nil
}

// startedAndRunning says whether the pod's containers run already and the
// API server has it Running: the informer lags the kubelet's own writes
// (the annotation's patch comes back before the status update), and a
// sync that saw the pod Pending would start its running containers again.
// Only containers that run make it ask: once per pod.
func (k *kubelet) startedAndRunning(ctx context.Context, pod *v1.Pod) (bool, error) {
	k.mu.Lock()
	started := len(k.containers[pod.UID]) > 0
	k.mu.Unlock()
	if !started || processCommand(pod) != nil {
		return false, nil
	}
	fresh, err := k.client.CoreV1().Pods(pod.Namespace).Get(ctx, pod.Name, metav1.GetOptions{})
	if err != nil {
		if apierrors.IsNotFound(err) {
			return false, nil
		}
		return false, fmt.Errorf("pod's status: %w", err)
	}
	return fresh.UID == pod.UID && fresh.Status.Phase == v1.PodRunning, nil
}

// syncGone stops a force-deleted pod of this key, unless its UID is
// current: its process, if any, and its claims.
func (k *kubelet) syncGone(ctx context.Context, key string, current types.UID) error {
	k.mu.Lock()
	gonePod := k.gone[key]
	if gonePod != nil && gonePod.UID != current {
		delete(k.gone, key)
	} else {
		gonePod = nil
	}
	k.mu.Unlock()
	if gonePod == nil {
		return nil
	}
	k.stopProcess(ctx, gonePod.UID)
	k.stopContainers(ctx, gonePod.UID)
	// Force-deleted: the DRA manager knows which claims it prepared.
	if err := k.dra.UnprepareResources(ctx, gonePod); err != nil {
		k.mu.Lock()
		if k.gone[key] == nil {
			k.gone[key] = gonePod
		}
		k.mu.Unlock()
		return err
	}
	return nil
}

// containerViews resolves each container's CDI devices as a container
// runtime would: DRA's, and the device manager's on a node in
// device-plugin mode.
func (k *kubelet) containerViews(ctx context.Context, pod *v1.Pod) (map[string]noderuntime.ContainerView, map[string]*oci.Spec, error) {
	views, specs := map[string]noderuntime.ContainerView{}, map[string]*oci.Spec{}
	containers := append(append([]v1.Container{}, pod.Spec.InitContainers...), pod.Spec.Containers...)
	for i := range containers {
		c := &containers[i]
		info, err := k.dra.GetResources(pod, c)
		if err != nil {
			return nil, nil, fmt.Errorf("container %s: %w", c.Name, err)
		}
		var edits noderuntime.RuntimeEdits
		if k.dm != nil {
			// Device plugin resources: allocated by the device manager;
			// the plugin's Allocate answer as the kubelet hands it over.
			if edits, err = k.dm.runtimeEdits(ctx, pod, c); err != nil {
				return nil, nil, fmt.Errorf("container %s: %w", c.Name, err)
			}
		}
		for _, d := range info.CDIDevices {
			edits.CDIDevices = append(edits.CDIDevices, d.Name)
		}
		view, spec, err := noderuntime.ResolveContainerSpec(k.cdiDir, edits, k.devices, k.hostDevices)
		if err != nil {
			return nil, nil, fmt.Errorf("container %s: %w", c.Name, err)
		}
		views[c.Name], specs[c.Name] = view, spec
	}
	return views, specs, nil
}

// markRunning records what the containers would see and sets the pod
// Running with every container ready.
func (k *kubelet) markRunning(ctx context.Context, pod *v1.Pod, views map[string]noderuntime.ContainerView) error {
	data, err := json.Marshal(views)
	if err != nil {
		return err
	}
	patch, err := json.Marshal(map[string]any{"metadata": map[string]any{
		"uid": pod.UID, "annotations": map[string]string{ContainersAnnotation: string(data)}}})
	if err != nil {
		return err
	}
	updated, err := k.reporter.CoreV1().Pods(pod.Namespace).Patch(ctx, pod.Name, types.MergePatchType, patch, metav1.PatchOptions{})
	if err != nil {
		return fmt.Errorf("record container view: %w", err)
	}
	now := metav1.Now()
	status := updated.Status.DeepCopy()
	status.Phase = v1.PodRunning
	status.StartTime = &now
	status.HostIP = "127.0.0.1"
	status.HostIPs = []v1.HostIP{{IP: "127.0.0.1"}}
	if ip := pod.Annotations[PodIPAnnotation]; ip != "" {
		status.PodIP = ip
		status.PodIPs = []v1.PodIP{{IP: ip}}
	}
	for _, t := range []v1.PodConditionType{v1.PodInitialized, v1.PodReadyToStartContainers, v1.ContainersReady, v1.PodReady} {
		setCondition(status, v1.PodCondition{Type: t, Status: v1.ConditionTrue, LastTransitionTime: now})
	}
	status.ContainerStatuses = nil
	for _, c := range pod.Spec.Containers {
		status.ContainerStatuses = append(status.ContainerStatuses, v1.ContainerStatus{
			Name: c.Name, Image: c.Image, ImageID: c.Image, Ready: true, Started: ptrTo(true),
			RestartCount: k.restartCount(pod.UID),
			ContainerID:  k.containerID(pod, c.Name),
			State:        v1.ContainerState{Running: &v1.ContainerStateRunning{StartedAt: now}},
		})
	}
	updated.Status = *status
	if _, err := k.client.CoreV1().Pods(pod.Namespace).UpdateStatus(ctx, updated, metav1.UpdateOptions{}); err != nil {
		return fmt.Errorf("set pod running: %w", err)
	}
	if k.runtime != nil && !inProcessPod(pod) && (processCommand(pod) == nil || k.runtime.MPSServer != "") {
		k.recorder.Event(pod, v1.EventTypeNormal, reasonStarted, "Containers started (runc)")
	} else {
		k.recorder.Event(pod, v1.EventTypeNormal, reasonStarted, "Containers started (simulated by devcluster)")
	}
	return nil
}

// recordConfigError says why container could not be started, as the
// kubelet does for a container it cannot configure: a Failed event, and
// the container waiting with reason CreateContainerConfigError and the
// error as its message (written once: a retry with the same error does not
// write the status again).
func (k *kubelet) recordConfigError(ctx context.Context, pod *v1.Pod, container string, cause error) {
	k.recorder.Event(pod, v1.EventTypeWarning, reasonFailedStart, "Error: "+cause.Error())
	want := v1.ContainerStateWaiting{Reason: reasonConfigError, Message: cause.Error()}
	for _, cs := range pod.Status.ContainerStatuses {
		if cs.Name == container && cs.State.Waiting != nil && *cs.State.Waiting == want {
			return
		}
	}
	updated := pod.DeepCopy()
	updated.Status.ContainerStatuses = nil
	for _, c := range pod.Spec.Containers {
		waiting := v1.ContainerStateWaiting{Reason: "ContainerCreating"}
		if c.Name == container {
			waiting = want
		}
		updated.Status.ContainerStatuses = append(updated.Status.ContainerStatuses, v1.ContainerStatus{
			Name: c.Name, Image: c.Image, State: v1.ContainerState{Waiting: &waiting}})
	}
	if _, err := k.client.CoreV1().Pods(pod.Namespace).UpdateStatus(ctx, updated, metav1.UpdateOptions{}); err != nil {
		klog.FromContext(ctx).V(2).Info("Record a container's configuration error", "container", container, "err", err)
	}
}

func setCondition(status *v1.PodStatus, cond v1.PodCondition) {
	for i := range status.Conditions {
		if status.Conditions[i].Type == cond.Type {
			status.Conditions[i] = cond
			return
		}
	}
	status.Conditions = append(status.Conditions, cond)
}

func ptrTo[T any](v T) *T { return &v }
