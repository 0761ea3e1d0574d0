// Package drivertools runs the NVIDIA driver's own tools (nvidia-smi,
// nvidia-cuda-mps-control) from a driver root: the host's filesystem (or a
// driver container's) mounted into the plugin's container.
//
// A tool named by its name alone is looked for in ToolDirs under the root,
// in their order, and its libraries in LibraryDirs (see Runner.Path): the
// one list of where drivers are installed, for tools and libraries alike.
//
// A tool of the driver root must not be run by this container's dynamic
// loader with the root's library directories on LD_LIBRARY_PATH: those
// directories hold the host's libc, and the container's loader meeting a
// foreign libc fails (an Ubuntu 22.04/24.04 or RHEL 9 host under a Debian
// image). Instead the tool runs through the root's own loader, the one its
// PT_INTERP names, resolved inside the root:
//
//	<root>/<interp> --inhibit-cache --library-path <root's library dirs> <root>/<tool dir>/<tool> <args>
//
// so that the loader, libc and every other library come from the root, and
// neither this container's /etc/ld.so.cache nor LD_LIBRARY_PATH mixes the
// container's libraries in. A tool in a driver container's root inside the
// driver root (run/nvidia/driver) runs through that root's loader and
// libraries.
package drivertools

import (
	"bytes"
	"context"
	"debug/elf"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"strings"
)

// NVMLLibrary is the library every driver install ships; its directory is
// the first of the library path.
const NVMLLibrary = "libnvidia-ml.so.1"

// ToolDirs are where a driver tool named by its name alone is looked for,
// inside the driver root, in this order:
//   - usr/bin: distributions' packages and the .run installer;
//   - usr/local/nvidia/bin: a driver installed read-only under
//     /usr/local/nvidia (cloud GPU images; the H100 and H200 hosts of
//     ../shared/real-gpus, where usr/bin holds only wrapper scripts);
//   - bin and usr/sbin: the rest of the system's;
//   - run/nvidia/driver/usr/bin: the GPU operator's driver container,
//     mounted at /run/nvidia/driver of a host whose root is the driver root
//     (the tool then runs with that container's loader and libraries).
//
// The first ELF binary found wins; a script (such as a wrapper in usr/bin
// that execs /usr/local/nvidia/bin/<tool>) only when no directory has a
// binary: a wrapper's absolute paths name the host's filesystem, not the
// root as this process sees it.
var ToolDirs = []string{
	"usr/bin",
	"usr/local/nvidia/bin",
	"bin",
	"usr/sbin",
	DriverContainerRoot + "/usr/bin",
}

// DriverContainerRoot is where the GPU operator's driver container has its
// root, inside a host's root.
const DriverContainerRoot = "run/nvidia/driver"

// LibraryDirs are where distributions, the .run installer, a
// /usr/local/nvidia install and the GPU operator's driver container put
// the driver's libraries (NVMLLibrary), inside the root, in the order they
// are searched. A tool's own install comes first: the lib64 or lib beside
// its bin directory when NVMLLibrary is there.
var LibraryDirs = []string{
	"usr/lib64",
	"usr/lib/x86_64-linux-gnu",
	"usr/lib/aarch64-linux-gnu",
	"lib64",
	"lib/x86_64-linux-gnu",
	"lib/aarch64-linux-gnu",
	"usr/lib/x86_64-linux-gnu/nvidia/current", // Debian's nvidia-driver packages
	"usr/lib/aarch64-linux-gnu/nvidia/current",
	"usr/local/nvidia/lib64",
	"usr/local/nvidia/lib",
	"usr/lib",
	"lib",
}

// libraryDirs are the root's system library directories, by the tool's
// machine, in the order they are searched after NVML's directory.
var libraryDirs = map[elf.Machine][]string{
	elf.EM_X86_64:  {"lib/x86_64-linux-gnu", "usr/lib/x86_64-linux-gnu", "lib64", "usr/lib64", "lib", "usr/lib"},
	elf.EM_AARCH64: {"lib/aarch64-linux-gnu", "usr/lib/aarch64-linux-gnu", "lib64", "usr/lib64", "lib", "usr/lib"},
}

// maxLinks bounds the symbolic links followed in one resolution, as the
// kernel's 40.
const maxLinks = 40

// stripped are environment variables a tool run from the root must not
// inherit: they would load this container's libraries into it (or, for a
// tool the root's loader runs, into its children).
var stripped = []string{"LD_LIBRARY_PATH", "LD_PRELOAD"}

// Runner runs driver tools from a driver root.
type Runner struct {
	// Root is where the driver is installed, as this process sees it: "/"
	// (or empty) when the driver is installed in this process's own
	// filesystem, "/driver-root" where the Helm chart mounts the host's.
	Root string
	// Env is added to every tool's environment (after the stripped
	// variables are removed): for example a marker that tells whose
	// container started a process.
	Env []string
}

// root is the clean driver root, "/" when empty.
func (r Runner) root() string {
	if r.Root == "" {
		return "/"
	}
	return filepath.Clean(r.Root)
}

// Path returns the path, as this process sees it, of the tool that Command
// would run, with every symbolic link under the root followed inside the
// root, and whether it is there (a regular file).
//
// tool is one of:
//   - a name ("nvidia-smi"): looked for in ToolDirs under the root, in
//     their order: the first ELF binary, else the first script;
//   - a relative path ("usr/bin/nvidia-smi"): under the root;
//   - an absolute path: a path already under the root
//     ("/driver-root/usr/bin/nvidia-smi"), else a path inside the root
//     ("/usr/bin/nvidia-smi" is <root>/usr/bin/nvidia-smi), else, when
//     nothing is there, a binary outside the root (a stand-in in tests),
//     which is run as it is.
func (r Runner) Path(tool string) (string, bool) {
	p, err := r.Find(tool)
	return p, err == nil
}

// Find is Path with the reason a tool is not there: its error names every
// place looked at (wrapping os.ErrNotExist when nothing was there).
func (r Runner) Find(tool string) (string, error) {
	p, _, err := r.locate(tool)
	return p, err
}

// Command builds the command that runs tool (see Path) with args.
//
// A tool of the root that is dynamically linked runs through the root's own
// loader with the root's library directories (see the package comment). A
// driver root of "/", a statically linked tool, a script and a binary
// outside the root run directly; a tool in the driver container's root
// (DriverContainerRoot) under a root of "/" runs through that root's loader.
//
// cmd.Env is this process's environment without LD_LIBRARY_PATH and
// LD_PRELOAD: append to it, do not replace it, and do not add them back.
// The command's Args[0] may be the loader; the tool itself still sees its
// own path as argv[0] (the loader passes the program's path on).
func (r Runner) Command(ctx context.Context, tool string, args ...string) (*exec.Cmd, error) {
	p, inRoot, err := r.locate(tool)
	if err != nil {
		return nil, err
	}
	argv := append([]string{p}, args...)
	if inRoot {
		if root := r.rootOf(p); root != "/" {
			if argv, err = loaderArgv(root, p, args); err != nil {
				return nil, err
			}
		}
	}
	cmd := exec.CommandContext(ctx, argv[0], argv[1:]...)
	cmd.Env = append(environ(), r.Env...)
	return cmd, nil
}

// rootOf is the root whose loader and libraries run the root's tool at p:
// the driver container's root inside the driver root when p is in it, else
// the driver root.
func (r Runner) rootOf(p string) string {
	root := r.root()
	if dc, err := resolveInRoot(root, DriverContainerRoot); err == nil && strings.HasPrefix(p, dc+string(filepath.Separator)) {
		return dc
	}
	return root
}

// loaderArgv is the argv that runs the tool at p, of root, through root's
// loader, or runs it directly when it has no loader (static, or not ELF).
func loaderArgv(root, p string, args []string) ([]string, error) {
	direct := append([]string{p}, args...)
	interp, machine, err := readInterp(p)
	if err != nil {
		if errors.Is(err, errNotELF) {
			return direct, nil // a script: the kernel runs its interpreter
		}
		return nil, err
	}
	if interp == "" {
		return direct, nil // statically linked
	}
	loader, err := resolveInRoot(root, interp)
	if err != nil {
		return nil, fmt.Errorf("%s: its loader %s is not under driver root %s: %w", p, interp, root, err)
	}
	if err := regular(loader); err != nil {
		return nil, fmt.Errorf("%s: its loader %s under driver root %s: %w", p, interp, root, err)
	}
	dirs := libraryPath(root, p, machine)
	for _, d := range dirs {
		// ld.so splits the list at ':' and ';' and expands '$'.
		if strings.ContainsAny(d, ":;$") {
			return nil, fmt.Errorf("%s: library directory %q has a character ld.so's --library-path cannot carry (':', ';' or '$')", p, d)
		}
	}
	return append([]string{loader, "--inhibit-cache", "--library-path", strings.Join(dirs, ":"), p}, args...), nil
}

// libraryPath returns root's library directories that exist, as this
// process sees them, for its tool at p: the directory of libnvidia-ml.so.1
// first (the tool's own install's, beside its bin directory, else the
// first of LibraryDirs that has it), then the system library directories
// for the machine (both x86_64's and aarch64's when machine is neither).
func libraryPath(root, p string, machine elf.Machine) []string {
	var dirs []string
	seen := map[string]bool{}
	add := func(d string) {
		if !seen[d] {
			seen[d] = true
			dirs = append(dirs, d)
		}
	}
	nvml := LibraryDirs
	if rel, err := filepath.Rel(root, filepath.Dir(p)); err == nil && !strings.HasPrefix(rel, "..") {
		if b := filepath.Base(rel); b == "bin" || b == "sbin" {
			install := path.Dir(filepath.ToSlash(rel))
			nvml = append([]string{path.Join(install, "lib64"), path.Join(install, "lib")}, LibraryDirs...)
		}
	}
	for _, d := range nvml {
		if lib, err := resolveInRoot(root, path.Join(d, NVMLLibrary)); err == nil && regular(lib) == nil {
			add(filepath.Dir(lib))
			break
		}
	}
	candidates, ok := libraryDirs[machine]
	if !ok {
		candidates = append(append([]string{}, libraryDirs[elf.EM_X86_64]...), libraryDirs[elf.EM_AARCH64]...)
	}
	for _, d := range candidates {
		p, err := resolveInRoot(root, d)
		if err != nil {
			continue
		}
		if fi, err := os.Stat(p); err == nil && fi.IsDir() {
			add(p)
		}
	}
	return dirs
}

// locate finds tool (see Path). inRoot says it belongs to the driver root
// (and runs through the root's loader); an error names what was looked at.
func (r Runner) locate(tool string) (p string, inRoot bool, err error) {
	root := r.root()
	var rel string
	switch {
	case tool == "":
		return "", false, errors.New("driver tool: no name given")
	case !strings.Contains(tool, "/"):
		p, err := r.search(tool)
		return p, err == nil, err
	case !filepath.IsAbs(tool):
		rel = tool
	case root == "/":
		rel = tool
	default:
		tool = filepath.Clean(tool)
		if in, err := filepath.Rel(root, tool); err == nil && in != ".." && !strings.HasPrefix(in, "../") {
			rel = in // already a path under the root
			break
		}
		if p, err := r.resolve(tool); err == nil && regular(p) == nil {
			return p, true, nil
		}
		if err := regular(tool); err == nil {
			return tool, false, nil // a binary outside the driver root
		}
		return "", false, fmt.Errorf("driver tool %s: not found at %s (driver root %s) nor at %s: %w", tool, filepath.Join(root, tool), root, tool, os.ErrNotExist)
	}
	p, err = r.resolve(rel)
	if err == nil {
		err = regular(p)
	}
	if err != nil {
		return "", false, fmt.Errorf("driver tool %s: not found at %s (driver root %s): %w", tool, filepath.Join(root, rel), root, err)
	}
	return p, true, nil
}

// search looks for the tool named name in ToolDirs under the root: the
// first ELF binary, else the first script. Its error names every place
// looked at.
func (r Runner) search(name string) (string, error) {
	root := r.root()
	looked := make([]string, 0, len(ToolDirs))
	script := ""
	for _, d := range ToolDirs {
		rel := path.Join(d, name)
		looked = append(looked, filepath.Join(root, rel))
		p, err := r.resolve(rel)
		if err != nil || regular(p) != nil {
			continue
		}
		if isELF(p) {
			return p, nil
		}
		if script == "" {
			script = p
		}
	}
	if script != "" {
		return script, nil
	}
	return "", fmt.Errorf("driver tool %s: not found under driver root %s: looked at %s: %w", name, root, strings.Join(looked, ", "), os.ErrNotExist)
}

// resolve is resolveInRoot for a path inside the driver root; a path into
// the driver container's root (DriverContainerRoot) is resolved inside
// that root, whose absolute links name its own files.
func (r Runner) resolve(name string) (string, error) {
	root := r.root()
	clean := strings.TrimPrefix(path.Clean("/"+filepath.ToSlash(name)), "/")
	if rest, ok := strings.CutPrefix(clean, DriverContainerRoot+"/"); ok {
		dc, err := resolveInRoot(root, DriverContainerRoot)
		if err != nil {
			return "", err
		}
		return resolveInRoot(dc, rest)
	}
	return resolveInRoot(root, name)
}

// isELF says whether the file at p starts with ELF's magic number.
func isELF(p string) bool {
	f, err := os.Open(p)
	if err != nil {
		return false
	}
	defer f.Close()
	var magic [4]byte
	_, err = io.ReadFull(f, magic[:])
	return err == nil && string(magic[:]) == elf.ELFMAG
}

// regular says whether p is a regular file.
func regular(p string) error {
	fi, err := os.Stat(p)
	if err != nil {
		return err
	}
	if !fi.Mode().IsRegular() {
		return fmt.Errorf("%s is not a regular file", p)
	}
	return nil
}

var errNotELF = errors.New("not an ELF file")

// readInterp returns the ELF file's PT_INTERP ("" when statically linked)
// and machine; errNotELF when p is not ELF (a script).
func readInterp(p string) (string, elf.Machine, error) {
	f, err := os.Open(p)
	if err != nil {
		return "", 0, err
	}
	defer f.Close()
	var magic [4]byte
	if _, err := io.ReadFull(f, magic[:]); err != nil || string(magic[:]) != elf.ELFMAG {
		return "", 0, errNotELF
	}
	ef, err := elf.NewFile(f)
	if err != nil {
		return "", 0, fmt.Errorf("%s: %w", p, err)
	}
	for _, prog := range ef.Progs {
		if prog.Type != elf.PT_INTERP {
			continue
		}
		data, err := io.ReadAll(prog.Open())
		if err != nil {
			return "", 0, fmt.Errorf("%s: reading PT_INTERP: %w", p, err)
		}
		interp := string(bytes.TrimRight(data, "\x00"))
		if interp == "" {
			return "", 0, fmt.Errorf("%s: empty PT_INTERP", p)
		}
		return interp, ef.Machine, nil
	}
	return "", ef.Machine, nil
}

// resolveInRoot returns the path, as this process sees it, that name (a
// path inside root, absolute or not) names when every symbolic link on the
// way is followed inside root, as it would be after chroot(root): an
// absolute link target starts again at root, and ".." stops at root. The
// last component must exist; its type is not checked.
func resolveInRoot(root, name string) (string, error) {
	resolved := "" // inside root, "" or "/a/b", no links in it
	rest := name
	links := 0
	for rest != "" {
		var part string
		part, rest, _ = strings.Cut(rest, "/")
		switch part {
		case "", ".":
			continue
		case "..":
			if resolved = path.Dir(resolved); resolved == "/" || resolved == "." {
				resolved = ""
			}
			continue
		}
		next := resolved + "/" + part
		host := filepath.Join(root, next)
		fi, err := os.Lstat(host)
		if err != nil {
			return "", err
		}
		if fi.Mode()&os.ModeSymlink == 0 {
			resolved = next
			continue
		}
		if links++; links > maxLinks {
			return "", fmt.Errorf("%s under %s: too many levels of symbolic links", name, root)
		}
		target, err := os.Readlink(host)
		if err != nil {
			return "", err
		}
		if strings.HasPrefix(target, "/") {
			resolved = ""
		}
		if rest != "" {
			target += "/" + rest
		}
		rest = target
	}
	return filepath.Join(root, resolved), nil
}

// environ is this process's environment without the stripped variables.
func environ() []string {
	env := os.Environ()
	out := env[:0:0]
	for _, kv := range env {
		name, _, _ := strings.Cut(kv, "=")
		keep := true
		for _, s := range stripped {
			if name == s {
				keep = false
			}
		}
		if keep {
			out = append(out, kv)
		}
	}
	return out
}

// ChildEnv is what a driver tool at p (as Find returns it) needs in its
// environment for the driver programs it starts by name itself (the MPS
// control daemon starts nvidia-cuda-mps-server): PATH with p's directory
// first, and, where the root's NVIDIA libraries are in a directory of their
// own (/usr/local/nvidia/lib64; not a system directory with a libc in it),
// LD_LIBRARY_PATH naming it, since such a child runs through the
// container's loader, which does not know that directory. A system
// directory is never put there: it would mix the root's libc into this
// container's programs (see the package comment).
func (r Runner) ChildEnv(p string) []string {
	env := []string{"PATH=" + filepath.Dir(p) + string(os.PathListSeparator) + os.Getenv("PATH")}
	dirs := libraryPath(r.rootOf(p), p, elf.EM_X86_64)
	if len(dirs) == 0 {
		return env
	}
	lib := dirs[0]
	if _, err := os.Stat(filepath.Join(lib, NVMLLibrary)); err != nil {
		return env // no NVIDIA library directory at all
	}
	for _, libc := range []string{"libc.so.6", "ld-linux-x86-64.so.2", "ld-linux-aarch64.so.1"} {
		if _, err := os.Stat(filepath.Join(lib, libc)); err == nil {
			return env // a system directory
		}
	}
	return append(env, "LD_LIBRARY_PATH="+lib)
}
