package image

import (
	"archive/tar"
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"path/filepath"
	"strings"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
)

// Unpacked is one architecture's image of a layout, as a container runtime
// sees it: its root filesystem and its config.
type Unpacked struct {
	Rootfs string
	Config v1.Config
	// Digest is the architecture's image manifest digest.
	Digest v1.Hash
}

// Unpack flattens the linux/arch image of the OCI layout's (first) index
// into dest/<manifest digest>/rootfs, as a runtime's snapshotter does,
// and returns it. A rootfs already unpacked there for the same digest is
// kept: the digest names its content.
func Unpack(layoutDir, arch, dest string) (*Unpacked, error) {
	p, err := layout.FromPath(layoutDir)
	if err != nil {
		return nil, fmt.Errorf("OCI layout %s: %w", layoutDir, err)
	}
	top, err := p.ImageIndex()
	if err != nil {
		return nil, fmt.Errorf("OCI layout %s: %w", layoutDir, err)
	}
	img, digest, err := findPlatform(top, arch)
	if err != nil {
		return nil, fmt.Errorf("OCI layout %s: %w", layoutDir, err)
	}
	cfg, err := img.ConfigFile()
	if err != nil {
		return nil, fmt.Errorf("OCI layout %s: image %s config: %w", layoutDir, digest, err)
	}
	out := &Unpacked{Rootfs: filepath.Join(dest, digest.Hex, "rootfs"), Config: cfg.Config, Digest: digest}
	done := filepath.Join(dest, digest.Hex, "unpacked")
	if _, err := os.Stat(done); err == nil {
		return out, nil
	}
	if err := os.RemoveAll(filepath.Dir(out.Rootfs)); err != nil {
		return nil, err
	}
	if err := os.MkdirAll(out.Rootfs, 0o755); err != nil {
		return nil, err
	}
	rc := mutate.Extract(img)
	defer rc.Close()
	if err := untar(rc, out.Rootfs); err != nil {
		return nil, fmt.Errorf("unpack image %s: %w", digest, err)
	}
	if err := os.WriteFile(done, []byte(digest.String()+"\n"), 0o644); err != nil {
		return nil, err
	}
	return out, nil
}

// findPlatform walks the index (nested indexes too) to linux/arch's image.
func findPlatform(idx v1.ImageIndex, arch string) (v1.Image, v1.Hash, error) {
	m, err := idx.IndexManifest()
	if err != nil {
		return nil, v1.Hash{}, err
	}
	for _, d := range m.Manifests {
		switch {
		case d.MediaType.IsIndex():
			child, err := idx.ImageIndex(d.Digest)
			if err != nil {
				return nil, v1.Hash{}, err
			}
			if img, h, err := findPlatform(child, arch); err == nil {
				return img, h, nil
			}
		case d.MediaType.IsImage() && d.Platform != nil && d.Platform.OS == "linux" && d.Platform.Architecture == arch:
			img, err := idx.Image(d.Digest)
			return img, d.Digest, err
		}
	}
	return nil, v1.Hash{}, fmt.Errorf("no linux/%s image in the index", arch)
}

// untar writes a flattened image's files below root as the image has
// them: directories, regular files and links, with their owners and modes
// (setuid, setgid and sticky bits too). Every path is resolved inside root
// (os.Root): no entry, nor a link an earlier entry made, takes a write out
// of it.
func untar(r io.Reader, root string) error {
	rt, err := os.OpenRoot(root)
	if err != nil {
		return err
	}
	defer rt.Close()
	tr := tar.NewReader(r)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
		name := strings.TrimPrefix(path.Clean("/"+h.Name), "/")
		if name == "" {
			continue
		}
		if dir := path.Dir(name); dir != "." {
			if err := rt.MkdirAll(dir, 0o755); err != nil {
				return fmt.Errorf("%s: %w", h.Name, err)
			}
		}
		mode := h.FileInfo().Mode()
		switch h.Typeflag {
		case tar.TypeDir:
			if err := rt.MkdirAll(name, mode.Perm()); err != nil {
				return fmt.Errorf("%s: %w", h.Name, err)
			}
		case tar.TypeReg:
			f, err := rt.OpenFile(name, os.O_CREATE|os.O_TRUNC|os.O_WRONLY, mode.Perm())
			if err != nil {
				return fmt.Errorf("%s: %w", h.Name, err)
			}
			if _, err := io.Copy(f, tr); err != nil { //nolint:gosec // the image is ours, built by make image
				f.Close()
				return err
			}
			if err := f.Close(); err != nil {
				return err
			}
		case tar.TypeSymlink:
			_ = rt.Remove(name)
			if err := rt.Symlink(h.Linkname, name); err != nil {
				return fmt.Errorf("%s: %w", h.Name, err)
			}
		case tar.TypeLink:
			_ = rt.Remove(name)
			if err := rt.Link(strings.TrimPrefix(path.Clean("/"+h.Linkname), "/"), name); err != nil {
				return fmt.Errorf("%s: %w", h.Name, err)
			}
		default:
			return fmt.Errorf("%s: unsupported entry type %q", h.Name, h.Typeflag)
		}
		// Owners only as root, who may give files away (a test as
		// another user gets its own).
		if os.Geteuid() == 0 {
			if err := rt.Lchown(name, h.Uid, h.Gid); err != nil {
				return fmt.Errorf("%s: %w", h.Name, err)
			}
		}
		if h.Typeflag == tar.TypeDir || h.Typeflag == tar.TypeReg {
			// After chown, which clears setuid and setgid.
			if err := rt.Chmod(name, mode&(os.ModePerm|os.ModeSetuid|os.ModeSetgid|os.ModeSticky)); err != nil {
				return fmt.Errorf("%s: %w", h.Name, err)
			}
		}
	}
}
