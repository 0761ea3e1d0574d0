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

// MIG strategies (flags.migStrategy).
const (
	// MigStrategyNone advertises only whole GPUs: GPUs in MIG mode are not
	// advertised at all.
	MigStrategyNone = "none"
	// MigStrategyMixed advertises one resource per MIG profile
	// (nvidia.com/mig-1g.10gb): the default.
	MigStrategyMixed = "mixed"
)

// Config is the device plugin's configuration file, in the shape of
// NVIDIA's k8s-device-plugin config (version v1). Only the fields below are
// known; any other field is an error naming it (documented differences).
//
//	version: v1
//	flags:
//	  migStrategy: mixed          # none | mixed ("single" is not supported)
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
	// MigStrategy is "none" or "mixed"; empty means mixed.
	MigStrategy string `json:"migStrategy,omitempty"`
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
	switch c.Flags.MigStrategy {
	case "", MigStrategyNone, MigStrategyMixed:
	case "single":
		errs = append(errs, fmt.Errorf("flags.migStrategy: \"single\" is not supported, use \"mixed\" (one resource per MIG profile) or \"none\""))
	default:
		errs = append(errs, fmt.Errorf("flags.migStrategy: must be \"none\" or \"mixed\", got %q", c.Flags.MigStrategy))
	}
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
