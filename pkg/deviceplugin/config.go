package deviceplugin

import (
	"encoding/json"
	"errors"
	"fmt"
	"regexp"
	"strconv"
	"strings"

	"sigs.k8s.io/yaml"
)

// ConfigVersion is the only config version understood, as in NVIDIA's
// k8s-device-plugin.
const ConfigVersion = "v1"

// DefaultResourceDomain is prefixed to resource names given without a
// domain ("gpu", "mig-1g.10gb"), as NVIDIA's plugin does.
const DefaultResourceDomain = "nvidia.com"

// MIG strategies (flags.migStrategy), with NVIDIA's meanings.
const (
	// MigStrategyNone advertises every GPU as a whole GPU under the GPU
	// resource name, GPUs in MIG mode included (their MIG devices are not
	// advertised): the default, as in NVIDIA's plugin.
	MigStrategyNone = "none"
	// MigStrategySingle advertises the MIG devices under the GPU resource
	// name: every GPU in MIG mode with MIG devices of one profile, or no GPU
	// in MIG mode (then the whole GPUs are advertised). Any other node is
	// an error naming its GPUs and profiles.
	MigStrategySingle = "single"
	// MigStrategyMixed advertises one resource per MIG profile
	// (nvidia.com/mig-1g.10gb) beside the GPUs with MIG mode off.
	MigStrategyMixed = "mixed"
)

// Config is the device plugin's configuration file, in the shape of
// NVIDIA's k8s-device-plugin config (version v1). Only the fields below are
// known; any other field is an error naming it (documented differences).
//
//	version: v1
//	flags:
//	  migStrategy: none           # none (default) | single | mixed
//	  failOnInitError: true       # true only: gpudra always fails on an init error
//	  nvidiaDriverRoot: /         # the host root of the device nodes in DeviceSpecs
//	  nvidiaDevRoot: /            # the same, overriding nvidiaDriverRoot
//	  plugin:
//	    passDeviceSpecs: false    # accepted, either value (see DeviceListStrategies)
//	    deviceListStrategy: envvar   # or a list: envvar, volume-mounts, cdi-annotations, cdi-cri
//	    deviceIDStrategy: uuid    # uuid | index
//	    cdiAnnotationPrefix: cdi.k8s.io/
//	sharing:
//	  timeSlicing:
//	    renameByDefault: false
//	    failRequestsGreaterThanOne: false
//	    resources:
//	    - name: nvidia.com/gpu
//	      replicas: 4
//	      rename: nvidia.com/gpu.shared   # optional
//	      devices: all                    # optional: all | [index or UUID, ...]
//	  mps:
//	    resources:
//	    - name: nvidia.com/gpu
//	      replicas: 2
type Config struct {
	Version string  `json:"version"`
	Flags   Flags   `json:"flags,omitempty"`
	Sharing Sharing `json:"sharing,omitempty"`
}

// Flags are the plugin's flags that the config file may set.
type Flags struct {
	// MigStrategy is "none", "single" or "mixed"; empty means none.
	MigStrategy string `json:"migStrategy,omitempty"`
	// FailOnInitError may only be true (NVIDIA's default): gpudra always
	// fails on an init error and is restarted by the DaemonSet.
	FailOnInitError *bool `json:"failOnInitError,omitempty"`
	// NvidiaDriverRoot and NvidiaDevRoot are, as in NVIDIA's plugin, where
	// the device nodes are on the host: the prefix of the host paths of the
	// DeviceSpecs Allocate returns. NvidiaDevRoot defaults to
	// NvidiaDriverRoot, which defaults to "/". The driver's files are
	// found through --driver-root and --host-driver-root instead.
	NvidiaDriverRoot string `json:"nvidiaDriverRoot,omitempty"`
	NvidiaDevRoot    string `json:"nvidiaDevRoot,omitempty"`
	// Plugin holds the device plugin's own flags.
	Plugin *PluginFlags `json:"plugin,omitempty"`
}

// PluginFlags are flags.plugin: how Allocate hands the devices to the
// container runtime (strategy.go).
type PluginFlags struct {
	// PassDeviceSpecs is accepted with either value: gpudra passes the
	// device nodes whenever a non-CDI device list strategy is used, so that
	// a container gets its GPUs on a runtime without CDI or NVIDIA's hook.
	PassDeviceSpecs *bool `json:"passDeviceSpecs,omitempty"`
	// DeviceListStrategy is one strategy or a list; empty: envvar.
	DeviceListStrategy DeviceListStrategies `json:"deviceListStrategy,omitempty"`
	// DeviceIDStrategy is "uuid" (default) or "index": what
	// NVIDIA_VISIBLE_DEVICES and the volume-mounts paths name.
	DeviceIDStrategy string `json:"deviceIDStrategy,omitempty"`
	// CDIAnnotationPrefix replaces "cdi.k8s.io/" in the keys of the
	// cdi-annotations strategy.
	CDIAnnotationPrefix string `json:"cdiAnnotationPrefix,omitempty"`
}

// Sharing configures replicated resources.
type Sharing struct {
	TimeSlicing *ReplicatedResources `json:"timeSlicing,omitempty"`
	MPS         *ReplicatedResources `json:"mps,omitempty"`
}

// ReplicatedResources is one sharing mechanism's resources.
type ReplicatedResources struct {
	// RenameByDefault renames every replicated resource without a rename
	// to "<name>.shared".
	RenameByDefault bool `json:"renameByDefault,omitempty"`
	// FailRequestsGreaterThanOne refuses a container asking for more than
	// one replica (two replicas of one GPU are not two GPUs). Always on for
	// MPS.
	FailRequestsGreaterThanOne bool                 `json:"failRequestsGreaterThanOne,omitempty"`
	Resources                  []ReplicatedResource `json:"resources"`
}

// ReplicatedResource replicates the devices of one resource.
type ReplicatedResource struct {
	// Name is the resource replicated: "nvidia.com/gpu" or
	// "nvidia.com/mig-<profile>" ("gpu" and "mig-<profile>" get the
	// nvidia.com domain).
	Name string `json:"name"`
	// Rename advertises the replicas under another resource name; the
	// replicated devices then leave the original resource.
	Rename string `json:"rename,omitempty"`
	// Devices selects the devices replicated: all (default) or a list of
	// GPU indexes or GPU/MIG UUIDs.
	Devices ReplicatedDevices `json:"devices,omitempty"`
	// Replicas is how many device IDs each device gets (<uuid>::<n>), >= 2.
	Replicas int `json:"replicas"`
}

// ReplicatedDevices is "all" or a list of GPU indexes or UUIDs.
type ReplicatedDevices struct {
	All  bool
	List []string
}

// UnmarshalJSON accepts "all", or a list of strings and integers.
func (d *ReplicatedDevices) UnmarshalJSON(b []byte) error {
	var s string
	if err := json.Unmarshal(b, &s); err == nil {
		if s != "all" {
			return fmt.Errorf("devices: must be \"all\" or a list of GPU indexes or UUIDs, got %q", s)
		}
		*d = ReplicatedDevices{All: true}
		return nil
	}
	var raw []json.RawMessage
	if err := json.Unmarshal(b, &raw); err != nil {
		return fmt.Errorf("devices: must be \"all\" or a list of GPU indexes or UUIDs, got %s", string(b))
	}
	out := ReplicatedDevices{}
	for i, r := range raw {
		var s string
		if err := json.Unmarshal(r, &s); err == nil {
			out.List = append(out.List, s)
			continue
		}
		var n int
		if err := json.Unmarshal(r, &n); err == nil && n >= 0 {
			out.List = append(out.List, strconv.Itoa(n))
			continue
		}
		return fmt.Errorf("devices[%d]: must be a GPU index or UUID, got %s", i, string(r))
	}
	*d = out
	return nil
}

// MarshalJSON writes "all" or the list.
func (d ReplicatedDevices) MarshalJSON() ([]byte, error) {
	if d.All || d.List == nil {
		return json.Marshal("all")
	}
	return json.Marshal(d.List)
}

// selects reports whether a device of GPU index and UUID (GPU or MIG) is
// selected.
func (d ReplicatedDevices) selects(index int, uuids ...string) bool {
	if d.All || d.List == nil {
		return true
	}
	for _, s := range d.List {
		if s == strconv.Itoa(index) {
			return true
		}
		for _, u := range uuids {
			if u != "" && s == u {
				return true
			}
		}
	}
	return false
}

// ParseConfig reads a config file strictly: unknown fields, a wrong
// version and invalid values are errors naming the field.
func ParseConfig(data []byte) (*Config, error) {
	var c Config
	if err := yaml.UnmarshalStrict(data, &c); err != nil {
		return nil, fmt.Errorf("device plugin config: %w", err)
	}
	if err := c.Validate(); err != nil {
		return nil, err
	}
	return &c, nil
}

// resourceNameRE is an extended resource name: domain/name.
var resourceNameRE = regexp.MustCompile(`^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$`)

// QualifyResourceName adds the nvidia.com domain to a name without one.
func QualifyResourceName(name string) string {
	if name == "" || strings.Contains(name, "/") {
		return name
	}
	return DefaultResourceDomain + "/" + name
}

// ValidResourceName checks an extended resource name ("nvidia.com/gpu").
func ValidResourceName(name string) error {
	if len(name) > 253 || !resourceNameRE.MatchString(name) {
		return fmt.Errorf("%q is not a valid extended resource name (domain/name)", name)
	}
	if strings.HasPrefix(name, "kubernetes.io/") || strings.Contains(strings.SplitN(name, "/", 2)[0], "kubernetes.io") {
		return fmt.Errorf("%q: the kubernetes.io domain is reserved", name)
	}
	return nil
}

// Validate checks the config; every error names its field.
func (c *Config) Validate() error {
	var errs []error
	if c.Version != ConfigVersion {
		errs = append(errs, fmt.Errorf("version: must be %q, got %q", ConfigVersion, c.Version))
	}
	errs = append(errs, c.Flags.validate()...)
	// A device resource may be replicated by one mechanism only, and two
	// replicated resources may not end up under one name.
	seen := map[string]string{}
	advertised := map[string]string{}
	check := func(path string, r *ReplicatedResources, mps bool) {
		if r == nil {
			return
		}
		if len(r.Resources) == 0 {
			errs = append(errs, fmt.Errorf("%s.resources: at least one resource is required", path))
		}
		for i, res := range r.Resources {
			f := fmt.Sprintf("%s.resources[%d]", path, i)
			name := QualifyResourceName(res.Name)
			if res.Name == "" {
				errs = append(errs, fmt.Errorf("%s.name: required", f))
			} else if err := ValidResourceName(name); err != nil {
				errs = append(errs, fmt.Errorf("%s.name: %w", f, err))
			} else if other, ok := seen[name]; ok {
				errs = append(errs, fmt.Errorf("%s.name: %s is already replicated by %s", f, name, other))
			} else {
				seen[name] = f
			}
			if mps && isMigResource(name) {
				errs = append(errs, fmt.Errorf("%s.name: MPS cannot share MIG devices (%s)", f, name))
			}
			if res.Replicas < 2 {
				errs = append(errs, fmt.Errorf("%s.replicas: must be at least 2, got %d", f, res.Replicas))
			}
			if res.Rename != "" {
				if err := ValidResourceName(QualifyResourceName(res.Rename)); err != nil {
					errs = append(errs, fmt.Errorf("%s.rename: %w", f, err))
				}
			}
			out := c.advertisedName(name, res.Rename, r.RenameByDefault)
			if other, ok := advertised[out]; ok && out != name {
				errs = append(errs, fmt.Errorf("%s.rename: %s is already advertised by %s", f, out, other))
			}
			advertised[out] = f
			for j, d := range res.Devices.List {
				if d == "" {
					errs = append(errs, fmt.Errorf("%s.devices[%d]: empty", f, j))
				}
			}
		}
	}
	check("sharing.timeSlicing", c.Sharing.TimeSlicing, false)
	check("sharing.mps", c.Sharing.MPS, true)
	return errors.Join(errs...)
}

func (c *Config) advertisedName(name, rename string, byDefault bool) string {
	switch {
	case rename != "":
		return QualifyResourceName(rename)
	case byDefault:
		return name + ".shared"
	default:
		return name
	}
}

func isMigResource(name string) bool {
	_, n, _ := strings.Cut(name, "/")
	return strings.HasPrefix(n, "mig-")
}
