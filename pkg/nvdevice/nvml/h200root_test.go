//go:build cgo && linux

package nvml

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/gpudra/gpudra/pkg/cdi"
)

// The H200's capture (testdata/real-gpus/h200): host-info.txt lists the
// driver's directories as `ls -la` printed them (its lib64 listing stops
// short), and the with-gpu pod's driverMounts are every file the plugin's
// driver spec mounted from that host.
const (
	h200HostInfo  = "../../../testdata/real-gpus/h200/host-info.txt"
	h200WithGPU   = "../../../testdata/real-gpus/h200/mps-pass/pods/with-gpu.json"
	h200DriverVer = "580.159.04"
)

// h200RootStats is what layOutH200DriverRoot made.
type h200RootStats struct {
	Files, Symlinks, Dirs int
}

// layOutH200DriverRoot lays out, under root, the H200 host's driver files
// as its capture shows them: the same names, symlinks and directories, each
// file empty (their contents are no part of discovery). The driver root is
// root itself, as on that host ("/"): the files sit at
// root/usr/local/nvidia/... . Nothing of it is committed but the listing.
func layOutH200DriverRoot(t testing.TB, root string) h200RootStats {
	t.Helper()
	var st h200RootStats
	dirs := map[string]bool{}
	mkdir := func(d string) {
		if dirs[d] {
			return
		}
		require.NoError(t, os.MkdirAll(filepath.Join(root, d), 0o755))
		dirs[d] = true
	}
	file := func(p string, mode os.FileMode) {
		full := filepath.Join(root, p)
		if _, err := os.Lstat(full); err == nil {
			return
		}
		mkdir(filepath.Dir(p))
		require.NoError(t, os.WriteFile(full, nil, mode))
		st.Files++
	}
	link := func(p, target string) {
		full := filepath.Join(root, p)
		if _, err := os.Lstat(full); err == nil {
			return
		}
		mkdir(filepath.Dir(p))
		require.NoError(t, os.Symlink(target, full))
		st.Symlinks++
	}

	// host-info.txt: "<dir>:" starts a listing; "-rwx... name" and
	// "lrwx... name -> target" are its entries; a line of `ls -l <path>`
	// names its file in full.
	f, err := os.Open(h200HostInfo)
	require.NoError(t, err)
	defer f.Close()
	dir := ""
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(line, "/") && strings.HasSuffix(line, ":") {
			dir = strings.TrimSuffix(line, ":")
			mkdir(dir)
			continue
		}
		fields := strings.Fields(line)
		if len(fields) < 9 || (line[0] != '-' && line[0] != 'l') {
			continue
		}
		name := fields[8]
		p := name
		if !filepath.IsAbs(name) {
			if dir == "" {
				continue
			}
			p = filepath.Join(dir, name)
		}
		mode := os.FileMode(0o644)
		if strings.Contains(fields[0], "x") {
			mode = 0o755
		}
		switch {
		case line[0] == 'l' && len(fields) >= 11 && fields[9] == "->":
			link(p, fields[10])
		case line[0] == '-':
			file(p, mode)
		}
	}
	require.NoError(t, sc.Err())

	// The pod's driverMounts: host path, container path (the same on that
	// host) and options. A file the listing cut off is made; a container
	// path other than its host path is the soname link to it.
	raw, err := os.ReadFile(h200WithGPU)
	require.NoError(t, err)
	var pod struct {
		Smi struct {
			DriverMounts []string `json:"driverMounts"`
		} `json:"smi"`
	}
	require.NoError(t, json.Unmarshal(raw, &pod))
	require.NotEmpty(t, pod.Smi.DriverMounts, "no driverMounts in %s", h200WithGPU)
	for _, m := range pod.Smi.DriverMounts {
		parts := strings.SplitN(m, ":", 3)
		require.Len(t, parts, 3, "driver mount %q", m)
		host, ctr := parts[0], parts[1]
		file(host, 0o755)
		if ctr != host {
			link(ctr, filepath.Base(host))
		}
	}
	writeLDCache(t, root, "usr/local/nvidia/lib64")
	st.Dirs = len(dirs)
	return st
}

// writeLDCache writes root/etc/ld.so.cache (glibc's format 1.1, x86-64)
// listing every library in libDir, as ldconfig on the H200 host listed
// /usr/local/nvidia/lib64: the toolkit's discovery finds the driver's
// libraries through the cache, not by searching directories.
func writeLDCache(t testing.TB, root, libDir string) {
	t.Helper()
	entries, err := os.ReadDir(filepath.Join(root, libDir))
	require.NoError(t, err)
	var names []string
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), "lib") && strings.Contains(e.Name(), ".so") {
			names = append(names, e.Name())
		}
	}
	const headerSize, entrySize = 48, 24
	var strs bytes.Buffer
	type ent struct{ key, value uint32 }
	var ents []ent
	base := uint32(headerSize + entrySize*len(names))
	for _, n := range names {
		k := base + uint32(strs.Len())
		strs.WriteString(n + "\x00")
		v := base + uint32(strs.Len())
		strs.WriteString("/" + filepath.Join(libDir, n) + "\x00")
		ents = append(ents, ent{k, v})
	}
	var out bytes.Buffer
	out.WriteString("glibc-ld.so.cache1.1")
	le := binary.LittleEndian
	out.Write(le.AppendUint32(nil, uint32(len(names))))
	out.Write(le.AppendUint32(nil, uint32(strs.Len())))
	out.Write(make([]byte, 12+8))
	for _, e := range ents {
		out.Write(le.AppendUint32(nil, 0x0301)) // ELF, x86-64
		out.Write(le.AppendUint32(nil, e.key))
		out.Write(le.AppendUint32(nil, e.value))
		out.Write(make([]byte, 4+8))
	}
	out.Write(strs.Bytes())
	require.NoError(t, os.MkdirAll(filepath.Join(root, "etc"), 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(root, "etc/ld.so.cache"), out.Bytes(), 0o644))
}

// TestH200DriverRootLayout: the laid-out root has the capture's files, and
// the backend's discovery (the toolkit's nvcdi) finds in it what the H200's
// plugin mounted into its pod.
func TestH200DriverRootLayout(t *testing.T) {
	root := t.TempDir()
	st := layOutH200DriverRoot(t, root)
	require.GreaterOrEqual(t, st.Files, 30, "the H200's driver files")
	require.GreaterOrEqual(t, st.Symlinks, 40, "their soname links")

	target, err := os.Readlink(filepath.Join(root, "usr/local/nvidia/lib64/libcuda.so.1"))
	require.NoError(t, err)
	require.Equal(t, "libcuda.so."+h200DriverVer, target)

	files, err := discoverDriverFiles(t.Context(), root)
	require.NoError(t, err)
	require.Equal(t, h200DriverVer, files.Version)
	var found []string
	for _, m := range files.Mounts {
		found = append(found, m.ContainerPath)
	}
	require.Contains(t, found, "/usr/local/nvidia/lib64/libcuda.so."+h200DriverVer)
	require.Contains(t, found, "/usr/local/nvidia/lib64/libnvidia-ml.so."+h200DriverVer)
	spec, err := cdi.BuildDriverSpec(files, cdi.DriverOptions{})
	require.NoError(t, err)
	mounts := spec.Devices[0].ContainerEdits.Mounts
	t.Logf("H200-shaped driver root: %d files, %d links, %d directories; discovery found %d files, the spec mounts %d (the H200's plugin: 59)",
		st.Files, st.Symlinks, st.Dirs, len(files.Mounts), len(mounts))
	require.GreaterOrEqual(t, len(mounts), 50, "about the H200's 59 mounts")
}
