// Package realnode runs a real node beside devcluster's simulated ones: the
// kubelet binary built from k8s.io/kubernetes/cmd/kubelet at devcluster's
// Kubernetes version and containerd 2.x with its CRI plugin, a
// containerd-shim-runc-v2, runc and the CNI plugins, all built by make from
// the Go module proxy and run as processes of their own. The kubelet joins
// devcluster's control plane with a node credential (a client certificate
// for system:node:<name>, group system:nodes) under Node,RBAC and
// NodeRestriction, as a kubelet does after its TLS bootstrap. Nothing here
// plays the kubelet or the runtime: devcluster writes their configuration,
// imports the images, starts and stops the processes. The one stand-in is
// kube-proxy's rule for the kubernetes Service (Options.APIServerVIP): its
// address, served in containerd's network namespace and forwarded to the
// API server.
//
// Where this machine is not a normal node, the settings that let the real
// binaries run are in kubeletConfig and containerdConfig, each with its
// reason; docs/devcluster.md ("A real node") lists them.
package realnode

import (
	"fmt"
	"strings"
)

// kubeletConfig is the kubelet's KubeletConfiguration file.
//   - cgroup v1 (this machine has no v2): failCgroupV1 false, and no QoS
//     cgroups or node allocatable enforcement (cgroupsPerQOS false,
//     enforceNodeAllocatable empty): the kubelet runs inside a container
//     whose cgroups it may not reparent.
//   - failSwapOn false: the kubelet refuses a machine with swap otherwise.
//   - no cluster DNS and no resolv.conf: pods get none (MissingClusterDNS
//     events say so).
//   - its server on port, authenticating nobody: the API server does not
//     reach it here (nothing calls logs or exec through it).
//   - the pod logs under dir, not /var/log/pods.
func kubeletConfig(dir, runtimeSocket string, port int) string {
	return fmt.Sprintf(`apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
cgroupDriver: cgroupfs
failCgroupV1: false
cgroupsPerQOS: false
enforceNodeAllocatable: []
failSwapOn: false
containerRuntimeEndpoint: unix://%s
podLogsDir: %s/pod-logs
resolvConf: ""
address: 127.0.0.1
port: %d
readOnlyPort: 0
healthzPort: 0
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: false}
authorization:
  mode: AlwaysAllow
localStorageCapacityIsolation: false
registerNode: true
`, runtimeSocket, dir, port)
}

// containerdConfig is containerd's config (version 3, containerd 2.x).
//   - restrict_oom_score_adj: the kubelet asks -998 for the sandbox and this
//     process may not lower its OOM score ("failed to update
//     /proc/self/oom_score_adj: Permission denied" otherwise).
//   - runc built with libseccomp: the CRI plugin gives every sandbox the
//     RuntimeDefault profile, which a runc without it refuses ("seccomp:
//     config provided but seccomp not supported").
//   - the sandboxes' network namespaces under its state directory, so that
//     devcluster finds and unmounts them.
//   - CDI specs from cdiDirs (containerd 2 always resolves CDI devices).
//   - the pause image is imported, never pulled (pinned, so that image GC
//     keeps it).
//   - nothing of the machine's: NRI off (it would take /var/run/nri and run
//     /opt/nri/plugins), the opt plugin's directory below dir.
func containerdConfig(dir string, b Binaries, cdiDirs []string, sandboxImage string) string {
	quoted := make([]string, len(cdiDirs))
	for i, d := range cdiDirs {
		quoted[i] = fmt.Sprintf("%q", d)
	}
	return fmt.Sprintf(`version = 3
root = %[1]q
state = %[2]q
[grpc]
  address = %[3]q
[plugins."io.containerd.cri.v1.runtime"]
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  cdi_spec_dirs = [%[4]s]
  [plugins."io.containerd.cri.v1.runtime".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      runtime_path = %[5]q
      [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
        BinaryName = %[6]q
        SystemdCgroup = false
  [plugins."io.containerd.cri.v1.runtime".cni]
    bin_dirs = [%[7]q]
    conf_dir = %[8]q
[plugins."io.containerd.cri.v1.images"]
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = %[9]q
[plugins."io.containerd.nri.v1.nri"]
  disable = true
  socket_path = %[10]q
[plugins."io.containerd.internal.v1.opt"]
  path = %[11]q
`, dir+"/containerd/root", dir+"/containerd/state", dir+"/containerd/containerd.sock", strings.Join(quoted, ", "),
		b.Shim, b.Runc, b.CNI, dir+"/cni", sandboxImage, dir+"/containerd/nri.sock", dir+"/containerd/opt")
}

// cniConfig is the pods' network: a bridge with host-local addresses in
// subnet, made inside containerd's own network namespace (Start), so that
// no address of it exists anywhere else on the machine. The pods' default
// route is the bridge, where the kubernetes Service's address is served
// (Options.APIServerVIP); nothing routes further.
func cniConfig(dir, subnet string) string {
	return fmt.Sprintf(`{
  "cniVersion": "1.0.0",
  "name": "devcluster",
  "plugins": [
    {"type": "bridge", "bridge": "devc0", "isGateway": true, "ipMasq": false,
     "ipam": {"type": "host-local", "ranges": [[{"subnet": %q}]], "routes": [{"dst": "0.0.0.0/0"}], "dataDir": %q}},
    {"type": "loopback"}
  ]
}
`, subnet, dir+"/cni-ipam")
}
