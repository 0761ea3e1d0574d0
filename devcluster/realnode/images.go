package realnode

import (
	"archive/tar"
	"bytes"
	"context"
	"fmt"
	"io"
	"maps"
	"os"
	"os/exec"
	"path"
	"runtime"
	"slices"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
)

// The images every real node gets: the sandbox (pause) image the CRI
// plugin runs each pod in, and the probe image the examples' containers
// run (gpudra-probe at /gpudra-probe, reporting what the container was
// given). Both are imported, never pulled.
const (
	PauseImage = "registry.k8s.io/pause:3.10"
	ProbeImage = "ghcr.io/gpudra/probe:devcluster"
)

// Image is an image of static binaries, one layer.
type Image struct {
	Ref string
	// Files maps a path in the image to a binary on this machine.
	Files map[string]string
	// Entrypoint is the image's command.
	Entrypoint []string
}

// writeTarball writes the image as a docker-loadable tarball (what
// containerd's import API reads) with go-containerregistry; the layer's
// timestamps are the epoch, so the same binaries give the same image.
func writeTarball(img Image, file string) error {
	var layer bytes.Buffer
	tw := tar.NewWriter(&layer)
	for _, p := range slices.Sorted(maps.Keys(img.Files)) {
		b, err := os.ReadFile(img.Files[p])
		if err != nil {
			return fmt.Errorf("image %s: %w", img.Ref, err)
		}
		if err := tw.WriteHeader(&tar.Header{Name: path.Clean(p)[1:], Mode: 0o755, Size: int64(len(b)), Typeflag: tar.TypeReg,
			ModTime: time.Unix(0, 0)}); err != nil {
			return err
		}
		if _, err := tw.Write(b); err != nil {
			return err
		}
	}
	if err := tw.Close(); err != nil {
		return err
	}
	l, err := tarball.LayerFromReader(bytes.NewReader(layer.Bytes()))
	if err != nil {
		return err
	}
	i, err := mutate.AppendLayers(empty.Image, l)
	if err != nil {
		return err
	}
	cf, err := i.ConfigFile()
	if err != nil {
		return err
	}
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture = "linux", runtime.GOARCH
	cf.Config = v1.Config{Entrypoint: img.Entrypoint}
	if i, err = mutate.ConfigFile(i, cf); err != nil {
		return err
	}
	tag, err := name.NewTag(img.Ref)
	if err != nil {
		return err
	}
	return tarball.WriteToFile(file, tag, i)
}

// importImage imports a tarball into containerd's k8s.io namespace, the
// CRI plugin's, through containerd's import API (ctr images import), and
// tags the image it names ref, where ref is set.
func importImage(ctx context.Context, ctr, socket, file, ref string) error {
	base := []string{"--address", socket, "--namespace", "k8s.io", "images"}
	if out, err := exec.CommandContext(ctx, ctr, append(base, "import", file)...).CombinedOutput(); err != nil {
		return fmt.Errorf("ctr images import %s: %w: %s", file, err, out)
	}
	if ref == "" {
		return nil
	}
	m, err := tarball.LoadManifest(func() (io.ReadCloser, error) { return os.Open(file) })
	if err != nil {
		return fmt.Errorf("image tarball %s: %w", file, err)
	}
	if len(m) != 1 || len(m[0].RepoTags) == 0 {
		return fmt.Errorf("image tarball %s: want one tagged image, it has %d", file, len(m))
	}
	if out, err := exec.CommandContext(ctx, ctr, append(base, "tag", "--force", m[0].RepoTags[0], ref)...).CombinedOutput(); err != nil {
		return fmt.Errorf("ctr images tag %s %s: %w: %s", m[0].RepoTags[0], ref, err, out)
	}
	return nil
}
