package devcluster

import (
	"context"
	"fmt"
	"net"
	"net/url"
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
	"k8s.io/kubernetes/pkg/controller/devicetainteviction"
	"k8s.io/kubernetes/pkg/controller/garbagecollector"
	"k8s.io/kubernetes/pkg/controller/resourceclaim"
	"k8s.io/kubernetes/pkg/scheduler"
	schedulerlatest "k8s.io/kubernetes/pkg/scheduler/apis/config/latest"
	"k8s.io/kubernetes/pkg/scheduler/profile"
)

// startEtcd runs etcd inside this process on free loopback ports.
func startEtcd(dir string) (*embed.Etcd, string, error) {
	clientPort, err := freePort()
	if err != nil {
		return nil, "", err
	}
	peerPort, err := freePort()
	if err != nil {
		return nil, "", err
	}
	cfg := embed.NewConfig()
	cfg.Name = "devcluster"
	cfg.Dir = filepath.Join(dir, "etcd")
	cfg.LogLevel = "error"
	cfg.LogOutputs = []string{filepath.Join(dir, "etcd.log")}
	clientURL := url.URL{Scheme: "http", Host: fmt.Sprintf("127.0.0.1:%d", clientPort)}
	peerURL := url.URL{Scheme: "http", Host: fmt.Sprintf("127.0.0.1:%d", peerPort)}
	cfg.ListenClientUrls, cfg.AdvertiseClientUrls = []url.URL{clientURL}, []url.URL{clientURL}
	cfg.ListenPeerUrls, cfg.AdvertisePeerUrls = []url.URL{peerURL}, []url.URL{peerURL}
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

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("find a free port: %w", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// startAPIServer runs the real kube-apiserver against the embedded etcd.
func startAPIServer(tb *processTB, etcdURL string, extraFlags []string) (kubeapiservertesting.TestServer, error) {
	storage := storagebackend.NewDefaultConfig("/registry", nil)
	storage.Transport.ServerList = []string{etcdURL}
	flags := append([]string{
		// Nothing reconciles the kubernetes Service endpoints here.
		"--endpoint-reconciler-type=none",
		// No service-account controller runs, so pods could not be admitted.
		"--disable-admission-plugins=ServiceAccount",
		// As kubeadm and every managed cluster set it: GPU node agents
		// such as the kubelet plugin run privileged.
		"--allow-privileged=true",
	}, extraFlags...)
	return kubeapiservertesting.StartTestServer(tb, kubeapiservertesting.NewDefaultTestServerOptions(), flags, storage)
}

// startControllers runs the scheduler (default profile, which includes
// DynamicResources), the ResourceClaim controller, the garbage collector and
// the device-taint eviction controller until ctx ends. The returned channel
// closes once all of them have returned.
func startControllers(ctx context.Context, cfg *restclient.Config) (<-chan struct{}, error) {
	logger := klog.FromContext(ctx)
	client, err := kubernetes.NewForConfig(restclient.AddUserAgent(restclient.CopyConfig(cfg), "devcluster-controllers"))
	if err != nil {
		return nil, err
	}
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
	schedInformers := scheduler.NewInformerFactory(client, 0, nil)
	broadcaster := events.NewBroadcaster(&events.EventSinkImpl{Interface: client.EventsV1()})
	broadcaster.StartRecordingToSink(ctx.Done())
	sched, err := scheduler.New(ctx, client, schedInformers, nil, profile.NewRecorderFactory(broadcaster),
		scheduler.WithKubeConfig(cfg),
		scheduler.WithProfiles(schedCfg.Profiles...),
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

	// The controllers of kube-controller-manager that DRA needs.
	factory := informers.NewSharedInformerFactory(client, 0)
	claims, err := resourceclaim.NewController(logger, client,
		factory.Core().V1().Pods(), factory.Scheduling().V1beta1().PodGroups(),
		factory.Resource().V1().ResourceClaims(), factory.Resource().V1().ResourceClaimTemplates())
	if err != nil {
		return nil, fmt.Errorf("create ResourceClaim controller: %w", err)
	}
	taints := devicetainteviction.New(client, factory.Core().V1().Pods(), factory.Resource().V1().ResourceClaims(),
		factory.Resource().V1().ResourceSlices(), factory.Resource().V1().DeviceTaintRules(),
		factory.Resource().V1().DeviceClasses(), "device-taint-eviction-controller")
	gc, gcSync, err := newGarbageCollector(ctx, cfg, factory)
	if err != nil {
		return nil, err
	}
	factory.Start(ctx.Done())
	run("resourceclaim-controller", func(ctx context.Context) { claims.Run(ctx, 5) })
	run("device-taint-eviction-controller", func(ctx context.Context) {
		if err := taints.Run(ctx, 2); err != nil {
			klog.FromContext(ctx).Error(err, "Device taint eviction stopped")
		}
	})
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
// of the API's resources current.
func newGarbageCollector(ctx context.Context, cfg *restclient.Config, factory informers.SharedInformerFactory) (*garbagecollector.GarbageCollector, func(context.Context), error) {
	gcCfg := restclient.AddUserAgent(restclient.CopyConfig(cfg), "garbage-collector")
	client, err := kubernetes.NewForConfig(gcCfg)
	if err != nil {
		return nil, nil, err
	}
	metadataClient, err := metadata.NewForConfig(gcCfg)
	if err != nil {
		return nil, nil, err
	}
	mapper := restmapper.NewDeferredDiscoveryRESTMapper(cacheddiscovery.NewMemCacheClient(client.Discovery()))
	mapper.Reset()
	started := make(chan struct{})
	close(started)
	gc, err := garbagecollector.NewGarbageCollector(ctx, client, metadataClient, mapper,
		garbagecollector.DefaultIgnoredResources(),
		informerfactory.NewInformerFactory(factory, metadatainformer.NewSharedInformerFactory(metadataClient, 0)),
		started)
	if err != nil {
		return nil, nil, fmt.Errorf("create garbage collector: %w", err)
	}
	sync := func(ctx context.Context) {
		go wait.UntilWithContext(ctx, func(context.Context) { mapper.Reset() }, 5*time.Second)
		gc.Sync(ctx, client.Discovery(), 5*time.Second)
	}
	return gc, sync, nil
}
