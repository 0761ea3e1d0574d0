package main

import (
	"archive/tar"
	"bytes"
	"debug/buildinfo"
	"debug/elf"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/tarball"

	"github.com/gpudra/gpudra/internal/image"
)

// TestImageTarballs checks what make image built (make test-image sets
// GPUDRA_IMAGE_DIR and GPUDRA_IMAGE_VERSION): each architecture's tarball
// read as docker load reads it, the binaries in it as the chart runs them,
// and the OCI layout's index of both.
func TestImageTarballs(t *testing.T) {
	dir, version := os.Getenv("GPUDRA_IMAGE_DIR"), os.Getenv("GPUDRA_IMAGE_VERSION")
	if dir == "" {
		t.Skip("GPUDRA_IMAGE_DIR is not set: make test-image builds the image and runs this test on it")
	}
	if version == "" {
		t.Fatal("GPUDRA_IMAGE_VERSION is not set")
	}
	tag, err := name.NewTag(image.Repository + ":" + version)
	if err != nil {
		t.Fatal(err)
	}
	configs := map[string]v1.Hash{}
	for _, arch := range []string{"amd64", "arm64"} {
		t.Run(arch, func(t *testing.T) {
			p := filepath.Join(dir, image.TarballName(version, arch))
			m, err := tarball.LoadManifest(func() (io.ReadCloser, error) { return os.Open(p) })
			if err != nil {
				t.Fatal(err)
			}
			if len(m) != 1 || len(m[0].RepoTags) != 1 || m[0].RepoTags[0] != tag.String() {
				t.Errorf("%s: manifest.json %+v, want one image tagged %s", p, m, tag)
			}
			img, err := tarball.ImageFromPath(p, &tag)
			if err != nil {
				t.Fatal(err)
			}
			if configs[arch], err = img.ConfigName(); err != nil {
				t.Fatal(err)
			}
			cf, err := img.ConfigFile()
			if err != nil {
				t.Fatal(err)
			}
			checkConfig(t, cf, arch, version)
			fsys := readFS(t, img)
			checkBinaries(t, fsys, arch)
			checkSBOM(t, fsys, filepath.Join(dir, "sbom-"+arch+".spdx.json"))
			runFromImage(t, fsys, arch, version)
		})
	}

	lp, err := layout.FromPath(filepath.Join(dir, "oci"))
	if err != nil {
		t.Fatal(err)
	}
	top, err := lp.ImageIndex()
	if err != nil {
		t.Fatal(err)
	}
	tm, err := top.IndexManifest()
	if err != nil {
		t.Fatal(err)
	}
	if len(tm.Manifests) != 1 || tm.Manifests[0].Annotations["org.opencontainers.image.ref.name"] != version {
		t.Fatalf("layout's index.json: %+v, want one index named %s", tm.Manifests, version)
	}
	idx, err := top.ImageIndex(tm.Manifests[0].Digest)
	if err != nil {
		t.Fatal(err)
	}
	im, err := idx.IndexManifest()
	if err != nil {
		t.Fatal(err)
	}
	var platforms []string
	for _, d := range im.Manifests {
		platforms = append(platforms, d.Platform.String())
		img, err := idx.Image(d.Digest)
		if err != nil {
			t.Fatal(err)
		}
		cfg, err := img.ConfigName()
		if err != nil {
			t.Fatal(err)
		}
		if cfg != configs[d.Platform.Architecture] {
			t.Errorf("the layout's %s image has config %s, its tarball %s", d.Platform, cfg, configs[d.Platform.Architecture])
		}
	}
	if got := strings.Join(platforms, " "); got != "linux/amd64 linux/arm64/v8" {
		t.Errorf("the layout's index has %q, want linux/amd64 linux/arm64/v8", got)
	}
}

func checkConfig(t *testing.T, cf *v1.ConfigFile, arch, version string) {
	t.Helper()
	if cf.OS != "linux" || cf.Architecture != arch {
		t.Errorf("config platform %s/%s", cf.OS, cf.Architecture)
	}
	c := cf.Config
	if len(c.Entrypoint) != 0 || len(c.Cmd) != 0 {
		t.Errorf("entrypoint %q, cmd %q: the chart names every command", c.Entrypoint, c.Cmd)
	}
	if c.User != "65532:65532" {
		t.Errorf("user %q, want 65532:65532 (the chart's controller runs as it, the plugin as root explicitly)", c.User)
	}
	for _, k := range []string{"source", "revision", "version", "licenses", "created", "title"} {
		if c.Labels["org.opencontainers.image."+k] == "" {
			t.Errorf("no label org.opencontainers.image.%s: %v", k, c.Labels)
		}
	}
	if v := c.Labels["org.opencontainers.image.version"]; v != version {
		t.Errorf("version label %q, want %q", v, version)
	}
}

type fsEntry struct {
	hdr  *tar.Header
	data []byte // regular files
}

// readFS is the image's file system, its layers applied in order (the
// image has no whiteouts).
func readFS(t *testing.T, img v1.Image) map[string]fsEntry {
	t.Helper()
	layers, err := img.Layers()
	if err != nil {
		t.Fatal(err)
	}
	fsys := map[string]fsEntry{}
	for _, l := range layers {
		rc, err := l.Uncompressed()
		if err != nil {
			t.Fatal(err)
		}
		tr := tar.NewReader(rc)
		for {
			h, err := tr.Next()
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				t.Fatal(err)
			}
			e := fsEntry{hdr: h}
			p := "/" + strings.TrimSuffix(h.Name, "/")
			if strings.Contains(p, ".wh.") {
				t.Errorf("whiteout %s in a layer", p)
			}
			if h.Typeflag == tar.TypeReg {
				if e.data, err = io.ReadAll(tr); err != nil {
					t.Fatal(err)
				}
			}
			fsys[p] = e
		}
		rc.Close()
	}
	return fsys
}

// resolve follows symlinks to a regular file of the image.
func resolve(fsys map[string]fsEntry, p string) (string, error) {
	for range 10 {
		e, ok := fsys[p]
		if !ok {
			return "", fmt.Errorf("%s is not in the image", p)
		}
		switch e.hdr.Typeflag {
		case tar.TypeReg:
			return p, nil
		case tar.TypeSymlink:
			if path.IsAbs(e.hdr.Linkname) {
				p = path.Clean(e.hdr.Linkname)
			} else {
				p = path.Join(path.Dir(p), e.hdr.Linkname)
			}
		default:
			return "", fmt.Errorf("%s is not a file", p)
		}
	}
	return "", fmt.Errorf("%s: too many symlinks", p)
}

var (
	machines = map[string]elf.Machine{"amd64": elf.EM_X86_64, "arm64": elf.EM_AARCH64}
	triplets = map[string]string{"amd64": "x86_64-linux-gnu", "arm64": "aarch64-linux-gnu"}
	// The cgo binaries: go-nvml dlopens the host's libnvidia-ml.
	dynamic = map[string]bool{"gpudra-kubelet-plugin": true, "gpudra": true}
)

func checkBinaries(t *testing.T, fsys map[string]fsEntry, arch string) {
	t.Helper()
	glibc := glibcVersion(t, fsys)
	for _, b := range image.Binaries {
		p := image.BinDir + "/" + b
		e, ok := fsys[p]
		if !ok || e.hdr.Typeflag != tar.TypeReg {
			t.Errorf("no %s in the image", p)
			continue
		}
		if e.hdr.Mode&0o111 != 0o111 || e.hdr.Uid != 0 {
			t.Errorf("%s: mode %o, owner %d: not root's and executable by all", p, e.hdr.Mode, e.hdr.Uid)
		}
		f, err := elf.NewFile(bytes.NewReader(e.data))
		if err != nil {
			t.Errorf("%s: not ELF: %v", p, err)
			continue
		}
		if f.Machine != machines[arch] {
			t.Errorf("%s: ELF machine %s, want %s", p, f.Machine, machines[arch])
		}
		bi, err := buildinfo.Read(bytes.NewReader(e.data))
		if err != nil {
			t.Errorf("%s: %v", p, err)
			continue
		}
		settings := map[string]string{}
		for _, s := range bi.Settings {
			settings[s.Key] = s.Value
		}
		wantCgo := "0"
		if dynamic[b] {
			wantCgo = "1"
		}
		if settings["GOARCH"] != arch || settings["CGO_ENABLED"] != wantCgo || settings["-trimpath"] != "true" {
			t.Errorf("%s: built with GOARCH=%s CGO_ENABLED=%s -trimpath=%s, want %s, %s, true", p,
				settings["GOARCH"], settings["CGO_ENABLED"], settings["-trimpath"], arch, wantCgo)
		}
		interp := ""
		for _, prog := range f.Progs {
			if prog.Type == elf.PT_INTERP {
				b, err := io.ReadAll(prog.Open())
				if err != nil {
					t.Fatal(err)
				}
				interp = strings.TrimRight(string(b), "\x00")
			}
		}
		if !dynamic[b] {
			if interp != "" {
				t.Errorf("%s: static binary names an interpreter %s", p, interp)
			}
			continue
		}
		if interp == "" {
			t.Errorf("%s: the cgo binary has no interpreter", p)
			continue
		}
		if _, err := resolve(fsys, interp); err != nil {
			t.Errorf("%s: its interpreter: %v", p, err)
		}
		libs, err := f.ImportedLibraries()
		if err != nil {
			t.Fatal(err)
		}
		if len(libs) == 0 {
			t.Errorf("%s: links no library", p)
		}
		for _, l := range libs {
			if _, err := resolve(fsys, "/lib/"+triplets[arch]+"/"+l); err != nil {
				t.Errorf("%s needs %s: %v", p, l, err)
			}
		}
		syms, err := f.ImportedSymbols()
		if err != nil {
			t.Fatal(err)
		}
		for _, s := range syms {
			if v, ok := strings.CutPrefix(s.Version, "GLIBC_"); ok && versionLess(glibc, v) {
				t.Errorf("%s: %s needs %s, the image's glibc is %s", p, s.Name, s.Version, glibc)
			}
		}
	}
	// What the host driver's libraries and tools need besides.
	for _, l := range []string{"libm.so.6", "libpthread.so.0", "libdl.so.2", "librt.so.1"} {
		if _, err := resolve(fsys, "/lib/"+triplets[arch]+"/"+l); err != nil {
			t.Errorf("the driver's libnvidia-ml and tools need %s: %v", l, err)
		}
	}
}

// glibcVersion is the libc6 version of the image's SBOM, as GLIBC_x.y.
func glibcVersion(t *testing.T, fsys map[string]fsEntry) string {
	t.Helper()
	var doc struct {
		Packages []struct{ Name, VersionInfo string }
	}
	if err := json.Unmarshal(fsys[image.SBOMPath].data, &doc); err != nil {
		t.Fatalf("SBOM: %v", err)
	}
	for _, p := range doc.Packages {
		if p.Name == "libc6" {
			v, _, _ := strings.Cut(p.VersionInfo, "-")
			return v
		}
	}
	t.Fatal("the SBOM names no libc6")
	return ""
}

// versionLess compares dotted versions: 2.9 < 2.34.
func versionLess(a, b string) bool {
	as, bs := strings.Split(a, "."), strings.Split(b, ".")
	for i := 0; i < len(as) || i < len(bs); i++ {
		var x, y int
		if i < len(as) {
			x, _ = strconv.Atoi(as[i])
		}
		if i < len(bs) {
			y, _ = strconv.Atoi(bs[i])
		}
		if x != y {
			return x < y
		}
	}
	return false
}

func TestVersionLess(t *testing.T) {
	for _, c := range []struct {
		a, b string
		less bool
	}{{"2.36", "2.34", false}, {"2.9", "2.34", true}, {"2.36", "2.36", false}, {"2.36", "2.38", true}, {"2.2.5", "2.3", true}} {
		if versionLess(c.a, c.b) != c.less {
			t.Errorf("versionLess(%s, %s) = %t", c.a, c.b, !c.less)
		}
	}
}

func checkSBOM(t *testing.T, fsys map[string]fsEntry, beside string) {
	t.Helper()
	inImage := fsys[image.SBOMPath].data
	written, err := os.ReadFile(beside)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(inImage, written) {
		t.Errorf("%s is not the image's %s", beside, image.SBOMPath)
	}
	var doc struct {
		SPDXVersion string `json:"spdxVersion"`
		Packages    []struct {
			Name      string
			Checksums []struct {
				Value string `json:"checksumValue"`
			}
		}
	}
	if err := json.Unmarshal(inImage, &doc); err != nil {
		t.Fatal(err)
	}
	names := map[string]bool{}
	for _, p := range doc.Packages {
		names[p.Name] = true
	}
	for _, want := range append([]string{"libc6", "k8s.io/client-go", "github.com/NVIDIA/go-nvml", "stdlib"}, image.Binaries...) {
		if !names[want] {
			t.Errorf("the SBOM does not list %s", want)
		}
	}
	if doc.SPDXVersion != "SPDX-2.3" {
		t.Errorf("SBOM version %q", doc.SPDXVersion)
	}
}

// runFromImage runs every binary with --version from the image's own file
// system, with nothing of the host's: in a chroot of it as the image's user
// (amd64, as root), or under qemu-aarch64-static with the image as the
// root of the guest's paths (arm64, where qemu-user is installed). The cgo
// binaries then start only if the image's loader and glibc serve them.
func runFromImage(t *testing.T, fsys map[string]fsEntry, arch, version string) {
	t.Helper()
	qemu, _ := exec.LookPath("qemu-aarch64-static")
	switch {
	case arch == runtime.GOARCH && os.Geteuid() != 0:
		t.Log("not root: the binaries are not run from a chroot of the image")
		return
	case arch != runtime.GOARCH && (arch != "arm64" || qemu == ""):
		t.Logf("%s binaries are not run here (no qemu-aarch64-static)", arch)
		return
	}
	root := t.TempDir()
	for p, e := range fsys {
		dst := filepath.Join(root, p)
		if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
			t.Fatal(err)
		}
		var err error
		switch e.hdr.Typeflag {
		case tar.TypeDir:
			err = os.MkdirAll(dst, os.FileMode(e.hdr.Mode).Perm())
		case tar.TypeSymlink:
			err = os.Symlink(e.hdr.Linkname, dst)
		case tar.TypeReg:
			err = os.WriteFile(dst, e.data, os.FileMode(e.hdr.Mode).Perm())
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	for _, b := range image.Binaries {
		var cmd *exec.Cmd
		if arch == runtime.GOARCH {
			cmd = exec.Command(image.BinDir+"/"+b, "--version")
			cmd.SysProcAttr = &syscall.SysProcAttr{Chroot: root, Credential: &syscall.Credential{Uid: image.NonRoot, Gid: image.NonRoot}}
			cmd.Dir = "/"
		} else {
			cmd = exec.Command(qemu, "-L", root, filepath.Join(root, image.BinDir, b), "--version")
		}
		cmd.Env = image.Env
		out, err := cmd.CombinedOutput()
		want := fmt.Sprintf("%s %s (commit ", b, version)
		if err != nil || !strings.HasPrefix(string(out), want) || !strings.Contains(string(out), "linux/"+arch) {
			t.Errorf("%s --version from the %s image: %v: %q, want %q... linux/%s", b, arch, err, out, want, arch)
		} else {
			t.Logf("%s", bytes.TrimSpace(out))
		}
	}
}
