// Package image is the recipe of gpudra's container image (make image;
// docs/image.md): from the binaries, the pinned Debian packages and the
// build's metadata it computes the image of each architecture and the index
// of both, with no Docker, no registry and nothing of the build machine in
// it, so that the same inputs give the same digests. Writing them out (an
// OCI layout and docker-loadable tarballs) is write.go; fetching the inputs
// is hack/image's.
package image

import (
	"archive/tar"
	"bytes"
	"fmt"
	"io"
	"path"
	"sort"
	"strings"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

// NonRoot is the image's default user and group (the controller's; the
// chart runs the plugin as root explicitly). 65532 is distroless's
// "nonroot", the id the chart's controller pod already names.
const NonRoot = 65532

// BinDir is where the binaries are: on the image's PATH, since the chart
// and the MPS server pods name their commands without a directory.
const BinDir = "/usr/bin"

// SBOMPath is where the image carries its software bill of materials.
const SBOMPath = "/usr/share/doc/gpudra/sbom.spdx.json"

// Env is the image's environment: PATH only.
var Env = []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}

// Inputs is everything the image is computed from.
type Inputs struct {
	Version  string    // git describe: the image's tag and version label
	Revision string    // the commit
	Source   string    // the repository's URL
	Created  time.Time // SOURCE_DATE_EPOCH: every timestamp in the image
	License  []byte    // the project's LICENSE, shipped beside the SBOM
	Arches   []Arch    // one image each, in the index in this order
}

// Arch is one architecture's binaries and Debian packages.
type Arch struct {
	Arch     string // GOARCH: amd64 or arm64
	Binaries []Binary
	Debs     []Package
}

// Binary is one of gpudra's executables, installed as BinDir/Name.
type Binary struct {
	Name string
	Data []byte
}

// Package is a Debian package's .deb with its lock file entry.
type Package struct {
	Deb  Deb
	Data []byte
}

// ArchImage is one architecture's image and its SBOM.
type ArchImage struct {
	Arch  string
	Image v1.Image
	SBOM  []byte
}

// Result is what Build computes.
type Result struct {
	Index  v1.ImageIndex
	Images []ArchImage
}

type archInfo struct {
	triplet string // Debian's multiarch directory
	loader  string // the ELF interpreter Go's cgo binaries name (PT_INTERP)
	variant string // the OCI platform variant
}

var archInfos = map[string]archInfo{
	"amd64": {triplet: "x86_64-linux-gnu", loader: "/lib64/ld-linux-x86-64.so.2"},
	"arm64": {triplet: "aarch64-linux-gnu", loader: "/lib/ld-linux-aarch64.so.1", variant: "v8"},
}

// glibcLibraries are the libraries of libc6 the image ships: libc.so.6,
// which the cgo binaries (the plugin and the CLI) link, and what the host
// driver's libnvidia-ml.so.1, which they dlopen, links besides: libpthread,
// libdl, libm (and librt on older drivers). Since glibc 2.34 those are
// stubs of libc, but the loader still has to find them. The driver's tools
// (nvidia-smi, nvidia-cuda-mps-control) run through the driver root's own
// loader and libraries (pkg/drivertools), not these. Nothing else of libc6
// (locales, gconv, NSS modules, ldconfig) is shipped.
var glibcLibraries = []string{"libc.so.6", "libm.so.6", "libpthread.so.0", "libdl.so.2", "librt.so.1"}

// debPaths is what the image takes of a package: the paths, symlinks
// followed to their targets.
func debPaths(pkg, arch string) ([]string, error) {
	info := archInfos[arch]
	switch pkg {
	case "libc6":
		paths := []string{info.loader, "/lib/" + info.triplet + "/" + path.Base(info.loader), "/usr/share/doc/libc6/copyright"}
		for _, l := range glibcLibraries {
			paths = append(paths, "/lib/"+info.triplet+"/"+l)
		}
		return paths, nil
	}
	return nil, fmt.Errorf("the image takes nothing from debian package %s: add it to image.debPaths or drop it from the lock file", pkg)
}

// File is one entry of a layer.
type File struct {
	Path     string // absolute
	Mode     int64  // permission bits (and sticky)
	UID, GID int
	Data     []byte
	Link     string // a symlink's target
	Dir      bool
}

// Build computes every architecture's image and the index of them.
func Build(in Inputs) (*Result, error) {
	if in.Version == "" || in.Revision == "" {
		return nil, fmt.Errorf("image version %q and revision %q must both be set", in.Version, in.Revision)
	}
	if len(in.Arches) == 0 {
		return nil, fmt.Errorf("no architecture to build")
	}
	res := &Result{}
	idx := mutate.IndexMediaType(empty.Index, types.OCIImageIndex)
	var adds []mutate.IndexAddendum
	for _, a := range in.Arches {
		img, sbom, err := buildArch(in, a)
		if err != nil {
			return nil, fmt.Errorf("%s image: %w", a.Arch, err)
		}
		res.Images = append(res.Images, ArchImage{Arch: a.Arch, Image: img, SBOM: sbom})
		adds = append(adds, mutate.IndexAddendum{Add: img, Descriptor: v1.Descriptor{
			MediaType: types.OCIManifestSchema1,
			Platform:  &v1.Platform{OS: "linux", Architecture: a.Arch, Variant: archInfos[a.Arch].variant},
		}})
	}
	res.Index = mutate.Annotations(mutate.AppendManifests(idx, adds...), map[string]string{
		"org.opencontainers.image.version":  in.Version,
		"org.opencontainers.image.revision": in.Revision,
		"org.opencontainers.image.created":  in.created(),
	}).(v1.ImageIndex)
	return res, nil
}

func (in Inputs) created() string { return in.Created.UTC().Format(time.RFC3339) }

// Labels are the image's OCI annotations, as config labels.
func (in Inputs) Labels() map[string]string {
	return map[string]string{
		"org.opencontainers.image.title":       "gpudra",
		"org.opencontainers.image.description": "gpudra: Kubernetes DRA driver for NVIDIA H100-class GPUs (kubelet plugin, controller, MPS server, CLI)",
		"org.opencontainers.image.source":      in.Source,
		"org.opencontainers.image.revision":    in.Revision,
		"org.opencontainers.image.version":     in.Version,
		"org.opencontainers.image.licenses":    "Apache-2.0",
		"org.opencontainers.image.created":     in.created(),
	}
}

func buildArch(in Inputs, a Arch) (v1.Image, []byte, error) {
	info, ok := archInfos[a.Arch]
	if !ok {
		return nil, nil, fmt.Errorf("unsupported architecture %q", a.Arch)
	}
	if len(a.Binaries) == 0 {
		return nil, nil, fmt.Errorf("no binaries")
	}
	base, err := baseFiles(a)
	if err != nil {
		return nil, nil, err
	}
	sbom, err := SBOM(in, a)
	if err != nil {
		return nil, nil, err
	}
	var app []File
	for _, b := range a.Binaries {
		if b.Name == "" || strings.Contains(b.Name, "/") {
			return nil, nil, fmt.Errorf("bad binary name %q", b.Name)
		}
		app = append(app, File{Path: BinDir + "/" + b.Name, Mode: 0o755, Data: b.Data})
	}
	app = append(app, File{Path: SBOMPath, Mode: 0o644, Data: sbom})
	if in.License != nil {
		app = append(app, File{Path: path.Dir(SBOMPath) + "/LICENSE", Mode: 0o644, Data: in.License})
	}
	var debNames []string
	for _, p := range a.Debs {
		debNames = append(debNames, p.Deb.String())
	}
	layers := []struct {
		files []File
		by    string
	}{
		{base, "gpudra hack/image: the base: " + strings.Join(debNames, ", ") + ", /etc/passwd, /etc/group, /tmp"},
		{app, "gpudra hack/image: " + BinDir + "/{" + binaryNames(a) + "}, the SBOM"},
	}

	img := mutate.ConfigMediaType(mutate.MediaType(empty.Image, types.OCIManifestSchema1), types.OCIConfigJSON)
	img, err = mutate.ConfigFile(img, &v1.ConfigFile{
		Architecture: a.Arch,
		OS:           "linux",
		Variant:      info.variant,
		Created:      v1.Time{Time: in.Created.UTC()},
		// No Entrypoint or Cmd: every pod names its command (the chart,
		// the MPS server pods).
		Config: v1.Config{
			User:       fmt.Sprintf("%d:%d", NonRoot, NonRoot),
			Env:        Env,
			WorkingDir: "/",
			Labels:     in.Labels(),
		},
	})
	if err != nil {
		return nil, nil, fmt.Errorf("config: %w", err)
	}
	for _, l := range layers {
		data, err := Tar(l.files, in.Created)
		if err != nil {
			return nil, nil, err
		}
		layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) {
			return io.NopCloser(bytes.NewReader(data)), nil
		}, tarball.WithMediaType(types.OCILayer))
		if err != nil {
			return nil, nil, fmt.Errorf("layer: %w", err)
		}
		img, err = mutate.Append(img, mutate.Addendum{Layer: layer, MediaType: types.OCILayer,
			History: v1.History{Created: v1.Time{Time: in.Created.UTC()}, CreatedBy: l.by}})
		if err != nil {
			return nil, nil, fmt.Errorf("append layer: %w", err)
		}
	}
	return img, sbom, nil
}

func binaryNames(a Arch) string {
	var names []string
	for _, b := range a.Binaries {
		names = append(names, b.Name)
	}
	return strings.Join(names, ",")
}

// baseFiles is the first layer: glibc from the verified packages, the
// users, /tmp.
func baseFiles(a Arch) ([]File, error) {
	files := []File{
		{Path: "/etc/passwd", Mode: 0o644, Data: []byte(fmt.Sprintf(
			"root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:%d:%d:nonroot:/home/nonroot:/sbin/nologin\n", NonRoot, NonRoot))},
		{Path: "/etc/group", Mode: 0o644, Data: []byte(fmt.Sprintf("root:x:0:\nnonroot:x:%d:\n", NonRoot))},
		{Path: "/home/nonroot", Mode: 0o700, UID: NonRoot, GID: NonRoot, Dir: true},
		{Path: "/tmp", Mode: 0o1777, Dir: true},
	}
	for _, p := range a.Debs {
		if p.Deb.Arch != a.Arch {
			return nil, fmt.Errorf("debian package %s is for %s", p.Deb, p.Deb.Arch)
		}
		if err := p.Deb.Verify(p.Data); err != nil {
			return nil, err
		}
		contents, err := readDeb(p.Data)
		if err != nil {
			return nil, fmt.Errorf("debian package %s: %w", p.Deb, err)
		}
		want, err := debPaths(p.Deb.Package, a.Arch)
		if err != nil {
			return nil, err
		}
		taken := map[string]bool{}
		for _, w := range want {
			for p2 := w; !taken[p2]; {
				f, ok := contents[p2]
				if !ok {
					return nil, fmt.Errorf("debian package %s has no %s", p.Deb, p2)
				}
				taken[p2] = true
				files = append(files, File{Path: p2, Mode: f.mode, Data: f.data, Link: f.link, Dir: f.dir})
				if f.link == "" {
					break
				}
				// A symlink's target comes too, or it would dangle.
				if path.IsAbs(f.link) {
					p2 = path.Clean(f.link)
				} else {
					p2 = path.Join(path.Dir(p2), f.link)
				}
			}
		}
	}
	return files, nil
}

// Tar is a layer of files: sorted, every parent directory present (root's,
// 0755), every timestamp mtime, owners numeric with no names. Nothing of the
// machine that builds it gets in.
func Tar(files []File, mtime time.Time) ([]byte, error) {
	byPath := map[string]File{}
	for _, f := range files {
		p := path.Clean(f.Path)
		if !path.IsAbs(p) || p == "/" {
			return nil, fmt.Errorf("layer path %q: not an absolute file path", f.Path)
		}
		if _, dup := byPath[p]; dup {
			return nil, fmt.Errorf("layer path %s: twice", p)
		}
		f.Path = p
		byPath[p] = f
	}
	for p := range byPath {
		for d := path.Dir(p); d != "/"; d = path.Dir(d) {
			if _, ok := byPath[d]; !ok {
				byPath[d] = File{Path: d, Mode: 0o755, Dir: true}
			}
		}
	}
	paths := make([]string, 0, len(byPath))
	for p := range byPath {
		paths = append(paths, p)
	}
	sort.Strings(paths)
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, p := range paths {
		f := byPath[p]
		h := &tar.Header{Name: strings.TrimPrefix(p, "/"), Mode: f.Mode, Uid: f.UID, Gid: f.GID, ModTime: mtime.UTC(), Format: tar.FormatPAX}
		switch {
		case f.Dir:
			h.Typeflag, h.Name = tar.TypeDir, h.Name+"/"
		case f.Link != "":
			h.Typeflag, h.Linkname = tar.TypeSymlink, f.Link
		default:
			h.Typeflag, h.Size = tar.TypeReg, int64(len(f.Data))
		}
		if err := tw.WriteHeader(h); err != nil {
			return nil, fmt.Errorf("layer %s: %w", p, err)
		}
		if h.Typeflag == tar.TypeReg {
			if _, err := tw.Write(f.Data); err != nil {
				return nil, fmt.Errorf("layer %s: %w", p, err)
			}
		}
	}
	if err := tw.Close(); err != nil {
		return nil, fmt.Errorf("layer: %w", err)
	}
	return buf.Bytes(), nil
}
