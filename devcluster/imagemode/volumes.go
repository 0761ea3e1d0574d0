package imagemode

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"
	authenticationv1 "k8s.io/api/authentication/v1"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	"github.com/gpudra/gpudra/devcluster/chart"
)

// A pod run from the image: its volumes and its root, set up on the host
// before its container is created.

// The service account token's directory, as the projected volume that
// ServiceAccount admission adds is mounted.
const (
	serviceAccountDir    = "/var/run/secrets/kubernetes.io/serviceaccount"
	serviceAccountVolume = "devcluster-kube-api-access"
)

// volumes sets up the pod's volumes on the host: hostPath (created where
// its type says so; a path outside devcluster's directory is below the
// node's), secret and configMap (their keys as files, read-only),
// emptyDir; and the service account token (TokenRequest bound to the
// pod), unless automountServiceAccountToken is false. Any other kind is an
// error naming the volume.
func (p *Pod) volumes(ctx context.Context, bundle string) (map[string]string, error) {
	pod := p.pod
	out := map[string]string{}
	for _, v := range pod.Spec.Volumes {
		where := fmt.Sprintf("pod %s/%s volume %s", pod.Namespace, pod.Name, v.Name)
		switch {
		case v.HostPath != nil:
			path := strings.ReplaceAll(v.HostPath.Path, chart.NodeNamePlaceholder, pod.Spec.NodeName)
			if !strings.HasPrefix(path, p.r.clusterDir+"/") {
				path = filepath.Join(p.nodeDir, path)
			}
			if err := hostPathReady(path, v.HostPath.Type); err != nil {
				return nil, fmt.Errorf("%s: %w", where, err)
			}
			out[v.Name] = path
		case v.Secret != nil:
			s, err := p.r.admin.CoreV1().Secrets(pod.Namespace).Get(ctx, v.Secret.SecretName, metav1.GetOptions{})
			if err != nil {
				return nil, fmt.Errorf("%s: %w", where, err)
			}
			dir, err := writeFiles(filepath.Join(bundle, "volumes", v.Name), s.Data, nil)
			if err != nil {
				return nil, fmt.Errorf("%s: %w", where, err)
			}
			out[v.Name] = dir
		case v.ConfigMap != nil:
			cm, err := p.r.admin.CoreV1().ConfigMaps(pod.Namespace).Get(ctx, v.ConfigMap.Name, metav1.GetOptions{})
			if err != nil {
				return nil, fmt.Errorf("%s: %w", where, err)
			}
			dir, err := writeFiles(filepath.Join(bundle, "volumes", v.Name), cm.BinaryData, cm.Data)
			if err != nil {
				return nil, fmt.Errorf("%s: %w", where, err)
			}
			out[v.Name] = dir
		case v.EmptyDir != nil:
			// The pod's, kept across its container's restarts.
			dir := filepath.Join(p.podDir(), "volumes", v.Name)
			if err := os.MkdirAll(dir, 0o777); err != nil {
				return nil, err
			}
			out[v.Name] = dir
		default:
			return nil, fmt.Errorf("%s: only hostPath, secret, configMap and emptyDir volumes are run by devcluster", where)
		}
	}
	if pod.Spec.AutomountServiceAccountToken == nil || *pod.Spec.AutomountServiceAccountToken {
		tok, err := p.r.admin.CoreV1().ServiceAccounts(pod.Namespace).CreateToken(ctx, pod.Spec.ServiceAccountName, &authenticationv1.TokenRequest{
			Spec: authenticationv1.TokenRequestSpec{ExpirationSeconds: ptr.To(int64(p.r.tokenLifetime.Seconds())),
				BoundObjectRef: &authenticationv1.BoundObjectReference{APIVersion: "v1", Kind: "Pod", Name: pod.Name, UID: pod.UID}}}, metav1.CreateOptions{})
		if err != nil {
			return nil, fmt.Errorf("pod %s/%s: token of ServiceAccount %q: %w", pod.Namespace, pod.Name, pod.Spec.ServiceAccountName, err)
		}
		dir, err := writeFiles(filepath.Join(bundle, "volumes", serviceAccountVolume), map[string][]byte{
			"token": []byte(tok.Status.Token), "ca.crt": p.r.caPEM, "namespace": []byte(pod.Namespace)}, nil)
		if err != nil {
			return nil, err
		}
		out[serviceAccountVolume] = dir
	}
	return out, nil
}

// hostPathReady checks or creates a hostPath as its type asks.
func hostPathReady(path string, typ *v1.HostPathType) error {
	t := v1.HostPathUnset
	if typ != nil {
		t = *typ
	}
	st, err := os.Stat(path)
	switch t {
	case v1.HostPathDirectoryOrCreate:
		if err != nil {
			return os.MkdirAll(path, 0o755)
		}
		if !st.IsDir() {
			return fmt.Errorf("hostPath %s is not a directory", path)
		}
	case v1.HostPathDirectory:
		if err != nil || !st.IsDir() {
			return fmt.Errorf("hostPath %s: type Directory, and no directory is there", path)
		}
	case v1.HostPathFileOrCreate:
		if err != nil {
			if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
				return err
			}
			return os.WriteFile(path, nil, 0o644)
		}
	case v1.HostPathFile, v1.HostPathSocket:
		if err != nil {
			return fmt.Errorf("hostPath %s: type %s, and nothing is there", path, t)
		}
	case v1.HostPathUnset:
		// Mounted as it is; a missing one fails runc create.
	default:
		return fmt.Errorf("hostPath %s: type %s is not run by devcluster", path, t)
	}
	return nil
}

// writeFiles writes a secret's or config map's keys as files of dir.
func writeFiles(dir string, data map[string][]byte, text map[string]string) (string, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", err
	}
	for k, v := range data {
		if err := os.WriteFile(filepath.Join(dir, filepath.Base(k)), v, 0o644); err != nil { //nolint:gosec // world-readable as a secret volume's default 0644
			return "", err
		}
	}
	for k, v := range text {
		if err := os.WriteFile(filepath.Join(dir, filepath.Base(k)), []byte(v), 0o644); err != nil { //nolint:gosec // as above
			return "", err
		}
	}
	return dir, nil
}

// overlayRootfs mounts the image's root as the container's: an overlay
// whose lower layer is the unpacked image (shared, never written) and
// whose upper layer is the container's own, as containerd's snapshotter
// does.
func overlayRootfs(image, bundle string) (string, error) {
	rootfs, upper, work := filepath.Join(bundle, "rootfs"), filepath.Join(bundle, "upper"), filepath.Join(bundle, "work")
	for _, d := range []string{rootfs, upper, work} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return "", err
		}
	}
	if err := unix.Mount("overlay", rootfs, "overlay", 0, "lowerdir="+image+",upperdir="+upper+",workdir="+work); err != nil {
		return "", fmt.Errorf("mount the image's root: %w", err)
	}
	return rootfs, nil
}
