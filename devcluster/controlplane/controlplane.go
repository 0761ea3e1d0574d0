// Package controlplane runs a real Kubernetes control plane inside one Go
// process: embedded etcd, kube-apiserver (its own test server, with its
// certificate fixtures kept in this process's temporary directory),
// kube-scheduler with its default profile (DynamicResources included) and
// the DRA controllers of kube-controller-manager (ResourceClaim, garbage
// collector, device-taint eviction, PodGroup protection, ServiceAccount
// tokens), each with a client of its own at the limits its binary ships
// with. All of it is Kubernetes' own code at the version devcluster's
// module pins; what is devcluster's is the wiring and one scheduler plugin
// that delays PreBind for the pods that ask (PreBindDelayAnnotation), so
// that tests can land a write between Reserve and PreBind.
package controlplane

import (
	"context"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"time"

	"go.etcd.io/etcd/server/v3/embed"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/apiserver/pkg/storage/storagebackend"
	cacheddiscovery "k8s.io/client-go/discovery/cached/memory"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/metadata"
	"k8s.io/client-go/metadata/metadatainformer"
	restclient "k8s.io/client-go/rest"
	"k8s.io/client-go/restmapper"
	"k8s.io/client-go/tools/events"
	"k8s.io/controller-manager/pkg/informerfactory"
	"k8s.io/klog/v2"
	kubeapiservertesting "k8s.io/kubernetes/cmd/kube-apiserver/app/testing"
	"k8s.io/kubernetes/pkg/controller/certificates/rootcacertpublisher"
	"k8s.io/kubernetes/pkg/controller/devicetainteviction"
	"k8s.io/kubernetes/pkg/controller/garbagecollector"
	"k8s.io/kubernetes/pkg/controller/job"
	"k8s.io/kubernetes/pkg/controller/resourceclaim"
	"k8s.io/kubernetes/pkg/controller/scheduling/podgroupprotection"
	"k8s.io/kubernetes/pkg/scheduler"
	schedulerlatest "k8s.io/kubernetes/pkg/scheduler/apis/config/latest"
	"k8s.io/kubernetes/pkg/scheduler/profile"
)

// etcdSocketDir, under the cluster's directory, holds etcd's sockets.
const etcdSocketDir = "etcd-sock"

// maxSocketPath is the longest path a unix socket can have on Linux:
// sockaddr_un's sun_path holds 108 bytes, the last a NUL.
const maxSocketPath = 107

// StartEtcd runs etcd inside this process, listening only on unix sockets
// in dir/etcd-sock, a directory (mode 0700) only this process's user can
// enter: "client" for kube-apiserver, "peer" for the peers a one-member
// cluster never has. etcd asks no client for credentials, and whoever
// reaches it can write any object, a privileged pod included: on a TCP
// port, even on loopback, any local user of a GPU node running the
// gpu-smoke bundle could have become root (issue 47). It returns the
// client URL, unix:///<dir>/etcd-sock/client, which kube-apiserver's
// storage backend takes as its server.
func StartEtcd(dir string) (*embed.Etcd, string, error) {
	sockets := filepath.Join(dir, etcdSocketDir)
	client, peer := filepath.Join(sockets, "client"), filepath.Join(sockets, "peer")
	if len(client) > maxSocketPath || len(peer) > maxSocketPath {
		return nil, "", fmt.Errorf("etcd's socket %s is %d bytes long, over the %d a unix socket allows: give devcluster a shorter directory", peer, len(peer), maxSocketPath)
	}
	if err := privateDir(sockets); err != nil {
		return nil, "", fmt.Errorf("etcd's socket directory: %w", err)
	}
	cfg := embed.NewConfig()
	cfg.Name = "devcluster"
	cfg.Dir = filepath.Join(dir, "etcd")
	cfg.LogLevel = "error"
	cfg.LogOutputs = []string{filepath.Join(dir, "etcd.log")}
	clientURL := url.URL{Scheme: "unix", Path: client}
	cfg.ListenClientUrls, cfg.AdvertiseClientUrls = []url.URL{clientURL}, []url.URL{clientURL}
	// etcd listens for peers on a unix URL's host, taken as the socket's
	// path (its peer listener ignores the URL's path), and advertises the
	// URL as written, which its cluster configuration parses back: the
	// one URL cannot be both.
	cfg.ListenPeerUrls = []url.URL{{Scheme: "unix", Host: peer}}
	cfg.AdvertisePeerUrls = []url.URL{{Scheme: "unix", Path: peer}}
	cfg.InitialCluster = cfg.InitialClusterFromName(cfg.Name)
	e, err := embed.StartEtcd(cfg)
	if err != nil {
		return nil, "", fmt.Errorf("start etcd: %w", err)
	}
	select {
	case <-e.Server.ReadyNotify():
	case err := <-e.Err():
		e.Close()
		return nil, "", fmt.Errorf("etcd: %w", err)
	case <-time.After(60 * time.Second):
		e.Close()
		return nil, "", fmt.Errorf("etcd was not ready within 60s")
	}
	return e, clientURL.String(), nil
}

// privateDir makes dir anew with mode 0700. One left by an earlier run
// is removed first; one that appears between the removal and the
// creation (someone else's) fails the creation instead of being used.
func privateDir(dir string) error {
	if err := os.RemoveAll(dir); err != nil {
		return err
	}
	if err := os.Mkdir(dir, 0o700); err != nil {
		return err
	}
	// Mkdir's mode passes through the umask: 0700 whatever it is.
	return os.Chmod(dir, 0o700)
}

// StartAPIServer runs the real kube-apiserver against the embedded etcd.
// serviceAccounts turns the ServiceAccount admission plugin on, as a
// cluster has it, so that pods get their token volume (a real kubelet
// mounts it); devcluster's own kubelet and image mode give the pods that
// need one a token themselves.
func StartAPIServer(tb *ProcessTB, etcdURL string, workloadAPI, serviceAccounts bool, extraFlags []string) (kubeapiservertesting.TestServer, error) {
	storage := storagebackend.NewDefaultConfig("/registry", nil)
	storage.Transport.ServerList = []string{etcdURL}
	admission := []string{
		// As kubeadm enables it: a kubelet may change only its own Node
		// and its own pods.
		"--enable-admission-plugins=NodeRestriction",
		// Off by default here: a pod in a namespace whose "default"
		// ServiceAccount the controller has not made yet is refused.
		"--disable-admission-plugins=ServiceAccount",
	}
	if serviceAccounts {
		admission = []string{"--enable-admission-plugins=NodeRestriction,ServiceAccount"}
	}
	flags := append([]string{
		// Nothing reconciles the kubernetes Service endpoints here.
		"--endpoint-reconciler-type=none",
		// As kubeadm and every managed cluster set it: GPU node agents
		// such as the kubelet plugin run privileged.
		"--allow-privileged=true",
		// As in a cluster: every gpudra component is held to the chart's
		// RBAC and admission policies (devcluster's identity.go).
		"--authorization-mode=Node,RBAC",
	}, append(admission, workloadAPIFlags(workloadAPI)...)...)
	flags = append(flags, extraFlags...)
	return kubeapiservertesting.StartTestServer(tb, kubeapiservertesting.NewDefaultTestServerOptions(), flags, storage)
}

// workloadAPIFlags turn on, or leave off, kube-scheduler's own gang
// scheduling: scheduling.k8s.io/v1beta1 Workloads and PodGroups
// (GenericWorkload, beta and off by default in 1.37, as new beta APIs are),
// claims reserved for a PodGroup (DRAWorkloadResourceClaims, beta) and
// PodGroup topology constraints (TopologyAwareWorkloadScheduling, alpha),
// which keep a gang that fits one node, one NVLink domain, there. The test
// server copies the gates into the process's default feature gate, which
// the scheduler, the claim controller and the kubelets read too, so the
// whole in-process cluster agrees.
func workloadAPIFlags(on bool) []string {
	return []string{
		fmt.Sprintf("--feature-gates=GenericWorkload=%t,DRAWorkloadResourceClaims=%t,TopologyAwareWorkloadScheduling=%t", on, on, on),
		fmt.Sprintf("--runtime-config=scheduling.k8s.io/v1beta1=%t", on),
	}
}

// The client rate limits the real components ship with, in
// k8s.io/kubernetes v1.37.1:
//   - kube-scheduler: clientConnection.qps 50, burst 100
//     (pkg/scheduler/apis/config/v1/defaults.go, SetDefaults_KubeSchedulerConfiguration:
//     "Scheduler has an opinion about QPS/Burst"). It makes one client for
//     scheduling and its informers and a second one, with limits of its
//     own, for events (cmd/kube-scheduler/app/options/options.go, createClients).
//   - kube-controller-manager: --kube-api-qps 20, --kube-api-burst 30
//     (pkg/controller/apis/config/v1alpha1/defaults.go,
//     SetDefaults_KubeControllerManagerConfiguration). Every controller gets a
//     client of its own, so a rate limiter of its own, named after it
//     (cmd/kube-controller-manager/app/controllermanager.go, createClientBuilders;
//     app/resource.go, app/core.go); the shared and the metadata informers
//     have theirs, and discovery clients get burst 200 at 20 QPS
//     (k8s.io/controller-manager/pkg/clientbuilder, DiscoveryClient).
//
// devcluster makes the same clients at the same limits: one client shared by
// all of them, at other limits, is no cluster anyone runs, and the
// end-to-end benchmark would measure it instead of the driver (issue 12).
var (
	schedulerShipped         = ClientLimits{QPS: 50, Burst: 100}
	ControllerManagerShipped = ClientLimits{QPS: 20, Burst: 30}
	discoveryShipped         = ClientLimits{QPS: 20, Burst: 200}
)

type ClientLimits struct {
	QPS   float32
	Burst int
}

// Clients makes the scheduler's and the controllers' clients:
// one per component, as the real binaries make them, at the shipped limits
// unless Tuned is set.
type Clients struct {
	// Base is the API server's loopback configuration; Tuned, when not
	// zero, replaces each component's shipped limits.
	Base  *restclient.Config
	Tuned ClientLimits
	// RootCA, when set, runs kube-controller-manager's root CA publisher
	// with it (its --root-ca-file): the kube-root-ca.crt ConfigMap in
	// every namespace, which a real kubelet mounts into pods' token
	// volumes.
	RootCA []byte
}

// TunedLimits turns devcluster.Options' fields into limits; a QPS without a burst gets
// twice the QPS, kube-scheduler's ratio.
func TunedLimits(qps float32, burst int) ClientLimits {
	if qps > 0 && burst == 0 {
		burst = int(2 * qps)
	}
	return ClientLimits{QPS: qps, Burst: burst}
}

// config is a client configuration for one component. userAgent reads as
// the real one does without the version ("kube-controller-manager/resource-claim-controller"),
// so that the API server's log and metrics tell the components apart.
func (p Clients) Config(shipped ClientLimits, userAgent string) *restclient.Config {
	cfg := restclient.CopyConfig(p.Base)
	cfg.UserAgent = userAgent
	// Both binaries set it (createKubeConfig in each); the loopback
	// configuration already asks for protobuf, as they do.
	cfg.DisableCompression = true
	limits := shipped
	if p.Tuned.QPS > 0 {
		limits.QPS = p.Tuned.QPS
	}
	if p.Tuned.Burst > 0 {
		limits.Burst = p.Tuned.Burst
	}
	cfg.QPS, cfg.Burst = limits.QPS, limits.Burst
	// A limiter of its own: the copy would share the base's, if it had one.
	cfg.RateLimiter = nil
	return cfg
}

func (p Clients) client(shipped ClientLimits, userAgent string) (*restclient.Config, kubernetes.Interface, error) {
	cfg := p.Config(shipped, userAgent)
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return nil, nil, fmt.Errorf("client %s: %w", userAgent, err)
	}
	return cfg, client, nil
}

// controllerClient is a kube-controller-manager client named as the real
// one names it.
func (p Clients) controllerClient(name string) (*restclient.Config, kubernetes.Interface, error) {
	return p.client(ControllerManagerShipped, "kube-controller-manager/"+name)
}

// discoveryClient is a kube-controller-manager discovery client.
func (p Clients) discoveryClient(name string) (kubernetes.Interface, error) {
	_, client, err := p.client(discoveryShipped, "kube-controller-manager/"+name)
	return client, err
}

// String says which limits the components run with, for logs and benchmarks.
func (p Clients) String() string {
	if p.Tuned.QPS == 0 && p.Tuned.Burst == 0 {
		return fmt.Sprintf("shipped defaults (kube-scheduler %g QPS/%d burst, kube-controller-manager %g/%d per controller)",
			schedulerShipped.QPS, schedulerShipped.Burst, ControllerManagerShipped.QPS, ControllerManagerShipped.Burst)
	}
	s, c := p.Config(schedulerShipped, ""), p.Config(ControllerManagerShipped, "")
	return fmt.Sprintf("tuned (kube-scheduler %g QPS/%d burst, kube-controller-manager %g/%d per controller)", s.QPS, s.Burst, c.QPS, c.Burst)
}

// StartControllers runs the scheduler (default profile, which includes
// DynamicResources), the ResourceClaim controller, the garbage collector and
// the device-taint eviction controller until ctx ends, each with its own
// client. The returned channel closes once all of them have returned.
func StartControllers(ctx context.Context, clients Clients) (<-chan struct{}, error) {
	logger := klog.FromContext(ctx)
	logger.V(1).Info("Control plane clients", "limits", clients.String())
	done := make(chan struct{})
	var stopped []<-chan struct{}
	run := func(name string, f func(ctx context.Context)) {
		ch := make(chan struct{})
		stopped = append(stopped, ch)
		go func() {
			defer close(ch)
			f(klog.NewContext(ctx, klog.LoggerWithName(logger, name)))
		}()
	}

	// The scheduler.
	schedCfg, err := schedulerlatest.Default()
	if err != nil {
		return nil, fmt.Errorf("scheduler configuration: %w", err)
	}
	// As kube-scheduler: its informers share the scheduling client, its
	// events have a client (and a rate limiter) of their own.
	schedKubeConfig, schedClient, err := clients.client(schedulerShipped, "kube-scheduler/scheduler")
	if err != nil {
		return nil, err
	}
	_, eventClient, err := clients.client(schedulerShipped, "kube-scheduler/scheduler")
	if err != nil {
		return nil, err
	}
	schedInformers := scheduler.NewInformerFactory(schedClient, 0, nil)
	broadcaster := events.NewBroadcaster(&events.EventSinkImpl{Interface: eventClient.EventsV1()})
	broadcaster.StartRecordingToSink(ctx.Done())
	// Pods annotated for it wait in PreBind (prebinddelay.go).
	registry := withPreBindDelay(schedCfg.Profiles)
	sched, err := scheduler.New(ctx, schedClient, schedInformers, nil, profile.NewRecorderFactory(broadcaster),
		scheduler.WithKubeConfig(schedKubeConfig),
		scheduler.WithProfiles(schedCfg.Profiles...),
		scheduler.WithFrameworkOutOfTreeRegistry(registry),
		scheduler.WithPercentageOfNodesToScore(schedCfg.PercentageOfNodesToScore),
		// Pods that did not fit are retried soon: the demo and the tests
		// create claims and slices in any order.
		scheduler.WithPodInitialBackoffSeconds(1),
		scheduler.WithPodMaxBackoffSeconds(2),
		// A pod found unschedulable waits for a cluster event, or at most
		// this long (5 minutes by default). Seen here: a consumable-capacity
		// share judged not to fit while other shares of the GPU were in
		// flight, then never requeued within the demo's timeout.
		scheduler.WithPodMaxInUnschedulablePodsDuration(5*time.Second),
	)
	if err != nil {
		return nil, fmt.Errorf("create scheduler: %w", err)
	}
	schedInformers.Start(ctx.Done())
	schedInformers.WaitForCacheSync(ctx.Done())
	if err := sched.WaitForHandlersSync(ctx); err != nil {
		return nil, fmt.Errorf("scheduler handlers: %w", err)
	}
	run("scheduler", func(ctx context.Context) { sched.Run(ctx); broadcaster.Shutdown() })

	// The controllers of kube-controller-manager that DRA needs, each with
	// the client kube-controller-manager would give it.
	_, informerClient, err := clients.controllerClient("shared-informers")
	if err != nil {
		return nil, err
	}
	factory := informers.NewSharedInformerFactory(informerClient, 0)
	_, claimClient, err := clients.controllerClient("resource-claim-controller")
	if err != nil {
		return nil, err
	}
	claims, err := resourceclaim.NewController(logger, claimClient,
		factory.Core().V1().Pods(), factory.Scheduling().V1beta1().PodGroups(),
		factory.Resource().V1().ResourceClaims(), factory.Resource().V1().ResourceClaimTemplates())
	if err != nil {
		return nil, fmt.Errorf("create ResourceClaim controller: %w", err)
	}
	_, taintClient, err := clients.controllerClient("device-taint-eviction-controller")
	if err != nil {
		return nil, err
	}
	taints := devicetainteviction.New(taintClient, factory.Core().V1().Pods(), factory.Resource().V1().ResourceClaims(),
		factory.Resource().V1().ResourceSlices(), factory.Resource().V1().DeviceTaintRules(),
		factory.Resource().V1().DeviceClasses(), "device-taint-eviction-controller")
	// With GenericWorkload, kube-controller-manager runs the PodGroup
	// protection controller: it takes its finalizer off a deleted PodGroup
	// once no pod uses it. Without it a deleted PodGroup stayed Terminating
	// for good, and a gang made again under its name was placed under it.
	_, pgClient, err := clients.controllerClient("podgroup-protection-controller")
	if err != nil {
		return nil, err
	}
	pgProtection, err := podgroupprotection.NewPodGroupProtectionController(logger,
		factory.Scheduling().V1beta1().PodGroups(), factory.Core().V1().Pods(), pgClient)
	if err != nil {
		return nil, fmt.Errorf("create PodGroup protection controller: %w", err)
	}
	// The Job controller: Jobs (gpudra submit's, Kueue's, KubeRay's
	// submitters) make their pods as on a cluster.
	_, jobClient, err := clients.controllerClient("job-controller")
	if err != nil {
		return nil, err
	}
	jobs, err := job.NewController(ctx, jobClient, factory.Core().V1().Pods(), factory.Batch().V1().Jobs(),
		factory.Scheduling().V1beta1().Workloads(), factory.Scheduling().V1beta1().PodGroups())
	if err != nil {
		return nil, fmt.Errorf("create Job controller: %w", err)
	}
	gc, gcSync, err := newGarbageCollector(ctx, clients, factory)
	if err != nil {
		return nil, err
	}
	saRun, err := newServiceAccountControllers(logger, clients, factory)
	if err != nil {
		return nil, err
	}
	var publisher *rootcacertpublisher.Publisher
	if len(clients.RootCA) > 0 {
		_, pubClient, err := clients.controllerClient("root-ca-cert-publisher")
		if err != nil {
			return nil, err
		}
		if publisher, err = rootcacertpublisher.NewPublisher(factory.Core().V1().ConfigMaps(), factory.Core().V1().Namespaces(),
			pubClient, clients.RootCA); err != nil {
			return nil, fmt.Errorf("create the root CA publisher: %w", err)
		}
	}
	factory.Start(ctx.Done())
	if publisher != nil {
		run("root-ca-cert-publisher", func(ctx context.Context) { publisher.Run(ctx, 1) })
	}
	// kube-controller-manager starts the token controller before all others.
	for name, f := range saRun {
		run(name, f)
	}
	run("resourceclaim-controller", func(ctx context.Context) { claims.Run(ctx, 5) })
	run("device-taint-eviction-controller", func(ctx context.Context) {
		if err := taints.Run(ctx, 2); err != nil {
			klog.FromContext(ctx).Error(err, "Device taint eviction stopped")
		}
	})
	run("podgroup-protection-controller", func(ctx context.Context) { pgProtection.Run(ctx, 1) })
	run("job-controller", func(ctx context.Context) { jobs.Run(ctx, 5) })
	run("garbage-collector", func(ctx context.Context) { gc.Run(ctx, 2, 5*time.Second) })
	run("garbage-collector-sync", gcSync)

	go func() {
		for _, ch := range stopped {
			<-ch
		}
		factory.Shutdown()
		schedInformers.Shutdown()
		close(done)
	}()
	return done, nil
}

// newGarbageCollector builds the garbage collector, which deletes the
// claims generated for pods that are gone, and the loop that keeps its view
// of the API's resources current. The clients are named as in
// kube-controller-manager (cmd/kube-controller-manager/app/controllermanager.go,
// CreateControllerContext; app/core.go, newGarbageCollectorController).
func newGarbageCollector(ctx context.Context, clients Clients, factory informers.SharedInformerFactory) (*garbagecollector.GarbageCollector, func(context.Context), error) {
	gcCfg, client, err := clients.controllerClient("generic-garbage-collector")
	if err != nil {
		return nil, nil, err
	}
	metadataClient, err := metadata.NewForConfig(gcCfg)
	if err != nil {
		return nil, nil, err
	}
	metadataInformerClient, err := metadata.NewForConfig(clients.Config(ControllerManagerShipped, "kube-controller-manager/metadata-informers"))
	if err != nil {
		return nil, nil, err
	}
	mapperDiscovery, err := clients.discoveryClient("controller-discovery")
	if err != nil {
		return nil, nil, err
	}
	gcDiscovery, err := clients.discoveryClient("generic-garbage-collector")
	if err != nil {
		return nil, nil, err
	}
	mapper := restmapper.NewDeferredDiscoveryRESTMapper(cacheddiscovery.NewMemCacheClient(mapperDiscovery.Discovery()))
	mapper.Reset()
	started := make(chan struct{})
	close(started)
	gc, err := garbagecollector.NewGarbageCollector(ctx, client, metadataClient, mapper,
		garbagecollector.DefaultIgnoredResources(),
		informerfactory.NewInformerFactory(factory, metadatainformer.NewSharedInformerFactory(metadataInformerClient, 0)),
		started)
	if err != nil {
		return nil, nil, fmt.Errorf("create garbage collector: %w", err)
	}
	sync := func(ctx context.Context) {
		go wait.UntilWithContext(ctx, func(context.Context) { mapper.Reset() }, 5*time.Second)
		gc.Sync(ctx, gcDiscovery.Discovery(), 5*time.Second)
	}
	return gc, sync, nil
}
