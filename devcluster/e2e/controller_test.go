package e2e

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	restclient "k8s.io/client-go/rest"

	"github.com/gpudra/gpudra/devcluster"
	"github.com/gpudra/gpudra/devcluster/chart"
	"github.com/gpudra/gpudra/pkg/controller"
	"github.com/gpudra/gpudra/pkg/webhook"
)

func leaseHolder(ctx context.Context) string {
	l, err := cluster.Client.CoordinationV1().Leases(chart.PluginNamespace).Get(ctx, devcluster.ControllerLease, metav1.GetOptions{})
	if err != nil || l.Spec.HolderIdentity == nil {
		return ""
	}
	return *l.Spec.HolderIdentity
}

// certificateEvents counts the Events the leader-only certificate manager
// recorded: each one is a certificate issued.
func certificateEvents(t *testing.T, ctx context.Context) int {
	events, err := cluster.Client.EventsV1().Events(chart.PluginNamespace).List(ctx, metav1.ListOptions{})
	require.NoError(t, err)
	n := 0
	for _, e := range events.Items {
		if e.Reason == webhook.ReasonCertificateIssued && e.Regarding.Name == devcluster.WebhookSecret {
			n++
			if e.Series != nil {
				n += int(e.Series.Count) - 1
			}
		}
	}
	return n
}

// TestControllerLeaderFailover: of the two replicas one leads; stopped, the
// other takes the lease over within the lease duration and carries on with
// the leader-only work without doing it again: the valid certificate is
// kept, and no second WebhookCertificateIssued Event appears. The webhook,
// served by every replica, keeps refusing bad configs throughout.
func TestControllerLeaderFailover(t *testing.T) {
	ctx := context.Background()
	ns := namespace(t)
	replicas := cluster.Controllers()
	require.Len(t, replicas, 2)
	var leader string
	require.Eventually(t, func() bool { leader = leaseHolder(ctx); return leader != "" }, 30*time.Second, 100*time.Millisecond)
	require.Eventually(t, func() bool { return certificateEvents(t, ctx) >= 1 }, 30*time.Second, 200*time.Millisecond)
	issued := certificateEvents(t, ctx)
	secret, err := cluster.Client.CoreV1().Secrets(chart.PluginNamespace).Get(ctx, devcluster.WebhookSecret, metav1.GetOptions{})
	require.NoError(t, err)

	var stop, other *devcluster.Controller
	for _, r := range replicas {
		if r.Name == leader {
			stop = r
		} else {
			other = r
		}
	}
	require.NotNil(t, stop, "leader %q is one of the replicas", leader)
	require.NoError(t, cluster.StopController(stop))
	stopped := time.Now()
	require.Eventually(t, func() bool { return leaseHolder(ctx) == other.Name }, devcluster.ControllerLeaseDuration, 50*time.Millisecond,
		"the other replica leads within the lease duration")
	t.Logf("%s took over from %s in %s", other.Name, leader, time.Since(stopped).Round(time.Millisecond))
	// A replacement, as the Deployment would start one: two replicas again
	// for the tests that follow. It joins as a follower.
	_, err = cluster.StartController(stop.Name + "-next")
	require.NoError(t, err)

	// The webhook keeps working through the change.
	err = createClaim(ctx, ns, "bad", gpuClaimSpec(webhook.DriverName, badConfig))
	require.Error(t, err)
	assert.Contains(t, err.Error(), "spec.devices.config[0].opaque.parameters")

	// Give the new leader's certificate manager time to run, then check it
	// did nothing twice.
	time.Sleep(3 * time.Second)
	after, err := cluster.Client.CoreV1().Secrets(chart.PluginNamespace).Get(ctx, devcluster.WebhookSecret, metav1.GetOptions{})
	require.NoError(t, err)
	assert.Equal(t, secret.Data["tls.crt"], after.Data["tls.crt"], "the new leader keeps the valid certificate")
	assert.Equal(t, issued, certificateEvents(t, ctx), "no certificate issued, or reported, twice")
	assert.Equal(t, other.Name, leaseHolder(ctx), "no flapping")
}

// TestChartControllerLeastPrivilege installs the chart's controller RBAC
// (a release named gpudra-alt) and runs the real controller as the chart's
// ServiceAccount, under Node,RBAC: it takes its Lease, issues its
// certificate into its Secret, sets the caBundle of its own webhook
// configuration and serves; and it may do nothing beyond what that needs.
func TestChartControllerLeastPrivilege(t *testing.T) {
	ctx := context.Background()
	const release = "gpudra-alt"
	out, err := render(t, "--set", "fullnameOverride="+release)
	require.NoError(t, err, out)
	_, err = cluster.Client.CoreV1().Namespaces().Create(ctx, &v1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: chartNamespace}}, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		require.NoError(t, err)
	}
	var rbac []*unstructured.Unstructured
	var vwc admissionregistrationv1.ValidatingWebhookConfiguration
	for _, o := range objectsFrom(t, out) {
		switch {
		case o.GetKind() == "ValidatingWebhookConfiguration":
			require.NoError(t, runtimeConvert(o, &vwc))
		case strings.HasSuffix(o.GetName(), "-controller") && o.GetKind() != "Deployment":
			rbac = append(rbac, o)
		}
	}
	require.Len(t, rbac, 5, "ServiceAccount, ClusterRole, ClusterRoleBinding, Role, RoleBinding")
	require.NoError(t, cluster.Apply(ctx, chartNamespace, rbac))
	// The chart's configuration, but matching no object: nothing serves
	// its Service in devcluster, and failurePolicy Fail would block
	// everyone's gpudra claims.
	require.Equal(t, release+"-webhook", vwc.Name)
	for i := range vwc.Webhooks {
		vwc.Webhooks[i].ObjectSelector = &metav1.LabelSelector{MatchLabels: map[string]string{"gpudra.dev/test": "never"}}
	}
	_, err = cluster.Client.AdmissionregistrationV1().ValidatingWebhookConfigurations().Create(ctx, &vwc, metav1.CreateOptions{})
	require.NoError(t, err)
	defer func() {
		_ = cluster.Client.AdmissionregistrationV1().ValidatingWebhookConfigurations().Delete(ctx, vwc.Name, metav1.DeleteOptions{})
	}()

	user := "system:serviceaccount:" + chartNamespace + ":" + release + "-controller"
	cfg := restclient.CopyConfig(cluster.RESTConfig)
	cfg.Impersonate = restclient.ImpersonationConfig{UserName: user,
		Groups: []string{"system:serviceaccounts", "system:serviceaccounts:" + chartNamespace, "system:authenticated"}}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	service := release + "-webhook." + chartNamespace + ".svc"
	go func() {
		done <- controller.Run(runCtx, controller.Config{RESTConfig: cfg, Namespace: chartNamespace, Identity: "rbac-test",
			LeaseName: release + "-controller", LeaseDuration: 4 * time.Second, RenewDeadline: 3 * time.Second, RetryPeriod: 200 * time.Millisecond,
			WebhookListener: l, WebhookSecret: release + "-webhook-cert", WebhookConfiguration: vwc.Name, ManageCertificates: true,
			WebhookDNSNames: []string{service}, CertReloadPeriod: 200 * time.Millisecond})
	}()
	defer func() {
		stop()
		assert.NoError(t, <-done)
	}()

	// What it needs: the lease, the Secret, the caBundle, then it serves.
	var last error
	require.Eventually(t, func() bool {
		last = func() error {
			got, err := cluster.Client.AdmissionregistrationV1().ValidatingWebhookConfigurations().Get(ctx, vwc.Name, metav1.GetOptions{})
			if err != nil {
				return err
			}
			pool := x509.NewCertPool()
			for _, w := range got.Webhooks {
				if len(w.ClientConfig.CABundle) == 0 {
					return fmt.Errorf("webhook %s has no caBundle", w.Name)
				}
			}
			pool.AppendCertsFromPEM(got.Webhooks[0].ClientConfig.CABundle)
			conn, err := tls.Dial("tcp", l.Addr().String(), &tls.Config{RootCAs: pool, ServerName: service})
			if err != nil {
				return err
			}
			return conn.Close()
		}()
		return last == nil
	}, 30*time.Second, 200*time.Millisecond, "the controller, as its ServiceAccount, never served with its caBundle set: %v", &last)
	lease, err := cluster.Client.CoordinationV1().Leases(chartNamespace).Get(ctx, release+"-controller", metav1.GetOptions{})
	require.NoError(t, err)
	assert.Equal(t, "rbac-test", *lease.Spec.HolderIdentity)

	// And nothing more.
	sa := impersonate(t, user, "")
	forbidden := map[string]error{}
	_, forbidden["another webhook configuration"] = sa.AdmissionregistrationV1().ValidatingWebhookConfigurations().Get(ctx, devcluster.WebhookConfigurationName, metav1.GetOptions{})
	_, forbidden["listing webhook configurations"] = sa.AdmissionregistrationV1().ValidatingWebhookConfigurations().List(ctx, metav1.ListOptions{})
	_, forbidden["listing secrets"] = sa.CoreV1().Secrets(chartNamespace).List(ctx, metav1.ListOptions{})
	_, forbidden["devcluster's webhook Secret"] = sa.CoreV1().Secrets(chart.PluginNamespace).Get(ctx, devcluster.WebhookSecret, metav1.GetOptions{})
	_, forbidden["another Lease"] = sa.CoordinationV1().Leases(chart.PluginNamespace).Get(ctx, devcluster.ControllerLease, metav1.GetOptions{})
	_, forbidden["creating pods"] = sa.CoreV1().Pods("default").Create(ctx, &v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "x"},
		Spec: v1.PodSpec{Containers: []v1.Container{{Name: "c", Image: "x"}}}}, metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
	forbidden["deleting pods"] = sa.CoreV1().Pods("default").DeleteCollection(ctx, metav1.DeleteOptions{DryRun: []string{metav1.DryRunAll}}, metav1.ListOptions{})
	forbidden["deleting the Lease"] = sa.CoordinationV1().Leases(chartNamespace).Delete(ctx, release+"-controller", metav1.DeleteOptions{DryRun: []string{metav1.DryRunAll}})
	for what, err := range forbidden {
		assert.True(t, apierrors.IsForbidden(err), "%s: %v", what, err)
	}
	_, err = sa.ResourceV1().ResourceClaims("").List(ctx, metav1.ListOptions{Limit: 1})
	assert.NoError(t, err, "reading claims cluster-wide")
	// The gang and reservation controller creates the claims it holds and
	// fences devices.
	_, err = sa.ResourceV1().ResourceClaims("default").Create(ctx, &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Name: "x"}},
		metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
	assert.NoError(t, err, "creating claims")
	_, err = sa.ResourceV1().DeviceTaintRules().List(ctx, metav1.ListOptions{Limit: 1})
	assert.NoError(t, err, "reading DeviceTaintRules")
	_, err = sa.CoreV1().Pods("").List(ctx, metav1.ListOptions{Limit: 1})
	assert.NoError(t, err, "reading pods cluster-wide")
}
