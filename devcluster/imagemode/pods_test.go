package imagemode

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/utils/ptr"

	"github.com/gpudra/gpudra/devcluster/chart"
)

// TestImagePodVolumes: the pod's volumes as the kubelet sets them up: the
// chart's node paths are the node's directories, any other host path is
// below the node's, a Directory that is not there is an error naming the
// volume, secrets and config maps are files, other kinds are refused.
func TestImagePodVolumes(t *testing.T) {
	clusterDir := t.TempDir()
	nodeDir := filepath.Join(clusterDir, "nodes", "n0")
	driver := filepath.Join(nodeDir, "driver")
	require.NoError(t, os.MkdirAll(driver, 0o755))
	client := fake.NewClientset(
		&v1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "cert", Namespace: "ns"}, Data: map[string][]byte{"tls.crt": []byte("CERT")}},
		&v1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: "cfg", Namespace: "ns"}, Data: map[string]string{"config.yaml": "a: 1"}})
	dirOrCreate, dir := ptr.To(v1.HostPathDirectoryOrCreate), ptr.To(v1.HostPathDirectory)
	pod := func(vols ...v1.Volume) *Pod {
		return &Pod{r: &Runner{clusterDir: clusterDir, admin: client}, nodeDir: nodeDir,
			pod: &v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "p", Namespace: "ns"},
				Spec: v1.PodSpec{NodeName: "n0", AutomountServiceAccountToken: ptr.To(false), Volumes: vols}}}
	}
	hostPath := func(name, path string, typ *v1.HostPathType) v1.Volume {
		return v1.Volume{Name: name, VolumeSource: v1.VolumeSource{HostPath: &v1.HostPathVolumeSource{Path: path, Type: typ}}}
	}
	bundle := t.TempDir()

	got, err := pod(
		hostPath("plugin-data", filepath.Join(clusterDir, "nodes", chart.NodeNamePlaceholder, "plugins"), dirOrCreate),
		hostPath("driver-root", filepath.Join(clusterDir, "nodes", chart.NodeNamePlaceholder, "driver"), dir),
		hostPath("local-state", "/var/lib/gpudra/local", dirOrCreate),
		v1.Volume{Name: "cert", VolumeSource: v1.VolumeSource{Secret: &v1.SecretVolumeSource{SecretName: "cert"}}},
		v1.Volume{Name: "cfg", VolumeSource: v1.VolumeSource{ConfigMap: &v1.ConfigMapVolumeSource{LocalObjectReference: v1.LocalObjectReference{Name: "cfg"}}}},
	).volumes(context.Background(), bundle)
	require.NoError(t, err)
	assert.Equal(t, filepath.Join(nodeDir, "plugins"), got["plugin-data"])
	assert.DirExists(t, got["plugin-data"], "DirectoryOrCreate made it")
	assert.Equal(t, driver, got["driver-root"])
	assert.Equal(t, filepath.Join(nodeDir, "var/lib/gpudra/local"), got["local-state"], "a host path outside devcluster's directory is below the node's")
	crt, err := os.ReadFile(filepath.Join(got["cert"], "tls.crt"))
	require.NoError(t, err)
	assert.Equal(t, "CERT", string(crt))
	cfg, err := os.ReadFile(filepath.Join(got["cfg"], "config.yaml"))
	require.NoError(t, err)
	assert.Equal(t, "a: 1", string(cfg))
	assert.NotContains(t, got, serviceAccountVolume, "automountServiceAccountToken: false")

	for _, tc := range []struct {
		name string
		vol  v1.Volume
		want string
	}{
		{"a Directory that is not there", hostPath("driver-root", "/no/such/driver", dir), "pod ns/p volume driver-root: hostPath " + filepath.Join(nodeDir, "no/such/driver") + ": type Directory"},
		{"a secret that is not there", v1.Volume{Name: "s", VolumeSource: v1.VolumeSource{Secret: &v1.SecretVolumeSource{SecretName: "nope"}}}, "pod ns/p volume s:"},
		{"a kind devcluster does not run", v1.Volume{Name: "pvc", VolumeSource: v1.VolumeSource{PersistentVolumeClaim: &v1.PersistentVolumeClaimVolumeSource{ClaimName: "c"}}}, "pod ns/p volume pvc: only hostPath, secret, configMap and emptyDir"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := pod(tc.vol).volumes(context.Background(), bundle)
			require.Error(t, err)
			assert.Contains(t, err.Error(), tc.want)
		})
	}
}
