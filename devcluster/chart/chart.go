// Package chart is gpudra's Helm chart as devcluster renders it: helm
// template of the repository's chart (or a rendering made ahead, which the
// gpu-smoke bundle carries instead of helm), with the release, namespace,
// image tag and per-node host paths devcluster installs it with, and the
// names of the identities it creates. Everything devcluster runs of gpudra
// takes its ServiceAccounts, RBAC, admission policies and pod specs from
// this rendering.
package chart

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
)

// The plugins' namespace, where they create MPS server pods, and the image
// those pods name (the devcluster kubelet runs them in-process, so it is
// never pulled).
const (
	PluginNamespace = "gpudra-system"
	MPSServerImage  = "ghcr.io/gpudra/gpudra:devcluster"
)

// The chart's release in devcluster and the identities it creates there.
const (
	Release = "gpudra"
	// PluginServiceAccount runs the kubelet plugin and the device-plugin
	// agent; ControllerServiceAccount both controller replicas;
	// MPSServerServiceAccount the MPS server pods (no permissions, no
	// token).
	PluginServiceAccount     = "gpudra-kubelet-plugin"
	ControllerServiceAccount = "gpudra-controller"
	MPSServerServiceAccount  = "gpudra-mps-server"
	// NodeNamePlaceholder stands for the node's name in the host paths
	// the chart is rendered with: each simulated node has directories of
	// its own, and the admission policy puts the requesting node's name
	// in its place.
	NodeNamePlaceholder = "$(NODE_NAME)"
)

// Options say where the chart and the helm binary that renders it are.
type Options struct {
	// Dir is the chart (deployments/helm/gpudra).
	Dir string
	// Helm is the helm binary (`make helm` builds bin/helm).
	Helm string
	// Rendered, when set, is the chart rendered ahead by Render with
	// RenderedDirPlaceholder as devcluster's directory (the gpu-smoke
	// bundle carries it instead of helm): Dir and Helm are then unused.
	Rendered string
	// Values are helm flags (--set ...) added when devcluster renders the
	// chart: image mode's, or a test's.
	Values []string
}

// RenderedDirPlaceholder stands for devcluster's directory in a chart
// rendered ahead (Options.Rendered).
const RenderedDirPlaceholder = "/@DEVCLUSTER_DIR@"

// Default is the chart of the repository at root, rendered by
// $HELM or root's bin/helm (`make helm`).
func Default(root string) Options {
	helm := os.Getenv("HELM")
	if helm == "" {
		helm = filepath.Join(root, "bin", "helm")
	}
	return Options{Dir: filepath.Join(root, "deployments", "helm", "gpudra"), Helm: helm}
}

// Render renders the chart as devcluster installs it: release gpudra
// in PluginNamespace, the devcluster image tag, the nodes' own directories
// below dir, gangs on; extra values (helm flags) are added last.
func Render(ctx context.Context, chart Options, dir string, extra ...string) (string, error) {
	if chart.Rendered != "" {
		if len(extra) > 0 {
			return "", fmt.Errorf("values %v need helm: the chart was rendered ahead (%s)", extra, chart.Rendered)
		}
		b, err := os.ReadFile(chart.Rendered)
		if err != nil {
			return "", fmt.Errorf("the chart rendered ahead: %w", err)
		}
		if !strings.Contains(string(b), RenderedDirPlaceholder) {
			return "", fmt.Errorf("%s was not rendered for devcluster: it has no %s", chart.Rendered, RenderedDirPlaceholder)
		}
		return strings.ReplaceAll(string(b), RenderedDirPlaceholder, dir), nil
	}
	if chart.Dir == "" || chart.Helm == "" {
		return "", fmt.Errorf("devcluster installs the chart's identities and needs the chart and helm (chart.Options %+v; `make helm` builds bin/helm)", chart)
	}
	nodeDir := filepath.Join(dir, "nodes", NodeNamePlaceholder)
	args := append([]string{"template", Release, chart.Dir, "--namespace", PluginNamespace, "--kube-version", "1.37.1",
		"--set-string", "image.tag=" + strings.TrimPrefix(MPSServerImage, "ghcr.io/gpudra/gpudra:"),
		// The node's directory stands for the kubelet's: the plugin's is
		// <node>/plugins/gpu.gpudra.dev (nodeagent.Node.PluginDataDir).
		"--set-string", "kubeletPlugin.kubeletDir=" + nodeDir,
		"--set-string", "kubeletPlugin.driverRoot=" + filepath.Join(nodeDir, "driver"),
		"--set", "gangs.enabled=true"}, extra...)
	out, err := exec.CommandContext(ctx, chart.Helm, args...).CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("helm template %s: %w: %s", chart.Dir, err, out)
	}
	return string(out), nil
}
