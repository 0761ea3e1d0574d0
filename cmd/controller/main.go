// Command gpudra-controller is the cluster side of gpudra: the admission
// webhook (every replica) and, on the elected leader, the controllers and
// the webhook's certificate manager.
package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
	"time"

	"github.com/spf13/pflag"
	"k8s.io/component-base/featuregate"

	"github.com/gpudra/gpudra/pkg/allocator"
	"github.com/gpudra/gpudra/pkg/component"
	"github.com/gpudra/gpudra/pkg/controller"
	"github.com/gpudra/gpudra/pkg/controller/gang"
	"github.com/gpudra/gpudra/pkg/kubeclient"
)

func main() {
	c := component.New("gpudra-controller")
	o := addFlags(c.Flags)
	c.Main(func(ctx context.Context) error { return run(ctx, o, c.Features) })
}

// options are the controller's flags. Each has an environment variable (the
// chart sets those); the command line wins over it.
type options struct {
	kubeconfig, namespace, identity, leaseName, healthAddr, webhookAddr string
	webhookSecret, webhookConfig, webhookService                        string
	webhookDNSNames, nodePoolLabels                                     []string
	webhookIPs                                                          []net.IP
	manageCerts, gangs, protectNodes                                    bool
	gangStrategy, gangMode, autoscalerDemand                            string
	fenceSettle                                                         time.Duration
	qps                                                                 float64
	burst                                                               int
	leaseDuration, renewDeadline, retryPeriod, grovePendingGrace        time.Duration
}

func addFlags(fs *pflag.FlagSet) *options {
	o := &options{}
	env := func(flag, env string) { component.EnvVar(fs, flag, env) }
	fs.StringVar(&o.kubeconfig, "kubeconfig", "", "kubeconfig; in-cluster config when empty")
	env("kubeconfig", "KUBECONFIG")
	fs.StringVar(&o.namespace, "namespace", "", "this pod's namespace: the Lease and the webhook's certificate Secret are there")
	env("namespace", "POD_NAMESPACE")
	fs.StringVar(&o.identity, "identity", "", "this replica's name in the leader Lease; default: the host name")
	env("identity", "POD_NAME")
	fs.StringVar(&o.leaseName, "lease-name", "gpudra-controller", "the leader election Lease")
	env("lease-name", "LEASE_NAME")
	fs.DurationVar(&o.leaseDuration, "leader-elect-lease-duration", 15*time.Second, "how long followers wait before taking an unrenewed lease")
	env("leader-elect-lease-duration", "LEADER_ELECT_LEASE_DURATION")
	fs.DurationVar(&o.renewDeadline, "leader-elect-renew-deadline", 10*time.Second, "how long the leader tries to renew before it gives up leading")
	env("leader-elect-renew-deadline", "LEADER_ELECT_RENEW_DEADLINE")
	fs.DurationVar(&o.retryPeriod, "leader-elect-retry-period", 2*time.Second, "how often replicas try to take or renew the lease")
	env("leader-elect-retry-period", "LEADER_ELECT_RETRY_PERIOD")
	fs.StringVar(&o.healthAddr, "health-address", ":9478", "serves /healthz, /readyz and /metrics; empty disables")
	env("health-address", "HEALTH_ADDRESS")
	fs.StringVar(&o.webhookAddr, "webhook-address", ":9443", "the admission webhook's HTTPS address; empty: no webhook")
	env("webhook-address", "WEBHOOK_ADDRESS")
	fs.StringVar(&o.webhookSecret, "webhook-secret", "gpudra-webhook-cert", "the Secret holding the webhook's serving certificate (tls.crt, tls.key, ca.crt)")
	env("webhook-secret", "WEBHOOK_SECRET")
	fs.StringVar(&o.webhookConfig, "webhook-configuration", "gpudra-webhook", "the ValidatingWebhookConfiguration whose caBundle the leader keeps current")
	env("webhook-configuration", "WEBHOOK_CONFIGURATION")
	fs.StringVar(&o.webhookService, "webhook-service", "gpudra-webhook", "the webhook's Service: the certificate is issued for <service>.<namespace>.svc")
	env("webhook-service", "WEBHOOK_SERVICE")
	fs.StringSliceVar(&o.webhookDNSNames, "webhook-dns-names", nil, "more DNS names for the serving certificate")
	env("webhook-dns-names", "WEBHOOK_DNS_NAMES")
	fs.IPSliceVar(&o.webhookIPs, "webhook-ips", nil, "IP addresses for the serving certificate")
	env("webhook-ips", "WEBHOOK_IPS")
	fs.DurationVar(&o.grovePendingGrace, "grove-pending-grace", 2*time.Minute, "how long a Grove sharing group's consumer may stay Pending on its claim before the controller reports it")
	env("grove-pending-grace", "GROVE_PENDING_GRACE")
	fs.BoolVar(&o.manageCerts, "manage-certificates", true, "the leader issues and renews the webhook's CA and certificate and sets the caBundle; false when cert-manager does")
	env("manage-certificates", "MANAGE_CERTIFICATES")
	fs.BoolVar(&o.gangs, "gangs", true, "run the gang and reservation controller (where the gpudra.dev CRDs are installed)")
	env("gangs", "GANGS")
	fs.StringVar(&o.gangMode, "gang-mode", controller.GangModeAuto, "how gangs reach the scheduler: auto (kube-scheduler's Workload API where scheduling.k8s.io/v1beta1 PodGroups are served, else the gate path where resource.k8s.io/v1 DeviceTaintRules are, else off), workload, gates, or off (gang pods schedule as plain pods)")
	env("gang-mode", "GANG_MODE")
	fs.StringVar(&o.gangStrategy, "gang-strategy", string(allocator.FewestNVLinkDomains), "how gangs and reservations choose nodes: FewestNVLinkDomains, Binpack or Spread")
	env("gang-strategy", "GANG_STRATEGY")
	fs.StringVar(&o.autoscalerDemand, "autoscaler-demand", gang.AutoscalerDemandCapacityBuffers, "how gangs and reservations waiting for devices are shown to an autoscaler (Karpenter, Cluster Autoscaler): capacitybuffers (autoscaling.x-k8s.io/v1beta1 CapacityBuffers, where the API server serves them) or off")
	env("autoscaler-demand", "AUTOSCALER_DEMAND")
	fs.DurationVar(&o.fenceSettle, "fence-settle", time.Second, "how long a device fence is given to reach the scheduler before the controller writes an allocation")
	env("fence-settle", "FENCE_SETTLE")
	fs.StringSliceVar(&o.nodePoolLabels, "node-pool-labels", gang.DefaultNodePoolLabels, "node label keys naming a node's pool, tried in order, for gpudra_class_devices' and gpudra_class_demand_devices' node_pool (a node with none of them: \"\"); empty: no pools")
	env("node-pool-labels", "NODE_POOL_LABELS")
	fs.BoolVar(&o.protectNodes, "protect-nodes-from-autoscalers", true, "annotate nodes that hold gpudra devices in use (allocated claims, held reservations, gangs being admitted) with karpenter.sh/do-not-disrupt and cluster-autoscaler.kubernetes.io/scale-down-disabled, and remove them once the node holds nothing; false: remove the ones gpudra set")
	env("protect-nodes-from-autoscalers", "PROTECT_NODES_FROM_AUTOSCALERS")
	fs.Float64Var(&o.qps, "kube-api-qps", 20, "API client QPS (kube-controller-manager's default)")
	env("kube-api-qps", "KUBE_API_QPS")
	fs.IntVar(&o.burst, "kube-api-burst", 30, "API client burst")
	env("kube-api-burst", "KUBE_API_BURST")
	return o
}

// config turns the flags into the controller's configuration.
func (o *options) config() (controller.Config, error) {
	var errs []error
	if o.namespace == "" {
		errs = append(errs, errors.New("--namespace (env POD_NAMESPACE) is required"))
	}
	if o.renewDeadline >= o.leaseDuration {
		errs = append(errs, fmt.Errorf("--leader-elect-renew-deadline (%s) must be shorter than --leader-elect-lease-duration (%s)", o.renewDeadline, o.leaseDuration))
	}
	if err := errors.Join(errs...); err != nil {
		return controller.Config{}, err
	}
	id := o.identity
	if id == "" {
		var err error
		if id, err = os.Hostname(); err != nil {
			return controller.Config{}, fmt.Errorf("no --identity and no host name: %w", err)
		}
	}
	switch allocator.Strategy(o.gangStrategy) {
	case allocator.FewestNVLinkDomains, allocator.Binpack, allocator.Spread:
	default:
		return controller.Config{}, fmt.Errorf("--gang-strategy=%q: want FewestNVLinkDomains, Binpack or Spread", o.gangStrategy)
	}
	switch o.gangMode {
	case controller.GangModeAuto, controller.GangModeWorkload, controller.GangModeGates, controller.GangModeOff:
	default:
		return controller.Config{}, fmt.Errorf("--gang-mode=%q: want auto, workload, gates or off", o.gangMode)
	}
	switch o.autoscalerDemand {
	case gang.AutoscalerDemandCapacityBuffers, gang.AutoscalerDemandOff:
	default:
		return controller.Config{}, fmt.Errorf("--autoscaler-demand=%q: want capacitybuffers or off", o.autoscalerDemand)
	}
	svc := o.webhookService + "." + o.namespace + ".svc"
	dns := append([]string{svc, svc + ".cluster.local"}, o.webhookDNSNames...)
	return controller.Config{Namespace: o.namespace, Identity: id, LeaseName: o.leaseName,
		LeaseDuration: o.leaseDuration, RenewDeadline: o.renewDeadline, RetryPeriod: o.retryPeriod,
		HealthAddress: o.healthAddr, WebhookAddress: o.webhookAddr, WebhookSecret: o.webhookSecret,
		WebhookConfiguration: o.webhookConfig, ManageCertificates: o.manageCerts,
		WebhookDNSNames: dns, WebhookIPs: o.webhookIPs, GrovePendingGrace: o.grovePendingGrace,
		Gangs: o.gangs, GangMode: o.gangMode, GangStrategy: allocator.Strategy(o.gangStrategy), FenceSettle: o.fenceSettle,
		NodePoolLabels: nodePoolLabels(o.nodePoolLabels), AutoscalerDemand: o.autoscalerDemand, ProtectNodes: o.protectNodes}, nil
}

// nodePoolLabels drops empty keys: --node-pool-labels= (an empty list) is
// no pools, not the defaults.
func nodePoolLabels(keys []string) []string {
	out := []string{}
	for _, k := range keys {
		if k = strings.TrimSpace(k); k != "" {
			out = append(out, k)
		}
	}
	return out
}

func run(ctx context.Context, o *options, _ featuregate.FeatureGate) error {
	cfg, err := o.config()
	if err != nil {
		return err
	}
	if cfg.RESTConfig, err = kubeclient.RESTConfig(o.kubeconfig); err != nil {
		return err
	}
	cfg.RESTConfig.QPS, cfg.RESTConfig.Burst = float32(o.qps), o.burst
	cfg.RESTConfig.UserAgent = "gpudra-controller/" + strings.ReplaceAll(cfg.Identity, "/", "_")
	return controller.Run(ctx, cfg)
}
