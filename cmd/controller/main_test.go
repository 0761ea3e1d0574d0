package main

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpudra/gpudra/pkg/component"
	"github.com/gpudra/gpudra/pkg/controller/gang"
)

func TestOptions(t *testing.T) {
	for name, tc := range map[string]struct {
		args    []string
		env     map[string]string
		wantErr string
		check   func(t *testing.T, o *options)
	}{
		"chart's environment": {
			env: map[string]string{"POD_NAMESPACE": "gpudra", "POD_NAME": "gpudra-controller-abc", "WEBHOOK_SERVICE": "g-webhook",
				"MANAGE_CERTIFICATES": "false", "LEADER_ELECT_LEASE_DURATION": "30s", "WEBHOOK_IPS": "10.0.0.1"},
			check: func(t *testing.T, o *options) {
				cfg, err := o.config()
				require.NoError(t, err)
				assert.Equal(t, "gpudra-controller-abc", cfg.Identity)
				assert.Equal(t, []string{"g-webhook.gpudra.svc", "g-webhook.gpudra.svc.cluster.local"}, cfg.WebhookDNSNames)
				assert.False(t, cfg.ManageCertificates)
				assert.Equal(t, "30s", cfg.LeaseDuration.String())
				assert.Equal(t, "10.0.0.1", cfg.WebhookIPs[0].String())
			},
		},
		"the command line wins": {
			args: []string{"--namespace=a"}, env: map[string]string{"POD_NAMESPACE": "b"},
			check: func(t *testing.T, o *options) { assert.Equal(t, "a", o.namespace) },
		},
		"node pools: the defaults": {args: []string{"--namespace=a"},
			check: func(t *testing.T, o *options) {
				cfg, err := o.config()
				require.NoError(t, err)
				assert.Equal(t, gang.DefaultNodePoolLabels, cfg.NodePoolLabels)
			},
		},
		"node pools from the chart's environment": {env: map[string]string{"POD_NAMESPACE": "a", "NODE_POOL_LABELS": "example.com/pool,karpenter.sh/nodepool"},
			check: func(t *testing.T, o *options) {
				cfg, err := o.config()
				require.NoError(t, err)
				assert.Equal(t, []string{"example.com/pool", "karpenter.sh/nodepool"}, cfg.NodePoolLabels)
			},
		},
		"node pools off": {args: []string{"--namespace=a", "--node-pool-labels="},
			check: func(t *testing.T, o *options) {
				cfg, err := o.config()
				require.NoError(t, err)
				assert.NotNil(t, cfg.NodePoolLabels, "empty, not nil: nil would be the defaults")
				assert.Empty(t, cfg.NodePoolLabels)
			},
		},
		"autoscaler demand: capacitybuffers by default": {args: []string{"--namespace=a"},
			check: func(t *testing.T, o *options) {
				cfg, err := o.config()
				require.NoError(t, err)
				assert.Equal(t, gang.AutoscalerDemandCapacityBuffers, cfg.AutoscalerDemand)
			},
		},
		"autoscaler demand off from the chart's environment": {env: map[string]string{"POD_NAMESPACE": "a", "AUTOSCALER_DEMAND": "off"},
			check: func(t *testing.T, o *options) {
				cfg, err := o.config()
				require.NoError(t, err)
				assert.Equal(t, gang.AutoscalerDemandOff, cfg.AutoscalerDemand)
			},
		},
		"autoscaler demand: an unknown value": {args: []string{"--namespace=a", "--autoscaler-demand=pods"},
			wantErr: `--autoscaler-demand="pods": want capacitybuffers or off`},
		"nodes protected from autoscalers by default": {args: []string{"--namespace=a"},
			check: func(t *testing.T, o *options) {
				cfg, err := o.config()
				require.NoError(t, err)
				assert.True(t, cfg.ProtectNodes)
			},
		},
		"nodes not protected, from the chart's environment": {env: map[string]string{"POD_NAMESPACE": "a", "PROTECT_NODES_FROM_AUTOSCALERS": "false"},
			check: func(t *testing.T, o *options) {
				cfg, err := o.config()
				require.NoError(t, err)
				assert.False(t, cfg.ProtectNodes)
			},
		},
		"no namespace": {wantErr: "--namespace (env POD_NAMESPACE) is required"},
		"renew after the lease": {args: []string{"--namespace=a", "--leader-elect-renew-deadline=20s"},
			wantErr: "--leader-elect-renew-deadline (20s) must be shorter than --leader-elect-lease-duration (15s)"},
		"a malformed environment value": {env: map[string]string{"KUBE_API_BURST": "many"}, wantErr: "KUBE_API_BURST"},
	} {
		t.Run(name, func(t *testing.T) {
			c := component.New("gpudra-controller")
			o := addFlags(c.Flags)
			err := c.Parse(tc.args, func(k string) (string, bool) { v, ok := tc.env[k]; return v, ok })
			if err == nil {
				_, err = o.config()
				if tc.wantErr == "" {
					require.NoError(t, err)
					tc.check(t, o)
					return
				}
			}
			require.Error(t, err)
			assert.Contains(t, err.Error(), tc.wantErr)
		})
	}
}
