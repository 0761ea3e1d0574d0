package nvdevice

import "context"

// DriverFiler discovers the driver's user-space files (libraries,
// binaries, firmware, IPC sockets) that a container needs to use a GPU, and
// the hooks that let it find them. The plugin puts them in one common CDI
// spec per node that every prepared device references.
type DriverFiler interface {
	// DriverFiles discovers the files anew at each call (the plugin calls
	// it at start and then now and again, to notice a driver upgrade). A
	// backend with no driver root returns an error wrapping ErrNotFound.
	DriverFiles(ctx context.Context) (DriverFiles, error)
}

// DriverFiles is the driver's user-space side as a backend found it: what
// the NVIDIA container toolkit's nvcdi discovers in its "management" mode
// (pkg/nvcdi, GetCommonEdits), in plain types so that the model does not
// depend on the CDI library.
type DriverFiles struct {
	// Root is the driver root the files were found under, as this process
	// sees it: every HostPath starts with it.
	Root string
	// Version is the driver version the files belong to (the suffix of
	// libcuda.so.<version>).
	Version string
	Mounts  []DriverMount
	// Hooks are OCI createContainer hooks run by the toolkit's
	// nvidia-cdi-hook (update-ldcache, create-symlinks, ...); their Path is
	// left to the spec writer, which knows where the hook is on the host.
	Hooks []DriverHook
	// Env is what the hooks expect (NVIDIA_CTK_LIBCUDA_DIR).
	Env []string
}

// DriverMount is one file bind-mounted into containers.
type DriverMount struct {
	HostPath      string
	ContainerPath string
	Options       []string
}

// DriverHook is one nvidia-cdi-hook invocation; Args[0] is the program
// name, Args[1] the hook's subcommand.
type DriverHook struct {
	HookName string
	Args     []string
	Env      []string
}
