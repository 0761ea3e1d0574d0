package drivertools

import (
	"bytes"
	"context"
	"debug/elf"
	"encoding/binary"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// toolSource is a driver tool that only works when everything it loads
// comes from the driver root ROOT: it fails when a shared object is mapped
// from outside ROOT (this container's loader or libc), or when
// LD_LIBRARY_PATH names a directory holding a libc.so.6 (a loader meeting a
// libc that is not its own: what breaks the real tools on Ubuntu 22.04+ and
// RHEL 9 hosts). Otherwise it prints its argv.
const toolSource = `
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int main(int argc, char **argv) {
	int bad = 0;
	const char *llp = getenv("LD_LIBRARY_PATH");
	if (llp != NULL) {
		char *dirs = strdup(llp), *save = NULL;
		for (char *d = strtok_r(dirs, ":", &save); d != NULL; d = strtok_r(NULL, ":", &save)) {
			char p[4096];
			snprintf(p, sizeof p, "%s/libc.so.6", d);
			if (access(p, F_OK) == 0) {
				fprintf(stderr, "LD_LIBRARY_PATH has %s, which holds a libc.so.6\n", d);
				bad = 1;
			}
		}
	}
	FILE *maps = fopen("/proc/self/maps", "r");
	if (maps == NULL) {
		perror("/proc/self/maps");
		return 3;
	}
	char line[8192], last[8192] = "";
	while (fgets(line, sizeof line, maps) != NULL) {
		char *p = strchr(line, '/');
		if (p == NULL || strstr(p, ".so") == NULL)
			continue;
		p[strcspn(p, "\n")] = 0;
		if (strncmp(p, ROOT "/", strlen(ROOT) + 1) != 0 && strcmp(p, last) != 0) {
			fprintf(stderr, "loaded %s, which is not under the driver root\n", p);
			bad = 1;
		}
		snprintf(last, sizeof last, "%s", p);
	}
	fclose(maps);
	if (bad)
		return 1;
	for (int i = 0; i < argc; i++)
		printf("argv[%d]=%s\n", i, argv[i]);
	return 0;
}
`

// fakeRoot is a driver root built from this machine's loader and libc the
// way Debian lays them out: <root>/lib64/ld-linux-x86-64.so.2 is an
// absolute symbolic link to /lib/<multiarch>/..., which only names the
// root's loader when followed inside the root.
type fakeRoot struct {
	root, libDir, loader string
	// tool is the driver tool built into the root.
	tool string
	// libraryPath is what the loader is given: the directory of
	// libnvidia-ml.so.1 and libc, then lib64 (where the loader's link is)
	// and lib, the root's library directories that exist.
	libraryPath string
}

func compile(t *testing.T, out, src string, flags ...string) error {
	t.Helper()
	c := filepath.Join(t.TempDir(), "tool.c")
	require.NoError(t, os.WriteFile(c, []byte(src), 0o644))
	gcc := exec.Command("gcc", append(append([]string{"-O", "-o", out}, flags...), c)...)
	if b, err := gcc.CombinedOutput(); err != nil {
		t.Logf("gcc %v: %v: %s", flags, err, b)
		return err
	}
	return nil
}

func newFakeRoot(t *testing.T) fakeRoot {
	return newFakeDriver(t, driverLayout{bin: "usr/bin"})
}

// driverLayout is where a driver install puts its tools and NVML.
type driverLayout struct {
	// sys is where the system the tool runs on (its loader, libc) is,
	// inside the driver root: "" (the driver root itself), or a driver
	// container's root inside a host's (DriverContainerRoot).
	sys string
	// bin is where the tool is, and nvml where libnvidia-ml.so.1 is
	// (empty: beside libc, in lib/<multiarch>), inside sys.
	bin, nvml string
	// nvmlLink, when set, is a directory (inside sys) that is a symbolic
	// link to nvml, as /usr/local/nvidia/lib -> lib64.
	nvmlLink string
	// wrapper puts a script in usr/bin (of the driver root) that execs
	// /<bin>/nvidia-smi, as /usr/bin/nvidia-smi does on hosts with the
	// driver under /usr/local/nvidia.
	wrapper bool
}

// newFakeDriver builds a driver root in layout l around a tool
// (usr/bin/nvidia-smi of l) that fails unless every shared object it
// loads comes from the system it belongs to (l.sys).
func newFakeDriver(t *testing.T, l driverLayout) fakeRoot {
	t.Helper()
	if runtime.GOOS != "linux" {
		t.Skip("needs Linux and glibc's ld.so")
	}
	if _, err := exec.LookPath("gcc"); err != nil {
		t.Skip("gcc is not installed: it builds the fake driver tool")
	}
	root, err := filepath.EvalSymlinks(t.TempDir())
	require.NoError(t, err)
	sys := filepath.Join(root, l.sys)
	multiarch, err := exec.Command("gcc", "-print-multiarch").Output()
	require.NoError(t, err)
	lib := filepath.Join("lib", strings.TrimSpace(string(multiarch)))
	require.NoError(t, os.MkdirAll(filepath.Join(sys, lib), 0o755))
	require.NoError(t, os.MkdirAll(filepath.Join(sys, l.bin), 0o755))

	tool := filepath.Join(sys, l.bin, "nvidia-smi")
	require.NoError(t, compile(t, tool, toolSource, `-DROOT="`+sys+`"`))
	interp, _, err := readInterp(tool)
	require.NoError(t, err)
	require.NotEmpty(t, interp, "gcc built a dynamically linked tool")

	// This machine's loader and libc, copied into the root.
	hostLoader, err := filepath.EvalSymlinks(interp)
	require.NoError(t, err)
	libcName, err := exec.Command("gcc", "-print-file-name=libc.so.6").Output()
	require.NoError(t, err)
	hostLibc, err := filepath.EvalSymlinks(strings.TrimSpace(string(libcName)))
	require.NoError(t, err)
	loader := filepath.Join(sys, lib, "ld-root.so")
	copyFile(t, hostLoader, loader, 0o755)
	copyFile(t, hostLibc, filepath.Join(sys, lib, "libc.so.6"), 0o755)
	nvml := l.nvml
	if nvml == "" {
		nvml = lib
	}
	require.NoError(t, os.MkdirAll(filepath.Join(sys, nvml), 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(sys, nvml, NVMLLibrary), []byte("not a library: the tool does not load it"), 0o644))
	if l.nvmlLink != "" {
		require.NoError(t, os.Symlink(filepath.Base(nvml), filepath.Join(sys, l.nvmlLink)))
	}
	require.NoError(t, os.MkdirAll(filepath.Join(sys, filepath.Dir(interp)), 0o755))
	require.NoError(t, os.Symlink("/"+lib+"/ld-root.so", filepath.Join(sys, interp)))
	if l.wrapper {
		require.NoError(t, os.MkdirAll(filepath.Join(root, "usr/bin"), 0o755))
		require.NoError(t, os.WriteFile(filepath.Join(root, "usr/bin/nvidia-smi"),
			[]byte("#!/bin/sh\nexec /"+l.bin+"/nvidia-smi \"$@\"\n"), 0o755))
	}
	dirs := []string{filepath.Join(sys, nvml)}
	for _, d := range []string{lib, "lib64", "lib"} {
		if d := filepath.Join(sys, d); !slices.Contains(dirs, d) {
			dirs = append(dirs, d)
		}
	}
	return fakeRoot{root: root, libDir: filepath.Join(sys, lib), loader: loader, tool: tool, libraryPath: strings.Join(dirs, ":")}
}

func copyFile(t *testing.T, from, to string, mode os.FileMode) {
	t.Helper()
	b, err := os.ReadFile(from)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(to, b, mode))
}

func TestToolRunsUnderTheRootsOwnLoader(t *testing.T) {
	fr := newFakeRoot(t)
	tool := filepath.Join(fr.root, "usr/bin/nvidia-smi")
	args := []string{"compute-policy", "-i", "GPU-1", "--set-timeslice", "3"}

	// The old way: the tool run directly (by this machine's loader) with
	// LD_LIBRARY_PATH at the directory of libnvidia-ml.so.1 in the root.
	old := exec.Command(tool, args...)
	old.Env = append(os.Environ(), "LD_LIBRARY_PATH="+fr.libDir)
	out, err := old.CombinedOutput()
	require.Error(t, err, "the old way mixes this machine's loader with the root's libc: %s", out)
	t.Logf("the old way fails: %v: %s", err, out)
	assert.Contains(t, string(out), "LD_LIBRARY_PATH has "+fr.libDir)
	assert.Contains(t, string(out), "which is not under the driver root")

	// An inherited LD_LIBRARY_PATH (and LD_PRELOAD) must not reach the tool.
	t.Setenv("LD_LIBRARY_PATH", fr.libDir)
	t.Setenv("LD_PRELOAD", filepath.Join(fr.libDir, "libc.so.6"))
	r := Runner{Root: fr.root}
	p, ok := r.Path("nvidia-smi")
	assert.True(t, ok)
	assert.Equal(t, tool, p)
	cmd, err := r.Command(context.Background(), "nvidia-smi", args...)
	require.NoError(t, err)
	assert.Equal(t, fr.loader, cmd.Path, "the root's loader, found through the root's absolute link")
	assert.Equal(t, append([]string{fr.loader, "--inhibit-cache", "--library-path", fr.libraryPath, tool}, args...), cmd.Args)
	for _, kv := range cmd.Env {
		assert.False(t, strings.HasPrefix(kv, "LD_LIBRARY_PATH=") || strings.HasPrefix(kv, "LD_PRELOAD="), "inherited %s", kv)
	}
	out, err = cmd.CombinedOutput()
	require.NoError(t, err, "%s", out)
	want := "argv[0]=" + tool + "\n"
	for i, a := range args {
		want += "argv[" + string(rune('1'+i)) + "]=" + a + "\n"
	}
	assert.Equal(t, want, string(out), "the tool got its own path as argv[0] and its arguments")

	// The same tool named by its path inside the root, or by its path as
	// this process sees it.
	for _, name := range []string{"/usr/bin/nvidia-smi", "usr/bin/nvidia-smi", tool} {
		cmd, err := r.Command(context.Background(), name, "x")
		require.NoError(t, err, name)
		assert.Equal(t, []string{fr.loader, "--inhibit-cache", "--library-path", fr.libraryPath, tool, "x"}, cmd.Args, name)
	}
}

// Every layout a driver is installed in: the tool named by its name alone
// is found, and really runs through the loader and libc of the system it
// belongs to, with the directory of its own install's NVML first on the
// library path.
func TestToolsFoundInEveryLayout(t *testing.T) {
	for _, tc := range []struct {
		name   string
		layout driverLayout
		// driverRoot is the Runner's root, inside the built root.
		driverRoot string
	}{
		{name: "distribution (Debian packages)", layout: driverLayout{bin: "usr/bin", nvml: "usr/lib/x86_64-linux-gnu/nvidia/current"}},
		{name: "distribution (RHEL packages)", layout: driverLayout{bin: "usr/bin", nvml: "usr/lib64"}},
		{name: ".run installer", layout: driverLayout{bin: "usr/bin", nvml: "usr/lib/x86_64-linux-gnu"}},
		{name: "/usr/local/nvidia, a wrapper script in usr/bin", layout: driverLayout{bin: "usr/local/nvidia/bin", nvml: "usr/local/nvidia/lib64", nvmlLink: "usr/local/nvidia/lib", wrapper: true}},
		{name: "driver container at run/nvidia/driver of the host root", layout: driverLayout{sys: DriverContainerRoot, bin: "usr/bin", nvml: "usr/lib64"}},
		{name: "driver container as the driver root", layout: driverLayout{sys: DriverContainerRoot, bin: "usr/bin", nvml: "usr/lib64"}, driverRoot: DriverContainerRoot},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fr := newFakeDriver(t, tc.layout)
			sys := filepath.Join(fr.root, tc.layout.sys)
			r := Runner{Root: filepath.Join(fr.root, tc.driverRoot)}
			p, err := r.Find("nvidia-smi")
			require.NoError(t, err)
			assert.Equal(t, fr.tool, p)
			cmd, err := r.Command(context.Background(), "nvidia-smi", "-L")
			require.NoError(t, err)
			require.Len(t, cmd.Args, 6)
			assert.Equal(t, fr.loader, cmd.Path, "the loader of the tool's own system")
			assert.Equal(t, filepath.Join(sys, tc.layout.nvml), strings.Split(cmd.Args[3], ":")[0], "the tool's own NVML first")
			assert.Equal(t, []string{fr.tool, "-L"}, cmd.Args[4:])
			out, err := cmd.CombinedOutput()
			require.NoError(t, err, "%s", out)
			assert.Equal(t, "argv[0]="+fr.tool+"\nargv[1]=-L\n", string(out))

			// The path Find returned, as the plugin passes it on.
			cmd, err = r.Command(context.Background(), p, "-L")
			require.NoError(t, err)
			assert.Equal(t, fr.loader, cmd.Path)
		})
	}
}

// The tool search order: ToolDirs in their order, an ELF binary before a
// script found earlier, a script when there is no binary; a tool's own
// install's NVML before the first of LibraryDirs.
func TestToolSearchOrder(t *testing.T) {
	elfTool := func(root, rel string) string {
		p := filepath.Join(root, rel)
		writeELF(t, p, "/lib64/ld-linux-x86-64.so.2", elf.EM_X86_64)
		return p
	}
	script := func(root, rel string) string {
		p := filepath.Join(root, rel)
		require.NoError(t, os.MkdirAll(filepath.Dir(p), 0o755))
		require.NoError(t, os.WriteFile(p, []byte("#!/bin/sh\nexec /usr/local/nvidia/bin/x \"$@\"\n"), 0o755))
		return p
	}
	t.Run("every directory in order", func(t *testing.T) {
		root := t.TempDir()
		var want []string
		for _, d := range ToolDirs {
			want = append(want, elfTool(root, path.Join(d, "x")))
		}
		for _, w := range want {
			p, err := Runner{Root: root}.Find("x")
			require.NoError(t, err)
			assert.Equal(t, w, p)
			require.NoError(t, os.Remove(w))
		}
		_, err := Runner{Root: root}.Find("x")
		assert.ErrorIs(t, err, os.ErrNotExist)
	})
	t.Run("a binary before a wrapper script", func(t *testing.T) {
		root := t.TempDir()
		script(root, "usr/bin/x")
		bin := elfTool(root, "usr/local/nvidia/bin/x")
		p, err := Runner{Root: root}.Find("x")
		require.NoError(t, err)
		assert.Equal(t, bin, p)
	})
	t.Run("a script when there is no binary", func(t *testing.T) {
		root := t.TempDir()
		first := script(root, "usr/bin/x")
		script(root, "usr/sbin/x")
		p, err := Runner{Root: root}.Find("x")
		require.NoError(t, err)
		assert.Equal(t, first, p)
	})
	t.Run("the tool's own install's NVML first", func(t *testing.T) {
		root := rhelLikeRoot(t) // NVML in usr/lib64
		elfTool(root, "usr/local/nvidia/bin/x")
		mkfile(t, filepath.Join(root, "usr/local/nvidia/lib64", NVMLLibrary))
		cmd, err := Runner{Root: root}.Command(context.Background(), "x")
		require.NoError(t, err)
		assert.Equal(t, filepath.Join(root, "usr/local/nvidia/lib64")+":"+filepath.Join(root, "usr/lib64")+":"+filepath.Join(root, "usr/lib"), cmd.Args[3])
		cmd, err = Runner{Root: root}.Command(context.Background(), "nvidia-smi")
		require.NoError(t, err)
		assert.Equal(t, filepath.Join(root, "usr/lib64")+":"+filepath.Join(root, "usr/lib"), cmd.Args[3], "usr/bin's tool: usr/lib64's")
	})
	t.Run("usr/local/nvidia's NVML without a tool beside it", func(t *testing.T) {
		root := rhelLikeRoot(t)
		require.NoError(t, os.Remove(filepath.Join(root, "usr/lib64/libnvidia-ml.so.1")))
		mkfile(t, filepath.Join(root, "usr/local/nvidia/lib", NVMLLibrary))
		cmd, err := Runner{Root: root}.Command(context.Background(), "nvidia-smi")
		require.NoError(t, err)
		assert.Equal(t, filepath.Join(root, "usr/local/nvidia/lib")+":"+filepath.Join(root, "usr/lib64")+":"+filepath.Join(root, "usr/lib"), cmd.Args[3])
	})
}

func TestStaticToolRunsDirectly(t *testing.T) {
	fr := newFakeRoot(t)
	static := filepath.Join(fr.root, "usr/bin/nvidia-static")
	if compile(t, static, toolSource, `-DROOT="`+fr.root+`"`, "-static") != nil {
		t.Skip("gcc cannot link statically here (no libc.a)")
	}
	t.Setenv("LD_LIBRARY_PATH", fr.libDir)
	cmd, err := Runner{Root: fr.root}.Command(context.Background(), "nvidia-static", "a")
	require.NoError(t, err)
	assert.Equal(t, []string{static, "a"}, cmd.Args, "no loader for a static tool")
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "%s", out)
	assert.Equal(t, "argv[0]="+static+"\nargv[1]=a\n", string(out))
}

// writeELF writes a minimal 64-bit ELF file: with a PT_INTERP naming
// interp, or statically linked (a PT_LOAD only) when interp is empty.
func writeELF(t *testing.T, path, interp string, machine elf.Machine) {
	t.Helper()
	var buf bytes.Buffer
	hdr := elf.Header64{Type: uint16(elf.ET_EXEC), Machine: uint16(machine), Version: uint32(elf.EV_CURRENT),
		Phoff: 64, Ehsize: 64, Phentsize: 56, Phnum: 1, Shentsize: 64}
	copy(hdr.Ident[:], elf.ELFMAG)
	hdr.Ident[elf.EI_CLASS], hdr.Ident[elf.EI_DATA], hdr.Ident[elf.EI_VERSION] = byte(elf.ELFCLASS64), byte(elf.ELFDATA2LSB), byte(elf.EV_CURRENT)
	prog := elf.Prog64{Type: uint32(elf.PT_LOAD), Flags: uint32(elf.PF_R | elf.PF_X), Align: 0x1000}
	if interp != "" {
		prog = elf.Prog64{Type: uint32(elf.PT_INTERP), Flags: uint32(elf.PF_R), Off: 64 + 56, Filesz: uint64(len(interp) + 1), Memsz: uint64(len(interp) + 1), Align: 1}
	}
	require.NoError(t, binary.Write(&buf, binary.LittleEndian, hdr))
	require.NoError(t, binary.Write(&buf, binary.LittleEndian, prog))
	buf.WriteString(interp + "\x00")
	require.NoError(t, os.MkdirAll(filepath.Dir(path), 0o755))
	require.NoError(t, os.WriteFile(path, buf.Bytes(), 0o755))
}

func mkfile(t *testing.T, path string) {
	t.Helper()
	require.NoError(t, os.MkdirAll(filepath.Dir(path), 0o755))
	require.NoError(t, os.WriteFile(path, []byte("x"), 0o755))
}

func symlink(t *testing.T, target, link string) {
	t.Helper()
	require.NoError(t, os.MkdirAll(filepath.Dir(link), 0o755))
	require.NoError(t, os.Symlink(target, link))
}

// rhelLikeRoot is a merged-/usr root whose links are absolute (as in a
// driver container): lib64 -> /usr/lib64, lib -> /usr/lib, and the
// loader's name an absolute link too. Followed in this container, every one
// of these would leave the root.
func rhelLikeRoot(t *testing.T) string {
	root := t.TempDir()
	writeELF(t, filepath.Join(root, "usr/bin/nvidia-smi"), "/lib64/ld-linux-x86-64.so.2", elf.EM_X86_64)
	symlink(t, "/usr/lib64", filepath.Join(root, "lib64"))
	symlink(t, "/usr/lib", filepath.Join(root, "lib"))
	mkfile(t, filepath.Join(root, "usr/lib64/ld-2.34.so"))
	symlink(t, "/lib64/ld-2.34.so", filepath.Join(root, "usr/lib64/ld-linux-x86-64.so.2"))
	mkfile(t, filepath.Join(root, "usr/lib64/libc.so.6"))
	mkfile(t, filepath.Join(root, "usr/lib64/libnvidia-ml.so.550.54.15"))
	symlink(t, "libnvidia-ml.so.550.54.15", filepath.Join(root, "usr/lib64/libnvidia-ml.so.1"))
	require.NoError(t, os.MkdirAll(filepath.Join(root, "usr/lib"), 0o755))
	return root
}

func TestLoaderFoundThroughAbsoluteLinksInsideTheRoot(t *testing.T) {
	root := rhelLikeRoot(t)
	cmd, err := Runner{Root: root}.Command(context.Background(), "nvidia-smi", "-L")
	require.NoError(t, err)
	// lib64 and usr/lib64 are one directory, and so are lib and usr/lib:
	// each comes once. There is no lib/x86_64-linux-gnu.
	assert.Equal(t, []string{filepath.Join(root, "usr/lib64/ld-2.34.so"), "--inhibit-cache", "--library-path",
		filepath.Join(root, "usr/lib64") + ":" + filepath.Join(root, "usr/lib"),
		filepath.Join(root, "usr/bin/nvidia-smi"), "-L"}, cmd.Args)
}

func TestResolveInRoot(t *testing.T) {
	root := rhelLikeRoot(t)
	symlink(t, "../../../../../../../usr/lib64/libc.so.6", filepath.Join(root, "usr/lib64/up"))
	symlink(t, "loop2", filepath.Join(root, "loop1"))
	symlink(t, "/loop1", filepath.Join(root, "loop2"))
	for name, want := range map[string]string{
		"/lib64/ld-linux-x86-64.so.2":           "usr/lib64/ld-2.34.so",
		"lib64/../lib64/libc.so.6":              "usr/lib64/libc.so.6",
		"/lib/../../../lib64/libnvidia-ml.so.1": "usr/lib64/libnvidia-ml.so.550.54.15",
		"usr/lib64/up":                          "usr/lib64/libc.so.6", // ".." stops at the root
	} {
		got, err := resolveInRoot(root, name)
		require.NoError(t, err, name)
		assert.Equal(t, filepath.Join(root, want), got, name)
	}
	_, err := resolveInRoot(root, "loop1")
	assert.ErrorContains(t, err, "too many levels of symbolic links")
	_, err = resolveInRoot(root, "/lib64/missing.so")
	assert.ErrorIs(t, err, os.ErrNotExist)
}

func TestRootSlashRunsDirectly(t *testing.T) {
	dir := t.TempDir()
	tool := filepath.Join(dir, "nvidia-smi")
	writeELF(t, tool, "/lib64/ld-linux-x86-64.so.2", elf.EM_X86_64)
	for _, r := range []Runner{{Root: "/"}, {Root: ""}, {Root: "//"}} {
		cmd, err := r.Command(context.Background(), tool, "-q")
		require.NoError(t, err, r.Root)
		assert.Equal(t, []string{tool, "-q"}, cmd.Args, "root %q", r.Root)
		assert.Equal(t, tool, cmd.Path)
	}
}

func TestStaticAndScriptToolsRunDirectly(t *testing.T) {
	root := rhelLikeRoot(t)
	writeELF(t, filepath.Join(root, "usr/bin/nvidia-static"), "", elf.EM_X86_64)
	require.NoError(t, os.WriteFile(filepath.Join(root, "usr/bin/nvidia-script"), []byte("#!/bin/sh\necho hi\n"), 0o755))
	for _, tool := range []string{"nvidia-static", "nvidia-script"} {
		cmd, err := Runner{Root: root}.Command(context.Background(), tool, "a")
		require.NoError(t, err, tool)
		assert.Equal(t, []string{filepath.Join(root, "usr/bin", tool), "a"}, cmd.Args, tool)
	}
}

func TestBinaryOutsideTheRootRunsDirectly(t *testing.T) {
	root := rhelLikeRoot(t)
	standIn := filepath.Join(t.TempDir(), "fake-nvidia-cuda-mps-control")
	writeELF(t, standIn, "/lib64/ld-linux-x86-64.so.2", elf.EM_X86_64)
	r := Runner{Root: root}
	p, ok := r.Path(standIn)
	assert.True(t, ok)
	assert.Equal(t, standIn, p)
	cmd, err := r.Command(context.Background(), standIn, "-f")
	require.NoError(t, err)
	assert.Equal(t, []string{standIn, "-f"}, cmd.Args, "not the root's binary: not the root's loader")
}

func TestMissingToolNamesThePath(t *testing.T) {
	root := rhelLikeRoot(t)
	r := Runner{Root: root}
	_, ok := r.Path("nvidia-cuda-mps-control")
	assert.False(t, ok)
	_, err := r.Command(context.Background(), "nvidia-cuda-mps-control")
	require.Error(t, err)
	assert.Contains(t, err.Error(), "driver tool nvidia-cuda-mps-control: not found under driver root "+root+": looked at ")
	for _, d := range ToolDirs {
		assert.Contains(t, err.Error(), filepath.Join(root, d, "nvidia-cuda-mps-control"), "every place looked at")
	}
	assert.ErrorIs(t, err, os.ErrNotExist)

	_, err = r.Command(context.Background(), "/opt/bin/nvidia-smi")
	require.Error(t, err)
	assert.Contains(t, err.Error(), "not found at "+filepath.Join(root, "opt/bin/nvidia-smi"))
	assert.Contains(t, err.Error(), "nor at /opt/bin/nvidia-smi")
	assert.ErrorIs(t, err, os.ErrNotExist)

	_, err = r.Command(context.Background(), "")
	assert.Error(t, err)
}

func TestMissingLoaderIsAnError(t *testing.T) {
	root := rhelLikeRoot(t)
	writeELF(t, filepath.Join(root, "usr/bin/nvidia-arm"), "/lib/ld-linux-aarch64.so.1", elf.EM_AARCH64)
	_, err := Runner{Root: root}.Command(context.Background(), "nvidia-arm")
	require.Error(t, err)
	assert.Contains(t, err.Error(), "its loader /lib/ld-linux-aarch64.so.1 is not under driver root "+root)
}

func TestLibraryPathPutsNVMLFirst(t *testing.T) {
	root := t.TempDir()
	writeELF(t, filepath.Join(root, "usr/bin/nvidia-smi"), "/lib64/ld-linux-x86-64.so.2", elf.EM_X86_64)
	mkfile(t, filepath.Join(root, "lib/x86_64-linux-gnu/ld-linux-x86-64.so.2"))
	symlink(t, "/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2", filepath.Join(root, "lib64/ld-linux-x86-64.so.2"))
	mkfile(t, filepath.Join(root, "usr/lib/x86_64-linux-gnu/nvidia/current/libnvidia-ml.so.1"))
	require.NoError(t, os.MkdirAll(filepath.Join(root, "usr/lib/x86_64-linux-gnu"), 0o755))
	require.NoError(t, os.MkdirAll(filepath.Join(root, "usr/lib/aarch64-linux-gnu"), 0o755))
	cmd, err := Runner{Root: root}.Command(context.Background(), "nvidia-smi")
	require.NoError(t, err)
	i := slices.Index(cmd.Args, "--library-path")
	require.GreaterOrEqual(t, i, 0)
	assert.Equal(t, strings.Join([]string{
		filepath.Join(root, "usr/lib/x86_64-linux-gnu/nvidia/current"),
		filepath.Join(root, "lib/x86_64-linux-gnu"),
		filepath.Join(root, "usr/lib/x86_64-linux-gnu"),
		filepath.Join(root, "lib64"),
		filepath.Join(root, "lib"),
		filepath.Join(root, "usr/lib"),
	}, ":"), cmd.Args[i+1], "NVML's directory first, then the x86_64 ones that exist, no aarch64 one")
}

func TestEnvironmentStripsLoaderVariables(t *testing.T) {
	t.Setenv("LD_LIBRARY_PATH", "/driver-root/usr/lib64")
	t.Setenv("LD_PRELOAD", "/x.so")
	t.Setenv("DRIVERTOOLS_KEEP", "1")
	env := environ()
	assert.Contains(t, env, "DRIVERTOOLS_KEEP=1")
	for _, kv := range env {
		assert.NotRegexp(t, "^LD_(LIBRARY_PATH|PRELOAD)=", kv)
	}
}

// A tool's children get its directory on PATH, and LD_LIBRARY_PATH only
// where the driver's libraries are in a directory of their own: never a
// system directory holding a libc.
func TestChildEnv(t *testing.T) {
	for _, tc := range []struct {
		name, bin, lib string
		libc           bool
		wantLib        bool
	}{
		{"/usr/local/nvidia", "usr/local/nvidia/bin", "usr/local/nvidia/lib64", false, true},
		{"Debian packages", "usr/bin", "usr/lib/x86_64-linux-gnu", true, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			root := t.TempDir()
			for _, d := range []string{tc.bin, tc.lib} {
				require.NoError(t, os.MkdirAll(filepath.Join(root, d), 0o755))
			}
			tool := filepath.Join(root, tc.bin, "nvidia-cuda-mps-control")
			require.NoError(t, os.WriteFile(tool, []byte("#!/bin/sh\n"), 0o755))
			require.NoError(t, os.WriteFile(filepath.Join(root, tc.lib, NVMLLibrary), nil, 0o644))
			if tc.libc {
				require.NoError(t, os.WriteFile(filepath.Join(root, tc.lib, "libc.so.6"), nil, 0o644))
			}
			env := Runner{Root: root}.ChildEnv(tool)
			require.NotEmpty(t, env)
			assert.True(t, strings.HasPrefix(env[0], "PATH="+filepath.Join(root, tc.bin)+":"), "%v", env)
			hasLib := slices.Contains(env, "LD_LIBRARY_PATH="+filepath.Join(root, tc.lib))
			assert.Equal(t, tc.wantLib, hasLib, "%v", env)
			for _, e := range env {
				if tc.libc {
					assert.False(t, strings.HasPrefix(e, "LD_LIBRARY_PATH="), "a system directory is never put on LD_LIBRARY_PATH: %v", env)
				}
			}
		})
	}
}
