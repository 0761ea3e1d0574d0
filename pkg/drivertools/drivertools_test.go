package drivertools

import (
	"bytes"
	"context"
	"debug/elf"
	"encoding/binary"
	"os"
	"os/exec"
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
	t.Helper()
	if runtime.GOOS != "linux" {
		t.Skip("needs Linux and glibc's ld.so")
	}
	if _, err := exec.LookPath("gcc"); err != nil {
		t.Skip("gcc is not installed: it builds the fake driver tool")
	}
	root, err := filepath.EvalSymlinks(t.TempDir())
	require.NoError(t, err)
	multiarch, err := exec.Command("gcc", "-print-multiarch").Output()
	require.NoError(t, err)
	lib := filepath.Join("lib", strings.TrimSpace(string(multiarch)))
	require.NoError(t, os.MkdirAll(filepath.Join(root, lib), 0o755))
	require.NoError(t, os.MkdirAll(filepath.Join(root, "usr/bin"), 0o755))

	tool := filepath.Join(root, "usr/bin/nvidia-smi")
	require.NoError(t, compile(t, tool, toolSource, `-DROOT="`+root+`"`))
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
	loader := filepath.Join(root, lib, "ld-root.so")
	copyFile(t, hostLoader, loader, 0o755)
	copyFile(t, hostLibc, filepath.Join(root, lib, "libc.so.6"), 0o755)
	require.NoError(t, os.WriteFile(filepath.Join(root, lib, NVMLLibrary), []byte("not a library: the tool does not load it"), 0o644))
	require.NoError(t, os.MkdirAll(filepath.Join(root, filepath.Dir(interp)), 0o755))
	require.NoError(t, os.Symlink("/"+lib+"/ld-root.so", filepath.Join(root, interp)))
	return fakeRoot{root: root, libDir: filepath.Join(root, lib), loader: loader,
		libraryPath: strings.Join([]string{filepath.Join(root, lib), filepath.Join(root, "lib64"), filepath.Join(root, "lib")}, ":")}
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
	assert.Contains(t, err.Error(), "driver tool nvidia-cuda-mps-control: not found at "+filepath.Join(root, "usr/bin/nvidia-cuda-mps-control"))
	assert.ErrorIs(t, err, os.ErrNotExist)

	_, err = r.Command(context.Background(), "/opt/bin/nvidia-smi")
	require.Error(t, err)
	assert.Contains(t, err.Error(), "not found at "+filepath.Join(root, "opt/bin/nvidia-smi"))
	assert.Contains(t, err.Error(), "nor at /opt/bin/nvidia-smi")

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
