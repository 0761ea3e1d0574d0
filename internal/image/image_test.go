package image

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/sha256"
	"debug/buildinfo"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sort"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
	"github.com/ulikunitz/xz"
)

var created = time.Unix(1_790_000_000, 0)

// standInFile is one entry of a stand-in package's data.tar.
type standInFile struct {
	name, link string
	data       string
	mode       int64
}

// standInDeb is a .deb laid out as bookworm's libc6 is (ar archive,
// xz-compressed data.tar, the loader a symlink), with stand-in contents
// and files the image must not take.
func standInDeb(t *testing.T, arch string) []byte {
	t.Helper()
	info := archInfos[arch]
	lib := "./lib/" + info.triplet + "/"
	files := []standInFile{
		{name: "./"}, {name: "./lib/"}, {name: lib},
		{name: lib + "libc.so.6", data: "libc " + arch, mode: 0o755},
		{name: lib + "libm.so.6", data: "libm " + arch, mode: 0o644},
		{name: lib + "libpthread.so.0", data: "libpthread " + arch, mode: 0o644},
		{name: lib + "libdl.so.2", data: "libdl " + arch, mode: 0o644},
		{name: lib + "librt.so.1", data: "librt " + arch, mode: 0o644},
		{name: lib + filepath.Base(info.loader), data: "ld.so " + arch, mode: 0o755},
		{name: lib + "libnss_hesiod.so.2", data: "not needed", mode: 0o644},
		{name: "./sbin/ldconfig", data: "not needed", mode: 0o755},
		{name: "./usr/share/doc/libc6/copyright", data: "glibc's licenses", mode: 0o644},
	}
	if arch == "amd64" {
		files = append(files, standInFile{name: "./lib64/ld-linux-x86-64.so.2", link: "/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2"})
	} else {
		files = append(files, standInFile{name: "./lib/ld-linux-aarch64.so.1", link: "aarch64-linux-gnu/ld-linux-aarch64.so.1"})
	}
	var data bytes.Buffer
	xw, err := xz.NewWriter(&data)
	if err != nil {
		t.Fatal(err)
	}
	tw := tar.NewWriter(xw)
	for _, f := range files {
		h := &tar.Header{Name: f.name, Mode: f.mode, Size: int64(len(f.data)), Typeflag: tar.TypeReg}
		switch {
		case strings.HasSuffix(f.name, "/"):
			h.Typeflag, h.Mode = tar.TypeDir, 0o755
		case f.link != "":
			h.Typeflag, h.Linkname, h.Mode = tar.TypeSymlink, f.link, 0o777
		}
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		if _, err := io.WriteString(tw, f.data); err != nil {
			t.Fatal(err)
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	if err := xw.Close(); err != nil {
		t.Fatal(err)
	}
	var ar bytes.Buffer
	ar.WriteString("!<arch>\n")
	for _, m := range []struct {
		name string
		data []byte
	}{{"debian-binary", []byte("2.0\n")}, {"control.tar.xz", []byte("stand-in control")}, {"data.tar.xz", data.Bytes()}} {
		fmt.Fprintf(&ar, "%-16s%-12d%-6d%-6d%-8s%-10d`\n", m.name, 0, 0, 0, "100644", len(m.data))
		ar.Write(m.data)
		if len(m.data)%2 == 1 {
			ar.WriteByte('\n')
		}
	}
	return ar.Bytes()
}

var standIn struct {
	once sync.Once
	data []byte
	err  error
}

// goBinary is a stand-in for one of gpudra's binaries: a small Go binary
// (testdata/standin) with build information, whose module the SBOM must
// list, made distinct per name and architecture.
func goBinary(t *testing.T, tag string) []byte {
	t.Helper()
	standIn.once.Do(func() {
		goTool, err := exec.LookPath("go")
		if err != nil {
			goTool = filepath.Join(runtime.GOROOT(), "bin", "go")
		}
		out := filepath.Join(os.TempDir(), fmt.Sprintf("gpudra-image-standin-%d", os.Getpid()))
		cmd := exec.Command(goTool, "build", "-trimpath", "-o", out, "./testdata/standin")
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if b, err := cmd.CombinedOutput(); err != nil {
			standIn.err = fmt.Errorf("go build testdata/standin: %w: %s", err, b)
			return
		}
		defer os.Remove(out)
		standIn.data, standIn.err = os.ReadFile(out)
	})
	if standIn.err != nil {
		t.Fatal(standIn.err)
	}
	return append(bytes.Clone(standIn.data), tag...)
}

var binaryNamesUnderTest = []string{"gpudra", "gpudra-controller"}

func testInputs(t *testing.T) Inputs {
	t.Helper()
	in := Inputs{Version: "v0.9.0-3-gabcdef0", Revision: "abcdef0123456789", Source: "https://github.com/gpudra/gpudra",
		Created: created, License: []byte("Apache License 2.0")}
	for _, arch := range []string{"amd64", "arm64"} {
		deb := standInDeb(t, arch)
		sum := sha256.Sum256(deb)
		a := Arch{Arch: arch, Debs: []Package{{Data: deb, Deb: Deb{Package: "libc6", Version: "2.36-9+deb12u14", Arch: arch,
			SHA256: hex.EncodeToString(sum[:]), URL: "http://deb.debian.org/debian/pool/main/g/glibc/libc6_" + arch + ".deb"}}}}
		for _, n := range binaryNamesUnderTest {
			a.Binaries = append(a.Binaries, Binary{Name: n, Data: goBinary(t, n+" "+arch)})
		}
		in.Arches = append(in.Arches, a)
	}
	return in
}

func mustBuild(t *testing.T, in Inputs) *Result {
	t.Helper()
	res, err := Build(in)
	if err != nil {
		t.Fatal(err)
	}
	return res
}

func digest(t *testing.T, d interface{ Digest() (v1.Hash, error) }) v1.Hash {
	t.Helper()
	h, err := d.Digest()
	if err != nil {
		t.Fatal(err)
	}
	return h
}

func TestSameInputsSameDigests(t *testing.T) {
	a, b := mustBuild(t, testInputs(t)), mustBuild(t, testInputs(t))
	if da, db := digest(t, a.Index), digest(t, b.Index); da != db {
		t.Fatalf("two builds of the same inputs: index %s and %s", da, db)
	}
	// And what is written: the layout and the tarballs, byte for byte.
	dirA, dirB := t.TempDir(), t.TempDir()
	outA, err := Write(filepath.Join(dirA, "image"), "v0.9.0", a)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := Write(filepath.Join(dirB, "image"), "v0.9.0", b); err != nil {
		t.Fatal(err)
	}
	if outA.Index != digest(t, a.Index) {
		t.Errorf("Write reports index %s, the index is %s", outA.Index, digest(t, a.Index))
	}
	sums := func(dir string) map[string]string {
		m := map[string]string{}
		err := filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
			if err != nil || d.IsDir() {
				return err
			}
			data, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			rel, _ := filepath.Rel(dir, p)
			m[rel] = fmt.Sprintf("%x", sha256.Sum256(data))
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
		return m
	}
	sa, sb := sums(dirA), sums(dirB)
	if len(sa) < 8 {
		t.Fatalf("Write wrote only %v", sa)
	}
	for p, s := range sa {
		if sb[p] != s {
			t.Errorf("%s differs between two writes of the same inputs", p)
		}
	}
}

func TestOneByteChangesTheDigest(t *testing.T) {
	base := mustBuild(t, testInputs(t))
	in := testInputs(t)
	bin := in.Arches[1].Binaries[0].Data
	bin[len(bin)/2] ^= 1
	changed := mustBuild(t, in)
	if digest(t, base.Index) == digest(t, changed.Index) {
		t.Error("one byte of the arm64 CLI changed, the index digest did not")
	}
	if digest(t, base.Images[0].Image) != digest(t, changed.Images[0].Image) {
		t.Error("a change to the arm64 binary changed the amd64 image")
	}
	if digest(t, base.Images[1].Image) == digest(t, changed.Images[1].Image) {
		t.Error("a change to the arm64 binary left the arm64 image as it was")
	}
	in = testInputs(t)
	in.Created = created.Add(time.Second)
	if digest(t, base.Index) == digest(t, mustBuild(t, in).Index) {
		t.Error("another SOURCE_DATE_EPOCH, the same index digest")
	}
}

func TestIndexHasBothArchitectures(t *testing.T) {
	res := mustBuild(t, testInputs(t))
	m, err := res.Index.IndexManifest()
	if err != nil {
		t.Fatal(err)
	}
	if m.MediaType != types.OCIImageIndex {
		t.Errorf("index media type %s", m.MediaType)
	}
	var platforms []string
	for i, d := range m.Manifests {
		if d.Platform == nil {
			t.Fatalf("manifest %d has no platform", i)
		}
		platforms = append(platforms, d.Platform.String())
		if d.MediaType != types.OCIManifestSchema1 {
			t.Errorf("manifest %d: media type %s", i, d.MediaType)
		}
		if want := digest(t, res.Images[i].Image); d.Digest != want {
			t.Errorf("manifest %d: digest %s, the %s image is %s", i, d.Digest, res.Images[i].Arch, want)
		}
	}
	if got, want := strings.Join(platforms, " "), "linux/amd64 linux/arm64/v8"; got != want {
		t.Errorf("index platforms %q, want %q", got, want)
	}
}

func TestConfig(t *testing.T) {
	in := testInputs(t)
	for _, ai := range mustBuild(t, in).Images {
		cf, err := ai.Image.ConfigFile()
		if err != nil {
			t.Fatal(err)
		}
		if cf.Architecture != ai.Arch || cf.OS != "linux" {
			t.Errorf("%s: config platform %s/%s", ai.Arch, cf.OS, cf.Architecture)
		}
		c := cf.Config
		if c.Entrypoint != nil || c.Cmd != nil {
			t.Errorf("%s: entrypoint %q, cmd %q: the chart names every command", ai.Arch, c.Entrypoint, c.Cmd)
		}
		if c.User != "65532:65532" {
			t.Errorf("%s: user %q, want 65532:65532", ai.Arch, c.User)
		}
		if !strings.Contains(strings.Join(c.Env, " "), "PATH=") || !strings.Contains(strings.Join(c.Env, " "), ":/usr/bin:") {
			t.Errorf("%s: env %q has no PATH with /usr/bin", ai.Arch, c.Env)
		}
		want := map[string]string{
			"org.opencontainers.image.source":   in.Source,
			"org.opencontainers.image.revision": in.Revision,
			"org.opencontainers.image.version":  in.Version,
			"org.opencontainers.image.licenses": "Apache-2.0",
			"org.opencontainers.image.created":  "2026-09-21T14:13:20Z",
		}
		for k, v := range want {
			if c.Labels[k] != v {
				t.Errorf("%s: label %s = %q, want %q", ai.Arch, k, c.Labels[k], v)
			}
		}
		if !cf.Created.Time.Equal(created) {
			t.Errorf("%s: created %s, want SOURCE_DATE_EPOCH %s", ai.Arch, cf.Created, created)
		}
		if len(cf.History) != 2 {
			t.Fatalf("%s: %d history entries, want one per layer (2)", ai.Arch, len(cf.History))
		}
		for _, h := range cf.History {
			if !h.Created.Time.Equal(created) {
				t.Errorf("%s: history %q created %s", ai.Arch, h.CreatedBy, h.Created)
			}
		}
	}
}

type layerFile struct {
	hdr  *tar.Header
	data []byte
}

func layerFiles(t *testing.T, l v1.Layer) map[string]layerFile {
	t.Helper()
	rc, err := l.Uncompressed()
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	files := map[string]layerFile{}
	tr := tar.NewReader(rc)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return files
		}
		if err != nil {
			t.Fatal(err)
		}
		data, err := io.ReadAll(tr)
		if err != nil {
			t.Fatal(err)
		}
		files[h.Name] = layerFile{h, data}
	}
}

func TestLayers(t *testing.T) {
	in := testInputs(t)
	for i, ai := range mustBuild(t, in).Images {
		layers, err := ai.Image.Layers()
		if err != nil {
			t.Fatal(err)
		}
		if len(layers) != 2 {
			t.Fatalf("%s: %d layers, want 2 (base, gpudra)", ai.Arch, len(layers))
		}
		triplet := archInfos[ai.Arch].triplet
		base := layerFiles(t, layers[0])
		var names []string
		for n, f := range base {
			names = append(names, n)
			if !f.hdr.ModTime.Equal(created) {
				t.Errorf("%s: %s mtime %s, want SOURCE_DATE_EPOCH", ai.Arch, n, f.hdr.ModTime)
			}
			if f.hdr.Uname != "" || f.hdr.Gname != "" {
				t.Errorf("%s: %s owned by names %q:%q", ai.Arch, n, f.hdr.Uname, f.hdr.Gname)
			}
		}
		sort.Strings(names)
		lib := "lib/" + triplet + "/"
		want := []string{"etc/", "etc/group", "etc/passwd", "home/", "home/nonroot/", "lib/", lib,
			lib + filepath.Base(archInfos[ai.Arch].loader), lib + "libc.so.6", lib + "libdl.so.2", lib + "libm.so.6",
			lib + "libpthread.so.0", lib + "librt.so.1", "tmp/", "usr/", "usr/share/", "usr/share/doc/",
			"usr/share/doc/libc6/", "usr/share/doc/libc6/copyright"}
		if ai.Arch == "amd64" {
			want = append(want, "lib64/", "lib64/ld-linux-x86-64.so.2")
		} else {
			want = append(want, "lib/ld-linux-aarch64.so.1")
		}
		sort.Strings(want)
		if strings.Join(names, "\n") != strings.Join(want, "\n") {
			t.Errorf("%s: base layer\n%s\nwant (nothing else of libc6: no ldconfig, no NSS modules)\n%s", ai.Arch, strings.Join(names, "\n"), strings.Join(want, "\n"))
		}
		loader := strings.TrimPrefix(archInfos[ai.Arch].loader, "/")
		if h := base[loader].hdr; h == nil || h.Typeflag != tar.TypeSymlink {
			t.Errorf("%s: %s is not the package's symlink: %+v", ai.Arch, loader, h)
		}
		if f := base[lib+"libc.so.6"]; string(f.data) != "libc "+ai.Arch || f.hdr.Mode != 0o755 || f.hdr.Uid != 0 {
			t.Errorf("%s: libc.so.6 is %q mode %o uid %d: not the package's file", ai.Arch, f.data, f.hdr.Mode, f.hdr.Uid)
		}
		if h := base["tmp/"].hdr; h.Mode != 0o1777 {
			t.Errorf("%s: /tmp mode %o, want 1777", ai.Arch, h.Mode)
		}
		if h := base["home/nonroot/"].hdr; h.Uid != NonRoot || h.Gid != NonRoot {
			t.Errorf("%s: /home/nonroot owned by %d:%d", ai.Arch, h.Uid, h.Gid)
		}
		if p := string(base["etc/passwd"].data); !strings.Contains(p, "nonroot:x:65532:65532:") {
			t.Errorf("%s: /etc/passwd has no nonroot 65532: %q", ai.Arch, p)
		}
		if g := string(base["etc/group"].data); !strings.Contains(g, "nonroot:x:65532:") {
			t.Errorf("%s: /etc/group has no nonroot 65532: %q", ai.Arch, g)
		}

		app := layerFiles(t, layers[1])
		for _, b := range in.Arches[i].Binaries {
			f, ok := app["usr/bin/"+b.Name]
			if !ok {
				t.Fatalf("%s: no /usr/bin/%s", ai.Arch, b.Name)
			}
			if !bytes.Equal(f.data, b.Data) || f.hdr.Mode != 0o755 || f.hdr.Uid != 0 || f.hdr.Gid != 0 {
				t.Errorf("%s: /usr/bin/%s: mode %o, %d:%d, same bytes %t; want 0755 root's, the binary", ai.Arch, b.Name,
					f.hdr.Mode, f.hdr.Uid, f.hdr.Gid, bytes.Equal(f.data, b.Data))
			}
		}
		if !bytes.Equal(app[strings.TrimPrefix(SBOMPath, "/")].data, ai.SBOM) {
			t.Errorf("%s: the image's %s is not the SBOM Build returned", ai.Arch, SBOMPath)
		}
		if string(app["usr/share/doc/gpudra/LICENSE"].data) != string(in.License) {
			t.Errorf("%s: no LICENSE beside the SBOM", ai.Arch)
		}
	}
}

func TestSBOM(t *testing.T) {
	in := testInputs(t)
	bi, err := buildinfo.Read(bytes.NewReader(in.Arches[0].Binaries[0].Data))
	if err != nil {
		t.Fatal(err)
	}
	var xzVersion string
	for _, d := range bi.Deps {
		if d.Path == "github.com/ulikunitz/xz" {
			xzVersion = d.Version
		}
	}
	if xzVersion == "" {
		t.Fatalf("the stand-in binary does not record github.com/ulikunitz/xz: %v", bi)
	}
	for i, ai := range mustBuild(t, in).Images {
		var doc spdxDoc
		if err := json.Unmarshal(ai.SBOM, &doc); err != nil {
			t.Fatalf("%s: SBOM is not JSON: %v", ai.Arch, err)
		}
		if doc.SPDXVersion != "SPDX-2.3" || doc.DataLicense != "CC0-1.0" || doc.SPDXID != "SPDXRef-DOCUMENT" || doc.DocumentNamespace == "" {
			t.Errorf("%s: not an SPDX 2.3 document: %+v", ai.Arch, doc)
		}
		byName := map[string]spdxPackage{}
		ids := map[string]bool{}
		for _, p := range doc.Packages {
			byName[p.Name+" "+p.VersionInfo] = p
			if ids[p.SPDXID] {
				t.Errorf("%s: SPDXID %s twice", ai.Arch, p.SPDXID)
			}
			ids[p.SPDXID] = true
		}
		for _, b := range in.Arches[i].Binaries {
			p, ok := byName[b.Name+" "+in.Version]
			sum := sha256.Sum256(b.Data)
			if !ok || len(p.Checksums) != 1 || p.Checksums[0].Value != hex.EncodeToString(sum[:]) {
				t.Errorf("%s: SBOM has no %s with its SHA-256: %+v", ai.Arch, b.Name, p)
			}
		}
		if p, ok := byName["github.com/ulikunitz/xz "+xzVersion]; !ok || p.ExternalRefs[0].Locator != "pkg:golang/github.com/ulikunitz/xz@"+xzVersion {
			t.Errorf("%s: SBOM does not list the module github.com/ulikunitz/xz %s, which the binaries record: %+v", ai.Arch, xzVersion, p)
		}
		if _, ok := byName["stdlib "+bi.GoVersion]; !ok {
			t.Errorf("%s: SBOM does not list the Go toolchain %s", ai.Arch, bi.GoVersion)
		}
		deb := in.Arches[i].Debs[0].Deb
		if p, ok := byName["libc6 "+deb.Version]; !ok || p.Checksums[0].Value != deb.SHA256 || p.DownloadLocation != deb.URL {
			t.Errorf("%s: SBOM has no libc6 %s with its checksum and URL: %+v", ai.Arch, deb.Version, p)
		}
		for _, r := range doc.Relationships {
			if !ids[r.Element] && r.Element != "SPDXRef-DOCUMENT" || !ids[r.Related] {
				t.Errorf("%s: relationship %+v names an unknown element", ai.Arch, r)
			}
		}
	}
}

func TestChecksumMismatchRefused(t *testing.T) {
	in := testInputs(t)
	in.Arches[1].Debs[0].Data = standInDeb(t, "amd64") // another file than the one pinned
	_, err := Build(in)
	if err == nil || !strings.Contains(err.Error(), "libc6") || !strings.Contains(err.Error(), "lock file pins") {
		t.Fatalf("a .deb whose checksum is not the lock's: error %v, want one naming libc6 and the pinned checksum", err)
	}
}

func TestPackageWithoutTheFilesRefused(t *testing.T) {
	in := testInputs(t)
	in.Arches[0].Debs[0].Deb.Package = "libgcc-s1"
	if _, err := Build(in); err == nil || !strings.Contains(err.Error(), "libgcc-s1") {
		t.Errorf("a package the image takes nothing from: error %v", err)
	}
}

func TestTarballIsTheImage(t *testing.T) {
	res := mustBuild(t, testInputs(t))
	out, err := Write(filepath.Join(t.TempDir(), "image"), "v0.9.0", res)
	if err != nil {
		t.Fatal(err)
	}
	tag, err := name.NewTag(Repository + ":v0.9.0")
	if err != nil {
		t.Fatal(err)
	}
	for _, ai := range res.Images {
		img, err := tarball.ImageFromPath(out.Tarballs[ai.Arch], &tag)
		if err != nil {
			t.Fatalf("%s: %v", ai.Arch, err)
		}
		// docker save's format keeps the config and the layers, not the
		// manifest: those are what must be the built image's.
		gotCfg, err := img.ConfigName()
		if err != nil {
			t.Fatal(err)
		}
		if wantCfg, _ := ai.Image.ConfigName(); gotCfg != wantCfg {
			t.Errorf("%s: tarball's config %s, built %s", ai.Arch, gotCfg, wantCfg)
		}
		gotLayers, _ := img.Layers()
		wantLayers, _ := ai.Image.Layers()
		if len(gotLayers) != len(wantLayers) {
			t.Fatalf("%s: tarball has %d layers, built %d", ai.Arch, len(gotLayers), len(wantLayers))
		}
		for j := range gotLayers {
			if g, w := digest(t, gotLayers[j]), digest(t, wantLayers[j]); g != w {
				t.Errorf("%s: tarball's layer %d is %s, built %s", ai.Arch, j, g, w)
			}
		}
	}
	lp, err := layout.FromPath(out.Layout)
	if err != nil {
		t.Fatal(err)
	}
	top, err := lp.ImageIndex()
	if err != nil {
		t.Fatal(err)
	}
	m, err := top.IndexManifest()
	if err != nil {
		t.Fatal(err)
	}
	if len(m.Manifests) != 1 || m.Manifests[0].Digest != out.Index || m.Manifests[0].Annotations["org.opencontainers.image.ref.name"] != "v0.9.0" {
		t.Errorf("layout's index.json: %+v, want the index %s named v0.9.0", m.Manifests, out.Index)
	}
}

func TestParseLock(t *testing.T) {
	f, err := os.Open("../../hack/image/debian.lock")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	debs, err := ParseLock(f)
	if err != nil {
		t.Fatal(err)
	}
	arches := map[string]Deb{}
	for _, d := range debs {
		arches[d.Arch] = d
		if _, err := debPaths(d.Package, d.Arch); err != nil {
			t.Error(err)
		}
		if !strings.HasSuffix(d.URL, "/"+d.String()+".deb") {
			t.Errorf("%s: URL %s is not the package's file", d, d.URL)
		}
	}
	if len(debs) != 2 || arches["amd64"].Version == "" || arches["amd64"].Version != arches["arm64"].Version {
		t.Errorf("lock file: %+v, want libc6 at one version for amd64 and arm64", debs)
	}
	for _, bad := range []string{"libc6 1 amd64 abc http://x\n", "libc6 1 amd64\n"} {
		if _, err := ParseLock(strings.NewReader(bad)); err == nil {
			t.Errorf("ParseLock(%q) accepted it", bad)
		}
	}
}

func TestFetchDeb(t *testing.T) {
	good := standInDeb(t, "amd64")
	sum := sha256.Sum256(good)
	d := Deb{Package: "libc6", Version: "2.36-9+deb12u14", Arch: "amd64", SHA256: hex.EncodeToString(sum[:])}
	serve := good
	requests := 0
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		requests++
		w.Write(serve)
	}))
	defer srv.Close()
	d.URL = srv.URL + "/libc6.deb"
	cache := t.TempDir()
	ctx := context.Background()

	// A mirror serving other bytes: refused, and nothing cached.
	serve = append(bytes.Clone(good), 0)
	if _, err := FetchDeb(ctx, srv.Client(), d, cache, io.Discard); err == nil || !strings.Contains(err.Error(), "libc6") {
		t.Fatalf("a download whose checksum is not the lock's: error %v, want one naming libc6", err)
	}
	if entries, _ := os.ReadDir(cache); len(entries) != 0 {
		t.Errorf("a refused download was cached: %v", entries)
	}
	serve = good
	data, err := FetchDeb(ctx, srv.Client(), d, cache, io.Discard)
	if err != nil || !bytes.Equal(data, good) {
		t.Fatalf("FetchDeb: %v", err)
	}
	// Then from the cache, without the network.
	srv.Close()
	before := requests
	if data, err = FetchDeb(ctx, srv.Client(), d, cache, io.Discard); err != nil || !bytes.Equal(data, good) || requests != before {
		t.Errorf("from the cache: %v, %d requests", err, requests-before)
	}
	// A damaged cached copy is not used.
	if err := os.WriteFile(filepath.Join(cache, d.String()+".deb"), []byte("damaged"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := FetchDeb(ctx, srv.Client(), d, cache, io.Discard); err == nil {
		t.Error("a damaged cached copy was used (the server is gone: it had to fail)")
	}
}

func TestUnpackIsTheImage(t *testing.T) {
	res := mustBuild(t, testInputs(t))
	out, err := Write(filepath.Join(t.TempDir(), "image"), "v0.9.0", res)
	if err != nil {
		t.Fatal(err)
	}
	dest := t.TempDir()
	for _, ai := range res.Images {
		u, err := Unpack(out.Layout, ai.Arch, dest)
		if err != nil {
			t.Fatalf("%s: %v", ai.Arch, err)
		}
		if want := digest(t, ai.Image); u.Digest != want {
			t.Errorf("%s: unpacked %s, want the image %s", ai.Arch, u.Digest, want)
		}
		if u.Config.User != "65532:65532" {
			t.Errorf("%s: config user %q", ai.Arch, u.Config.User)
		}
		// Every file of every layer is in the rootfs, a regular file with
		// its content and mode.
		layers, err := ai.Image.Layers()
		if err != nil {
			t.Fatal(err)
		}
		files := 0
		for _, l := range layers {
			for n, f := range layerFiles(t, l) {
				if f.hdr.Typeflag == tar.TypeDir || f.hdr.Typeflag == tar.TypeReg {
					// Owner and mode, special bits included (the image's
					// /tmp is sticky, /home/nonroot is 65532's).
					st, err := os.Lstat(filepath.Join(u.Rootfs, n))
					if err != nil {
						t.Errorf("%s: %v", ai.Arch, err)
						continue
					}
					if want := f.hdr.FileInfo().Mode(); st.Mode() != want {
						t.Errorf("%s: %s mode %v, layer %v", ai.Arch, n, st.Mode(), want)
					}
					if sys, ok := st.Sys().(*syscall.Stat_t); ok && os.Geteuid() == 0 && (int(sys.Uid) != f.hdr.Uid || int(sys.Gid) != f.hdr.Gid) {
						t.Errorf("%s: %s owned by %d:%d, layer %d:%d", ai.Arch, n, sys.Uid, sys.Gid, f.hdr.Uid, f.hdr.Gid)
					}
				}
				if f.hdr.Typeflag != tar.TypeReg {
					continue
				}
				files++
				p := filepath.Join(u.Rootfs, n)
				got, err := os.ReadFile(p)
				if err != nil {
					t.Errorf("%s: %v", ai.Arch, err)
					continue
				}
				if !bytes.Equal(got, f.data) {
					t.Errorf("%s: %s differs from the layer's", ai.Arch, n)
				}
			}
		}
		if files == 0 {
			t.Fatalf("%s: no files checked", ai.Arch)
		}
	}
	if _, err := Unpack(out.Layout, "riscv64", dest); err == nil || !strings.Contains(err.Error(), "no linux/riscv64 image") {
		t.Errorf("an architecture the index lacks: %v", err)
	}
}

// TestUntarStaysInRoot: a layer whose link points out of the root cannot
// take a later entry's write with it.
func TestUntarStaysInRoot(t *testing.T) {
	outside := t.TempDir()
	for _, tc := range []struct {
		name    string
		entries []tar.Header
	}{
		{"a symlink to an outside directory, then a file through it", []tar.Header{
			{Name: "a", Typeflag: tar.TypeSymlink, Linkname: outside},
			{Name: "a/escaped", Typeflag: tar.TypeReg, Mode: 0o644, Size: 1}}},
		{"a relative symlink up and out", []tar.Header{
			{Name: "b", Typeflag: tar.TypeSymlink, Linkname: "../../../../../../../.." + outside},
			{Name: "b/escaped", Typeflag: tar.TypeReg, Mode: 0o644, Size: 1}}},
		{"a directory through a link", []tar.Header{
			{Name: "c", Typeflag: tar.TypeSymlink, Linkname: outside},
			{Name: "c/escaped/", Typeflag: tar.TypeDir, Mode: 0o755}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var buf bytes.Buffer
			tw := tar.NewWriter(&buf)
			for _, h := range tc.entries {
				if err := tw.WriteHeader(&h); err != nil {
					t.Fatal(err)
				}
				if h.Size > 0 {
					_, _ = tw.Write([]byte("x"))
				}
			}
			_ = tw.Close()
			err := untar(&buf, t.TempDir())
			if err == nil {
				t.Error("untar followed a link out of the root without an error")
			}
			if _, err := os.Lstat(filepath.Join(outside, "escaped")); err == nil {
				t.Fatalf("untar wrote %s, outside the root", filepath.Join(outside, "escaped"))
			}
		})
	}
}
