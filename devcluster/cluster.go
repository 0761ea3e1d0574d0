// Package devcluster runs a real Kubernetes control plane inside one Go
// process (embedded etcd, kube-apiserver, kube-scheduler, the ResourceClaim
// controller, the garbage collector and the device-taint eviction
// controller: package controlplane) with simulated H100 nodes, each running
// the real gpudra kubelet plugin and a kubelet built on the kubelet's own
// DRA manager (package nodeagent). It backs `make demo` and the end-to-end
// suite. Pods' containers run in runc where it can (package noderuntime);
// the plugin and the controller run in this process, or, in image mode
// (Options.Image), as the chart's own pods from make image's layout
// (package imagemode, imagechart.go). This package is the Cluster that
// wires them: the chart's identities (identity.go, package chart), the
// gpudra-controller replicas and their webhook front (controller.go), the
// nodes (nodes.go), Grove's stand-in (package groveoperator) and what the
// demo prints (report.go).
package devcluster

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"sync"
	"time"

	"go.etcd.io/etcd/server/v3/embed"
	authenticationv1 "k8s.io/api/authentication/v1"
	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/uuid"
	"k8s.io/client-go/kubernetes"
	restclient "k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	"k8s.io/klog/v2"
	kubeapiservertesting "k8s.io/kubernetes/cmd/kube-apiserver/app/testing"
	"k8s.io/utils/ptr"

	"github.com/gpudra/gpudra/devcluster/chart"
	"github.com/gpudra/gpudra/devcluster/controlplane"
	"github.com/gpudra/gpudra/devcluster/imagemode"
	"github.com/gpudra/gpudra/devcluster/nodeagent"
	"github.com/gpudra/gpudra/devcluster/noderuntime"
	"github.com/gpudra/gpudra/devcluster/podnetwork"
	"github.com/gpudra/gpudra/devcluster/realnode"
)

// Options configure a devcluster.
type Options struct {
	// Dir is the working directory (etcd data, node directories). Empty:
	// a new temporary directory, removed at Stop. Keep it short: unix
	// socket paths live below it.
	Dir string
	// APIServerFlags are added to kube-apiserver's flags (after
	// --authorization-mode=Node,RBAC, which every devcluster runs with).
	APIServerFlags []string
	// NoWorkloadAPI leaves kube-scheduler's Workload API off: no
	// scheduling.k8s.io/v1beta1 Workloads and PodGroups, no claims
	// reserved for a PodGroup, as on a 1.37 cluster with the beta gates at
	// their defaults. By default devcluster serves them (package controlplane,
	// workloadAPIFlags).
	NoWorkloadAPI bool
	// MPSControlBinary is what the nodes' plugins run as
	// nvidia-cuda-mps-control: hack/fake-nvidia-cuda-mps-control, a
	// stand-in that records what it is asked. Empty: MPS claims are refused.
	MPSControlBinary string
	// ControlPlaneQPS and ControlPlaneBurst tune the client rate limits of
	// the scheduler and of every controller, as operators of large
	// clusters raise kube-scheduler's clientConnection and
	// kube-controller-manager's --kube-api-qps/--kube-api-burst. Zero: each
	// component's client at the limits it ships with (kube-scheduler 50
	// QPS, burst 100; kube-controller-manager 20 QPS, burst 30 per
	// controller; see package controlplane). A QPS without a burst gets a burst
	// of twice the QPS.
	ControlPlaneQPS   float32
	ControlPlaneBurst int
	// Chart is the chart whose ServiceAccounts, RBAC and admission
	// policies devcluster installs; every gpudra component authenticates
	// as its ServiceAccount (identity.go). Required.
	Chart chart.Options
	// Grove installs Grove's CRDs and runs a stand-in for Grove's operator
	// (package groveoperator): PodCliqueSets get their PodCliques, scaling groups,
	// ResourceClaims, gated pods and PodGangs as Grove makes them.
	Grove bool
	// Runtime runs every node's pods' containers for real (NodeOptions
	// Runtime overrides it per node); nil: their specs are only resolved.
	Runtime *noderuntime.OCIRuntime
	// RealNodes makes the API server trust devcluster's node client CA, so
	// that AddRealNode can join kubelet binaries with a node credential.
	RealNodes bool
	// Image runs the chart's own plugin and controller pods from make
	// image's layout in runc (package imagemode, imagechart.go) instead of
	// in this process; nil: in-process, the default (faster).
	Image *imagemode.Options
}

// Cluster is a running devcluster.
type Cluster struct {
	// Dir is the working directory.
	Dir string
	// RESTConfig is an admin's client configuration, and Client its
	// client: for tests, benchmarks, the demo and kubectl, not for the
	// control plane's components, which have clients of their own.
	RESTConfig *restclient.Config
	Client     kubernetes.Interface
	// ControlPlaneClients says which client limits the scheduler and the
	// controllers run with.
	ControlPlaneClients string

	ctx         context.Context
	cancel      context.CancelFunc
	tb          *controlplane.ProcessTB
	etcd        *embed.Etcd
	apiServer   kubeapiservertesting.TestServer
	controllers <-chan struct{}
	grove       <-chan struct{}
	gpudra      *controllers // gpudra-controller replicas (controller.go)
	removeDir   bool
	// releaseCerts gives back the API server's certificate directory
	// (controlplane.AcquireCertFixtures).
	releaseCerts func()
	stopOnce     sync.Once
	bootID       string
	mpsControl   string
	runtime      *noderuntime.OCIRuntime
	forbidden    forbiddenLog
	// image runs the chart's pods in image mode; nil otherwise.
	image *imagemode.Runner
	// pluginOwner is the chart's kubelet plugin DaemonSet, the owner of
	// every plugin pod devcluster runs (installPluginDaemonSet).
	pluginOwner *metav1.OwnerReference

	// clientCA issues real nodes' credentials (Options.RealNodes).
	clientCA *controlplane.ClientCA

	mu        sync.Mutex
	nodes     map[string]*nodeagent.Node
	realNodes map[string]*realnode.Node
	// podNet is the pod network of the pods devcluster serves itself
	// (nil without root).
	podNet *podnetwork.Network
	// realNodeFeeds stop the real nodes' load feeders and wait for them.
	realNodeFeeds []func()
	order         []string
}

// Start starts etcd, the API server and the controllers. Stop it with Stop.
func Start(ctx context.Context, opts Options) (c *Cluster, err error) {
	c = &Cluster{Dir: opts.Dir, tb: controlplane.NewProcessTB("devcluster"), nodes: map[string]*nodeagent.Node{}, realNodes: map[string]*realnode.Node{}, bootID: "devcluster-" + string(uuid.NewUUID()),
		mpsControl: opts.MPSControlBinary, runtime: opts.Runtime}
	if c.Dir == "" {
		if c.Dir, err = tempDir(); err != nil {
			return nil, err
		}
		c.removeDir = true
	}
	c.ctx, c.cancel = context.WithCancel(ctx)
	defer func() {
		// The API server's harness reports some failures by Fatal.
		if r := recover(); r != nil {
			f, ok := r.(controlplane.FatalError)
			if !ok {
				panic(r)
			}
			err = fmt.Errorf("start the API server: %s", f.Msg)
		}
		if err != nil {
			c.Stop()
			c = nil
		}
	}()
	if c.releaseCerts, err = controlplane.AcquireCertFixtures(); err != nil {
		return c, err
	}
	logger := klog.FromContext(ctx)
	start := time.Now()
	var etcdURL string
	if c.etcd, etcdURL, err = controlplane.StartEtcd(c.Dir); err != nil {
		return c, err
	}
	// Webhooks (the chart's in image mode, an engine's such as Kueue's)
	// and conversion webhooks named by a Service are reached through the
	// Service's EndpointSlices (ServeService), as no kube-proxy runs to
	// route its cluster IP.
	apiServerFlags := append([]string{"--enable-aggregator-routing=true"}, opts.APIServerFlags...)
	if opts.Image != nil {
		// The caller's values last: a test may override image mode's.
		opts.Chart.Values = append(imageChartValues(c.Dir), opts.Chart.Values...)
	}
	if opts.RealNodes {
		if opts.Image != nil {
			// ServiceAccount admission gives every pod a projected token
			// volume, which image mode does not run.
			return c, errors.New("RealNodes and Image together are not supported")
		}
		if c.clientCA, err = controlplane.NewClientCA(c.Dir); err != nil {
			return c, err
		}
		// The plugin pod a real node runs from the image reads its machine
		// and writes its specs where image mode's does.
		opts.Chart.Values = append(imageChartValues(c.Dir), opts.Chart.Values...)
		apiServerFlags = append(slices.Clone(apiServerFlags), "--client-ca-file="+c.clientCA.File)
	}
	// The pods devcluster serves itself get addresses in a namespace of
	// their own, which the API server reaches through its egress
	// selector; where there can be none (not root, no nsenter or ip),
	// the machine's own address, as the log says.
	switch c.podNet, err = podnetwork.Start(c.ctx, c.Dir); {
	case errors.Is(err, podnetwork.ErrUnavailable):
		logger.Info("The pods devcluster serves itself (metrics pods, image mode's webhooks) listen on this machine's own address", "reason", err.Error())
	case err != nil:
		return c, err
	default:
		apiServerFlags = append(slices.Clone(apiServerFlags), c.podNet.APIServerFlags()...)
	}
	if c.apiServer, err = controlplane.StartAPIServer(c.tb, etcdURL, !opts.NoWorkloadAPI, opts.RealNodes, apiServerFlags); err != nil {
		return c, fmt.Errorf("start the API server: %w", err)
	}
	c.RESTConfig = restclient.CopyConfig(c.apiServer.ClientConfig)
	// The admin client is no component: it drives tests and benchmarks (the
	// end-to-end benchmark's 100 creates fit in its burst), so it keeps
	// generous limits that never make it the bottleneck being measured.
	c.RESTConfig.QPS, c.RESTConfig.Burst = 100, 200
	if c.Client, err = kubernetes.NewForConfig(c.RESTConfig); err != nil {
		return c, err
	}
	logger.V(1).Info("API server ready", "host", c.RESTConfig.Host, "elapsed", time.Since(start).Round(time.Millisecond))
	clients := controlplane.Clients{Base: c.apiServer.ClientConfig, Tuned: controlplane.TunedLimits(opts.ControlPlaneQPS, opts.ControlPlaneBurst)}
	if opts.RealNodes {
		u, err := url.Parse(c.RESTConfig.Host)
		if err != nil {
			return c, err
		}
		if clients.RootCA, err = controlplane.ServingCA(u.Host); err != nil {
			return c, err
		}
	}
	c.ControlPlaneClients = clients.String()
	if c.controllers, err = controlplane.StartControllers(c.ctx, clients); err != nil {
		return c, err
	}
	logger.V(1).Info("Scheduler and controllers running", "elapsed", time.Since(start).Round(time.Millisecond))
	if opts.Grove {
		if c.grove, err = c.startGrove(c.ctx); err != nil {
			return c, err
		}
		logger.V(1).Info("Grove CRDs installed, Grove stand-in running", "elapsed", time.Since(start).Round(time.Millisecond))
	}
	// No ServiceAccount admission runs (package controlplane) unless
	// RealNodes, so pods need no default ServiceAccount there; the
	// namespace itself must exist.
	_, err = c.Client.CoreV1().Namespaces().Create(c.ctx, &v1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: chart.PluginNamespace}}, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		return c, fmt.Errorf("create namespace %s: %w", chart.PluginNamespace, err)
	}
	// Who the components are and what they may do, from the chart.
	if err := c.installChartIdentities(c.ctx, opts.Chart); err != nil {
		return c, err
	}
	if err := c.installPluginDaemonSet(c.ctx); err != nil {
		return c, err
	}
	// gpudra-controller runs in every devcluster, as the chart installs it
	// with its CRDs: every test and the demo go through its admission
	// webhook.
	if err := c.installGpudraCRDs(c.ctx); err != nil {
		return c, err
	}
	if opts.Image != nil {
		if c.image, err = imagemode.NewRunner(c.ctx, imagemode.Config{Dir: c.Dir, Admin: c.Client, APIServerHost: c.RESTConfig.Host,
			TokenLifetime: componentTokenLifetime}, *opts.Image); err != nil {
			return c, err
		}
		if err := c.startImageController(c.ctx); err != nil {
			return c, fmt.Errorf("start gpudra-controller from the image: %w", err)
		}
		return c, nil
	}
	if err := c.startGpudraController(c.ctx); err != nil {
		return c, fmt.Errorf("start gpudra-controller: %w", err)
	}
	return c, nil
}

// Nodes returns the nodes in the order they were added.
func (c *Cluster) Nodes() []*nodeagent.Node {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make([]*nodeagent.Node, 0, len(c.order))
	for _, name := range c.order {
		out = append(out, c.nodes[name])
	}
	return out
}

// Node returns the named node, or nil.
func (c *Cluster) Node(name string) *nodeagent.Node {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.nodes[name]
}

// Stop stops everything in the order that avoids the API server's long
// shutdown waits: plugins and kubelets, then scheduler and controllers,
// then the API server, then etcd. A second Stop does nothing.
func (c *Cluster) Stop() { c.stopOnce.Do(c.stop) }

func (c *Cluster) stop() {
	c.image.StopAll()
	c.mu.Lock()
	real := make([]*realnode.Node, 0, len(c.realNodes))
	for _, n := range c.realNodes {
		if n != nil {
			real = append(real, n)
		}
	}
	feeds := c.realNodeFeeds
	c.mu.Unlock()
	for _, stop := range feeds {
		stop()
	}
	for _, n := range real {
		n.Stop()
	}
	for _, n := range c.Nodes() {
		n.StopPlugin()
	}
	if c.cancel != nil {
		c.cancel()
	}
	for _, n := range c.Nodes() {
		if n.KubeletDone() != nil {
			waitOrTimeout(n.KubeletDone(), 10*time.Second)
		}
	}
	c.gpudra.stop()
	if c.controllers != nil {
		waitOrTimeout(c.controllers, 20*time.Second)
	}
	if c.grove != nil {
		waitOrTimeout(c.grove, 10*time.Second)
	}
	if c.apiServer.TearDownFn != nil {
		c.apiServer.TearDownFn()
	}
	if c.podNet != nil {
		c.podNet.Stop()
	}
	c.tb.RunCleanups()
	if c.etcd != nil {
		c.etcd.Close()
	}
	if c.releaseCerts != nil {
		c.releaseCerts()
	}
	if c.removeDir {
		_ = os.RemoveAll(c.Dir)
	}
}

func waitOrTimeout(ch <-chan struct{}, d time.Duration) {
	select {
	case <-ch:
	case <-time.After(d):
	}
}

// WriteKubeconfig writes a kubeconfig for the admin user, for kubectl.
func (c *Cluster) WriteKubeconfig(path string) error {
	return writeKubeconfig(path, c.RESTConfig, "admin")
}

// WriteNodeComponentKubeconfig writes a kubeconfig for a node agent run as
// a process of its own (the plugin binary): the chart's ServiceAccount sa
// with a token bound to the Node named node.
func (c *Cluster) WriteNodeComponentKubeconfig(ctx context.Context, path, sa, node string) error {
	cfg, err := c.nodeComponentConfig(ctx, sa, "", node)
	if err != nil {
		return err
	}
	return writeKubeconfig(path, cfg, sa)
}

// WriteServiceAccountKubeconfig writes a kubeconfig with a token of the
// ServiceAccount sa of namespace, for a component devcluster runs as its
// own process (Karpenter): it is that ServiceAccount, under RBAC.
func (c *Cluster) WriteServiceAccountKubeconfig(ctx context.Context, path, namespace, sa string) error {
	tok, err := c.Client.CoreV1().ServiceAccounts(namespace).CreateToken(ctx, sa, &authenticationv1.TokenRequest{
		Spec: authenticationv1.TokenRequestSpec{ExpirationSeconds: ptr.To(int64(componentTokenLifetime.Seconds()))}}, metav1.CreateOptions{})
	if err != nil {
		return fmt.Errorf("token for ServiceAccount %s/%s: %w", namespace, sa, err)
	}
	cfg := restclient.AnonymousClientConfig(c.RESTConfig)
	cfg.BearerToken = tok.Status.Token
	return writeKubeconfig(path, cfg, "system:serviceaccount:"+namespace+":"+sa)
}

func writeKubeconfig(path string, cfg *restclient.Config, userName string) error {
	kc := clientcmdapi.NewConfig()
	kc.Clusters["devcluster"] = &clientcmdapi.Cluster{Server: cfg.Host, CertificateAuthorityData: cfg.CAData,
		InsecureSkipTLSVerify: cfg.Insecure, TLSServerName: cfg.ServerName}
	user := &clientcmdapi.AuthInfo{Token: cfg.BearerToken, ClientCertificateData: cfg.CertData, ClientKeyData: cfg.KeyData}
	if cfg.CAFile != "" || cfg.CertFile != "" || cfg.KeyFile != "" {
		kc.Clusters["devcluster"].CertificateAuthority = cfg.CAFile
		user.ClientCertificate, user.ClientKey = cfg.CertFile, cfg.KeyFile
	}
	kc.AuthInfos[userName] = user
	kc.Contexts["devcluster"] = &clientcmdapi.Context{Cluster: "devcluster", AuthInfo: userName}
	kc.CurrentContext = "devcluster"
	if err := clientcmd.WriteToFile(*kc, path); err != nil {
		return fmt.Errorf("write kubeconfig: %w", err)
	}
	return nil
}

// NodeNames lists the nodes' names, sorted.
func (c *Cluster) NodeNames() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	names := make([]string, 0, len(c.nodes))
	for n := range c.nodes {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

// tempDir makes the cluster's directory, <os.TempDir()>/dc<8 hex digits>:
// always of one length, and short. The unix sockets below it (a node's
// plugin registration socket is about 90 bytes below it) must stay under
// the 108 bytes of a socket path whatever the random name: os.MkdirTemp's
// name is 1 to 10 digits long, and a name one digit longer once pushed a
// test's socket to 108 bytes.
func tempDir() (string, error) {
	for range 100 {
		var b [4]byte
		if _, err := rand.Read(b[:]); err != nil {
			return "", err
		}
		dir := filepath.Join(os.TempDir(), "dc"+hex.EncodeToString(b[:]))
		err := os.Mkdir(dir, 0o700)
		if err == nil {
			return dir, nil
		}
		if !errors.Is(err, os.ErrExist) {
			return "", err
		}
	}
	return "", errors.New("no free name for devcluster's directory in " + os.TempDir())
}
