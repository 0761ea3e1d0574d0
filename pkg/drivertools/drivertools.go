// Package drivertools runs the NVIDIA driver's own tools (nvidia-smi,
// nvidia-cuda-mps-control) from a driver root: the host's filesystem (or a
// driver container's) mounted into the plugin's container.
//
// A tool of the driver root must not be run by this container's dynamic
// loader with the root's library directories on LD_LIBRARY_PATH: those
// directories hold the host's libc, and the container's loader meeting a
// foreign libc fails (an Ubuntu 22.04/24.04 or RHEL 9 host under a Debian
// image). Instead the tool runs through the root's own loader, the one its
// PT_INTERP names, resolved inside the root:
//
//	<root>/<interp> --inhibit-cache --library-path <root's library dirs> <root>/usr/bin/<tool> <args>
//
// so that the loader, libc and every other library come from the root, and
// neither this container's /etc/ld.so.cache nor LD_LIBRARY_PATH mixes the
// container's libraries in.
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

// nvmlDirs are where distributions, the .run installer and the GPU
// operator's driver container put the driver's libraries, inside the root.
var nvmlDirs = []string{
	"usr/lib64",
	"usr/lib/x86_64-linux-gnu",
	"usr/lib/aarch64-linux-gnu",
	"lib64",
	"lib/x86_64-linux-gnu",
	"lib/aarch64-linux-gnu",
	"usr/lib/x86_64-linux-gnu/nvidia/current", // Debian's nvidia-driver packages
	"usr/lib/aarch64-linux-gnu/nvidia/current",
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
//   - a name ("nvidia-smi"): usr/bin/<name> under the root;
//   - a relative path ("usr/bin/nvidia-smi"): under the root;
//   - an absolute path: a path already under the root
//     ("/driver-root/usr/bin/nvidia-smi"), else a path inside the root
//     ("/usr/bin/nvidia-smi" is <root>/usr/bin/nvidia-smi), else, when
//     nothing is there, a binary outside the root (a stand-in in tests),
//     which is run as it is.
func (r Runner) Path(tool string) (string, bool) {
	p, _, err := r.locate(tool)
	return p, err == nil
}

// Command builds the command that runs tool (see Path) with args.
//
// A tool of the root that is dynamically linked runs through the root's own
// loader with the root's library directories (see the package comment). A
// driver root of "/", a statically linked tool, a script and a binary
// outside the root run directly.
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
	root := r.root()
	argv := append([]string{p}, args...)
	if inRoot && root != "/" {
		if argv, err = r.loaderArgv(p, args); err != nil {
			return nil, err
		}
	}
	cmd := exec.CommandContext(ctx, argv[0], argv[1:]...)
	cmd.Env = append(environ(), r.Env...)
	return cmd, nil
}

// loaderArgv is the argv that runs the root's tool at p through the root's
// loader, or runs it directly when it has no loader (static, or not ELF).
func (r Runner) loaderArgv(p string, args []string) ([]string, error) {
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
	root := r.root()
	loader, err := resolveInRoot(root, interp)
	if err != nil {
		return nil, fmt.Errorf("%s: its loader %s is not under driver root %s: %w", p, interp, root, err)
	}
	if err := regular(loader); err != nil {
		return nil, fmt.Errorf("%s: its loader %s under driver root %s: %w", p, interp, root, err)
	}
	dirs := r.libraryPath(machine)
	for _, d := range dirs {
		// ld.so splits the list at ':' and ';' and expands '$'.
		if strings.ContainsAny(d, ":;$") {
			return nil, fmt.Errorf("%s: library directory %q has a character ld.so's --library-path cannot carry (':', ';' or '$')", p, d)
		}
	}
	return append([]string{loader, "--inhibit-cache", "--library-path", strings.Join(dirs, ":"), p}, args...), nil
}

// libraryPath returns the root's library directories that exist, as this
// process sees them: the directory of libnvidia-ml.so.1 first, then the
// system library directories for the machine (both x86_64's and aarch64's
// when machine is neither).
func (r Runner) libraryPath(machine elf.Machine) []string {
	root := r.root()
	var dirs []string
	seen := map[string]bool{}
	add := func(d string) {
		if !seen[d] {
			seen[d] = true
			dirs = append(dirs, d)
		}
	}
	for _, d := range nvmlDirs {
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
		rel = path.Join("usr/bin", tool)
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
		if p, err := resolveInRoot(root, tool); err == nil && regular(p) == nil {
			return p, true, nil
		}
		if err := regular(tool); err == nil {
			return tool, false, nil // a binary outside the driver root
		}
		return "", false, fmt.Errorf("driver tool %s: not found at %s (driver root %s) nor at %s", tool, filepath.Join(root, tool), root, tool)
	}
	p, err = resolveInRoot(root, rel)
	if err == nil {
		err = regular(p)
	}
	if err != nil {
		return "", false, fmt.Errorf("driver tool %s: not found at %s (driver root %s): %w", tool, filepath.Join(root, rel), root, err)
	}
	return p, true, nil
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
