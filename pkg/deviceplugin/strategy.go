package deviceplugin

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"path"
	"slices"
	"strings"

	cdiapi "tags.cncf.io/container-device-interface/pkg/cdi"
)

// Device list strategies (flags.plugin.deviceListStrategy): how Allocate
// names the devices to the container runtime, with NVIDIA's meanings.
const (
	// DeviceListEnvVar: NVIDIA_VISIBLE_DEVICES=<ids> (for NVIDIA's
	// container runtime), the default.
	DeviceListEnvVar = "envvar"
	// DeviceListVolumeMounts: NVIDIA_VISIBLE_DEVICES=/var/run/nvidia-container-devices
	// and one mount of /dev/null at /var/run/nvidia-container-devices/<id>
	// per device (NVIDIA's runtime with accept-nvidia-visible-devices-as-volume-mounts).
	DeviceListVolumeMounts = "volume-mounts"
	// DeviceListCDIAnnotations: the CDI names in a container annotation
	// "cdi.k8s.io/<plugin>_<id>" (a CDI-enabled runtime).
	DeviceListCDIAnnotations = "cdi-annotations"
	// DeviceListCDICRI: the CDI names in the response's CdiDevices, which
	// the kubelet passes in the CRI (a CDI-enabled runtime).
	DeviceListCDICRI = "cdi-cri"
)

// Device ID strategies (flags.plugin.deviceIDStrategy): what the envvar
// and volume-mounts strategies name a device by.
const (
	DeviceIDUUID  = "uuid"
	DeviceIDIndex = "index"
)

const (
	// VisibleDevicesEnv is NVIDIA's device list variable.
	VisibleDevicesEnv = "NVIDIA_VISIBLE_DEVICES"
	// VolumeMountsRoot is where the volume-mounts strategy names the
	// devices, as NVIDIA's plugin does.
	VolumeMountsRoot = "/var/run/nvidia-container-devices"
	// volumeMountsHostPath is what every volume-mounts mount mounts.
	volumeMountsHostPath = "/dev/null"
	// DefaultCDIAnnotationPrefix is the CDI library's annotation prefix.
	DefaultCDIAnnotationPrefix = cdiapi.AnnotationPrefix
	// cdiAnnotationPlugin is the plugin part of the annotation keys.
	cdiAnnotationPlugin = "gpudra-device-plugin"
)

var deviceListStrategies = []string{DeviceListEnvVar, DeviceListVolumeMounts, DeviceListCDIAnnotations, DeviceListCDICRI}

// DeviceListStrategies is flags.plugin.deviceListStrategy: one strategy or
// a list, as NVIDIA's config accepts both ("envvar", [envvar, cdi-cri]); a
// string may also be comma-separated, as NVIDIA's flag is.
type DeviceListStrategies []string

// UnmarshalJSON accepts a string or a list of strings.
func (s *DeviceListStrategies) UnmarshalJSON(b []byte) error {
	if string(b) == "null" {
		*s = nil // unset: the default
		return nil
	}
	var one string
	if err := json.Unmarshal(b, &one); err == nil {
		*s = nil
		for _, p := range strings.Split(one, ",") {
			*s = append(*s, strings.TrimSpace(p))
		}
		return nil
	}
	var list []string
	if err := json.Unmarshal(b, &list); err != nil {
		return fmt.Errorf("deviceListStrategy: must be a strategy or a list of strategies, got %s", string(b))
	}
	if list == nil {
		list = []string{}
	}
	*s = list
	return nil
}

// validate checks the flags; every error names its field.
func (f Flags) validate() []error {
	var errs []error
	switch f.MigStrategy {
	case "", MigStrategyNone, MigStrategySingle, MigStrategyMixed:
	default:
		errs = append(errs, fmt.Errorf("flags.migStrategy: must be %q, %q or %q, got %q", MigStrategyNone, MigStrategySingle, MigStrategyMixed, f.MigStrategy))
	}
	if f.FailOnInitError != nil && !*f.FailOnInitError {
		errs = append(errs, fmt.Errorf("flags.failOnInitError: false is not supported: gpudra always fails on an init error and is restarted (a node without GPUs registers nothing and waits); remove the field or set it to true"))
	}
	for _, r := range []struct{ field, root string }{{"flags.nvidiaDriverRoot", f.NvidiaDriverRoot}, {"flags.nvidiaDevRoot", f.NvidiaDevRoot}} {
		if r.root != "" && !path.IsAbs(r.root) {
			errs = append(errs, fmt.Errorf("%s: must be an absolute path, got %q", r.field, r.root))
		}
	}
	if f.Plugin == nil {
		return errs
	}
	if s := f.Plugin.DeviceListStrategy; s != nil && len(s) == 0 {
		errs = append(errs, fmt.Errorf("flags.plugin.deviceListStrategy: at least one strategy is required"))
	}
	for i, s := range f.Plugin.DeviceListStrategy {
		if !slices.Contains(deviceListStrategies, s) {
			errs = append(errs, fmt.Errorf("flags.plugin.deviceListStrategy[%d]: must be one of %s, got %q", i, strings.Join(deviceListStrategies, ", "), s))
		}
	}
	switch f.Plugin.DeviceIDStrategy {
	case "", DeviceIDUUID, DeviceIDIndex:
	default:
		errs = append(errs, fmt.Errorf("flags.plugin.deviceIDStrategy: must be %q or %q, got %q", DeviceIDUUID, DeviceIDIndex, f.Plugin.DeviceIDStrategy))
	}
	return errs
}

// migStrategy is the effective MIG strategy: none when unset.
func (c *Config) migStrategy() string {
	if c == nil || c.Flags.MigStrategy == "" {
		return MigStrategyNone
	}
	return c.Flags.MigStrategy
}

// Response is how Allocate answers for one resource, from flags.plugin
// (and flags.nvidia*Root). The zero value is NVIDIA's defaults: envvar,
// uuid, device nodes under "/".
type Response struct {
	// Strategies are the device list strategies; empty: envvar.
	Strategies []string
	// IDStrategy is "uuid" (empty) or "index".
	IDStrategy string
	// AnnotationPrefix replaces "cdi.k8s.io/" in the annotation keys;
	// empty: "cdi.k8s.io/".
	AnnotationPrefix string
	// DevRoot prefixes the host paths of the DeviceSpecs; empty: "/".
	DevRoot string
}

// responseFor is the Response a config asks for.
func responseFor(c *Config) Response {
	if c == nil {
		return Response{}
	}
	r := Response{DevRoot: c.Flags.NvidiaDevRoot}
	if r.DevRoot == "" {
		r.DevRoot = c.Flags.NvidiaDriverRoot
	}
	if p := c.Flags.Plugin; p != nil {
		for _, s := range p.DeviceListStrategy {
			if !slices.Contains(r.Strategies, s) {
				r.Strategies = append(r.Strategies, s)
			}
		}
		r.IDStrategy, r.AnnotationPrefix = p.DeviceIDStrategy, p.CDIAnnotationPrefix
	}
	return r
}

// strategies are the effective strategies.
func (r Response) strategies() []string {
	if len(r.Strategies) == 0 {
		return []string{DeviceListEnvVar}
	}
	return r.Strategies
}

// Includes reports whether the strategy is in use.
func (r Response) Includes(strategy string) bool { return slices.Contains(r.strategies(), strategy) }

// NeedsDeviceSpecs reports whether Allocate passes the container edits
// themselves (DeviceSpecs, Mounts, Envs): whenever a strategy other than
// the CDI ones is in use, that is whenever the runtime is not declared to
// resolve CDI names.
func (r Response) NeedsDeviceSpecs() bool {
	for _, s := range r.strategies() {
		if !strings.HasPrefix(s, "cdi-") {
			return true
		}
	}
	return false
}

// usesIndex reports whether devices are named by index in the response.
func (r Response) usesIndex() bool {
	return r.IDStrategy == DeviceIDIndex && (r.Includes(DeviceListEnvVar) || r.Includes(DeviceListVolumeMounts))
}

// hostPath is a device node's path on the host: under DevRoot.
func (r Response) hostPath(p string) string {
	if r.DevRoot == "" {
		return p
	}
	return path.Join(r.DevRoot, p)
}

// annotationKey is the cdi-annotations key for a resource's devices: the
// CDI library's "cdi.k8s.io/<plugin>_<id>", with a hash of the resource
// name as the id so that two resources in one container never share a key
// (the kubelet keeps the first value of a key), and the configured prefix.
func (r Response) annotationKey(resource string) (string, error) {
	sum := sha256.Sum256([]byte(resource))
	key, err := cdiapi.AnnotationKey(cdiAnnotationPlugin, hex.EncodeToString(sum[:8]))
	if err != nil {
		return "", err
	}
	if r.AnnotationPrefix != "" {
		key = r.AnnotationPrefix + strings.TrimPrefix(key, DefaultCDIAnnotationPrefix)
	}
	return key, nil
}
