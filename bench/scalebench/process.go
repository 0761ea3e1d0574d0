package scalebench

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	"k8s.io/klog/v2"

	"github.com/gpudra/gpudra/devcluster"
	"github.com/gpudra/gpudra/devcluster/chart"
)

// controllerProcess is gpudra-controller running as the shipped binary:
// one replica, as the chart's ServiceAccount, gangs on, its webhook the
// one the API server calls.
type controllerProcess struct {
	cmd        *exec.Cmd
	metricsURL string
	log        *os.File
	done       chan struct{}
}

// startController replaces devcluster's in-process replicas by the
// binary: the replicas stop (giving up the lease), the binary starts with
// a kubeconfig for the chart's controller ServiceAccount, and the webhook
// configurations are pointed at its webhook. It returns once the binary
// leads and the API server trusts its webhook.
func startController(ctx context.Context, c *devcluster.Cluster, binary, dir string) (*controllerProcess, error) {
	for _, r := range c.Controllers() {
		if err := c.StopController(r); err != nil && ctx.Err() == nil {
			klog.FromContext(ctx).V(1).Info("In-process controller replica stopped with an error", "replica", r.Name, "err", err)
		}
	}
	cfg, err := c.ServiceAccountConfig(ctx, chart.ControllerServiceAccount, "")
	if err != nil {
		return nil, err
	}
	kubeconfig := filepath.Join(dir, "controller.kubeconfig")
	kc := clientcmdapi.NewConfig()
	kc.Clusters["devcluster"] = &clientcmdapi.Cluster{Server: cfg.Host, CertificateAuthorityData: cfg.CAData, CertificateAuthority: cfg.CAFile,
		InsecureSkipTLSVerify: cfg.Insecure, TLSServerName: cfg.ServerName}
	kc.AuthInfos["gpudra-controller"] = &clientcmdapi.AuthInfo{Token: cfg.BearerToken}
	kc.Contexts["devcluster"] = &clientcmdapi.Context{Cluster: "devcluster", AuthInfo: "gpudra-controller"}
	kc.CurrentContext = "devcluster"
	if err := clientcmd.WriteToFile(*kc, kubeconfig); err != nil {
		return nil, fmt.Errorf("write the controller's kubeconfig: %w", err)
	}
	webhookAddr, err := freeAddr()
	if err != nil {
		return nil, err
	}
	healthAddr, err := freeAddr()
	if err != nil {
		return nil, err
	}
	logFile, err := os.Create(filepath.Join(dir, "controller.log"))
	if err != nil {
		return nil, err
	}
	p := &controllerProcess{metricsURL: "http://" + healthAddr + "/metrics", log: logFile, done: make(chan struct{})}
	// The chart's settings (leader election, fence settle) but for the
	// addresses: no Service networking here.
	p.cmd = exec.Command(binary, "--kubeconfig="+kubeconfig, "--namespace="+chart.PluginNamespace, "--identity=gpudra-controller-bench",
		"--lease-name="+devcluster.ControllerLease, "--health-address="+healthAddr, "--webhook-address="+webhookAddr,
		"--webhook-ips=127.0.0.1", "--webhook-secret="+devcluster.WebhookSecret, "--webhook-configuration="+devcluster.WebhookConfigurationName,
		"--gangs=true", "-v=1")
	p.cmd.Env = []string{"PATH=" + os.Getenv("PATH")}
	p.cmd.Stdout, p.cmd.Stderr = logFile, logFile
	if err := p.cmd.Start(); err != nil {
		logFile.Close()
		return nil, fmt.Errorf("start %s: %w", binary, err)
	}
	go func() { _ = p.cmd.Wait(); close(p.done) }()
	if err := pointWebhooks(ctx, c, webhookAddr); err != nil {
		p.stop()
		return nil, err
	}
	var last error
	err = wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 90*time.Second, true, func(ctx context.Context) (bool, error) {
		select {
		case <-p.done:
			return false, fmt.Errorf("gpudra-controller exited (log: %s)", logFile.Name())
		default:
		}
		if last = webhookTrusted(ctx, c, webhookAddr); last != nil {
			return false, nil
		}
		m, err := p.metrics(ctx)
		if err != nil {
			last = err
			return false, nil
		}
		if m["gpudra_controller_leader"] != 1 {
			last = errors.New("not leading yet")
			return false, nil
		}
		return true, nil
	})
	if err != nil {
		p.stop()
		return nil, fmt.Errorf("gpudra-controller not ready (log: %s): %w", logFile.Name(), errors.Join(err, last))
	}
	return p, nil
}

// pointWebhooks points every webhook of devcluster's configurations at
// addr, keeping each URL's path (/validate, /mutate).
func pointWebhooks(ctx context.Context, c *devcluster.Cluster, addr string) error {
	repoint := func(u *string) error {
		if u == nil {
			return nil
		}
		parsed, err := url.Parse(*u)
		if err != nil {
			return err
		}
		parsed.Host = addr
		*u = parsed.String()
		return nil
	}
	api := c.Client.AdmissionregistrationV1()
	v, err := api.ValidatingWebhookConfigurations().Get(ctx, devcluster.WebhookConfigurationName, metav1.GetOptions{})
	if err != nil {
		return err
	}
	for i := range v.Webhooks {
		if err := repoint(v.Webhooks[i].ClientConfig.URL); err != nil {
			return err
		}
	}
	if _, err := api.ValidatingWebhookConfigurations().Update(ctx, v, metav1.UpdateOptions{}); err != nil {
		return fmt.Errorf("point the ValidatingWebhookConfiguration at the controller: %w", err)
	}
	m, err := api.MutatingWebhookConfigurations().Get(ctx, devcluster.WebhookConfigurationName, metav1.GetOptions{})
	if err != nil {
		return err
	}
	for i := range m.Webhooks {
		if err := repoint(m.Webhooks[i].ClientConfig.URL); err != nil {
			return err
		}
	}
	if _, err := api.MutatingWebhookConfigurations().Update(ctx, m, metav1.UpdateOptions{}); err != nil {
		return fmt.Errorf("point the MutatingWebhookConfiguration at the controller: %w", err)
	}
	return nil
}

// webhookTrusted: the webhook at addr serves a certificate that the
// caBundles of both configurations trust, what the API server checks.
func webhookTrusted(ctx context.Context, c *devcluster.Cluster, addr string) error {
	api := c.Client.AdmissionregistrationV1()
	v, err := api.ValidatingWebhookConfigurations().Get(ctx, devcluster.WebhookConfigurationName, metav1.GetOptions{})
	if err != nil {
		return err
	}
	m, err := api.MutatingWebhookConfigurations().Get(ctx, devcluster.WebhookConfigurationName, metav1.GetOptions{})
	if err != nil {
		return err
	}
	var bundles [][]byte
	for _, w := range v.Webhooks {
		bundles = append(bundles, w.ClientConfig.CABundle)
	}
	for _, w := range m.Webhooks {
		bundles = append(bundles, w.ClientConfig.CABundle)
	}
	for _, b := range bundles {
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(b) {
			return errors.New("no caBundle yet")
		}
		conn, err := tls.Dial("tcp", addr, &tls.Config{RootCAs: pool, ServerName: "127.0.0.1"})
		if err != nil {
			return err
		}
		_ = conn.Close()
	}
	return nil
}

// metrics scrapes the controller's /metrics: the value of every sample
// without labels, and the sum over labels of each name ("name" keys both).
func (p *controllerProcess) metrics(ctx context.Context) (map[string]float64, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, p.metricsURL, nil)
	if err != nil {
		return nil, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("%s: %s", p.metricsURL, resp.Status)
	}
	return parseMetrics(resp.Body)
}

// parseMetrics reads the Prometheus text format: samples summed per
// metric name (labels dropped), histogram _sum and _count included.
func parseMetrics(r io.Reader) (map[string]float64, error) {
	out := map[string]float64{}
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		name, rest, _ := strings.Cut(line, " ")
		if i := strings.IndexByte(line, '{'); i >= 0 && i < len(name) {
			name = line[:i]
			j := strings.LastIndexByte(line, '}')
			if j < 0 {
				continue
			}
			rest = strings.TrimSpace(line[j+1:])
		}
		// A timestamp may follow the value.
		val, _, _ := strings.Cut(strings.TrimSpace(rest), " ")
		v, err := strconv.ParseFloat(val, 64)
		if err != nil {
			continue
		}
		if strings.HasSuffix(name, "_bucket") {
			continue
		}
		out[name] += v
	}
	return out, sc.Err()
}

func (p *controllerProcess) pid() int { return p.cmd.Process.Pid }

// stop ends the process as a deleted pod ends (SIGTERM, then SIGKILL).
func (p *controllerProcess) stop() {
	if p == nil || p.cmd.Process == nil {
		return
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(10 * time.Second):
		_ = p.cmd.Process.Kill()
		<-p.done
	}
	_ = p.log.Close()
}

func freeAddr() (string, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", fmt.Errorf("find a free port: %w", err)
	}
	defer l.Close()
	return l.Addr().String(), nil
}

// procMemory reads VmRSS and VmHWM (bytes) of a process ("self" for
// this one).
func procMemory(pid string) (rss, hwm uint64, err error) {
	f, err := os.Open("/proc/" + pid + "/status")
	if err != nil {
		return 0, 0, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		name, v, _ := strings.Cut(sc.Text(), ":")
		if name != "VmRSS" && name != "VmHWM" {
			continue
		}
		kb, err := strconv.ParseUint(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
		if err != nil {
			return 0, 0, fmt.Errorf("%s %q: %w", name, v, err)
		}
		if name == "VmRSS" {
			rss = kb << 10
		} else {
			hwm = kb << 10
		}
	}
	return rss, hwm, sc.Err()
}

// clockTicks is USER_HZ, 100 on every Linux the benchmark runs on (no cgo
// for sysconf).
const clockTicks = 100

// procCPU is the process's user plus system CPU time so far.
func procCPU(pid string) (time.Duration, error) {
	data, err := os.ReadFile("/proc/" + pid + "/stat")
	if err != nil {
		return 0, err
	}
	// The command name, in parentheses, may hold spaces: fields count
	// from after it (utime and stime are fields 14 and 15).
	s := string(data)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return 0, errors.New("malformed /proc/<pid>/stat")
	}
	f := strings.Fields(s[i+1:])
	if len(f) < 13 {
		return 0, errors.New("short /proc/<pid>/stat")
	}
	utime, err1 := strconv.ParseInt(f[11], 10, 64)
	stime, err2 := strconv.ParseInt(f[12], 10, 64)
	if err := errors.Join(err1, err2); err != nil {
		return 0, err
	}
	return time.Duration(utime+stime) * time.Second / clockTicks, nil
}
