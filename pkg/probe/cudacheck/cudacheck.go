// Package cudacheck is a CUDA check for inside a pod's container (issue 34):
// through the CUDA driver API of the libcuda.so.1 the CDI spec mounted, it
// initializes CUDA, reads the driver's CUDA version, lists the devices the
// container can use (name, UUID as nvidia-smi prints it, memory), makes a
// context on one device and allocates on it a given size. Its output is one
// JSON line (Result) and one line for people. A container without a GPU
// (CUDA_ERROR_NO_DEVICE, or no libcuda to load) is a result too.
//
// The Go here is pure: it runs on the Driver interface. The binding to the
// real library (purego, no cgo) is package cudacheck/libcuda, which only
// cmd/gpudra-cuda-check imports, since it makes a binary dynamically linked;
// readers of the output (ParseOutput) stay static.
package cudacheck

import (
	"encoding/json"
	"fmt"
	"io"
	"runtime"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/api/resource"
)

// Name marks the check's JSON line (Result.Check).
const Name = "gpudra-cuda-check"

// Outcomes.
const (
	// OK: every step asked for succeeded.
	OK = "ok"
	// NoDevice: no libcuda to load, or CUDA has no device for the process.
	NoDevice = "no-device"
	// Failed: a CUDA call failed (Result.Error says which), the allocation
	// included.
	Failed = "error"
)

// NotRun is Alloc.Result for an allocation that was not attempted (no
// device, or an earlier step failed).
const NotRun = "not run"

// Result is what the check found.
type Result struct {
	// Check is Name.
	Check string `json:"check"`
	// Outcome is OK, NoDevice or Failed.
	Outcome string `json:"outcome"`
	// Library is the libcuda file the process loaded; LoadError why none
	// could be loaded.
	Library   string `json:"library,omitempty"`
	LoadError string `json:"loadError,omitempty"`
	// Init is cuInit's result: CUDA_SUCCESS or the error's name.
	Init string `json:"init,omitempty"`
	// DriverVersion is cuDriverGetVersion's number (12080), CUDAVersion
	// the same as nvidia-smi prints it ("12.8").
	DriverVersion int    `json:"driverVersion,omitempty"`
	CUDAVersion   string `json:"cudaVersion,omitempty"`
	// Devices are the devices CUDA enumerates, by ordinal.
	Devices []Device `json:"devices"`
	// Alloc is the allocation asked for (--alloc).
	Alloc *Alloc `json:"alloc,omitempty"`
	// Held is what the process did while it kept its allocation (--hold).
	Held *Held `json:"held,omitempty"`
	// Error names the call that failed and its error ("cuMemAlloc_v2:
	// CUDA_ERROR_OUT_OF_MEMORY"), or why there is no device.
	Error string `json:"error,omitempty"`
}

// Device is one CUDA device.
type Device struct {
	Ordinal int    `json:"ordinal"`
	Name    string `json:"name"`
	// UUID as nvidia-smi prints it: GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx.
	UUID string `json:"uuid"`
	// MemoryBytes is cuDeviceTotalMem's figure.
	MemoryBytes uint64 `json:"memoryBytes"`
}

// Alloc is one cuMemAlloc on a device's primary context.
type Alloc struct {
	Device int   `json:"device"`
	Bytes  int64 `json:"bytes"`
	// Result is OK, the CUDA error's name, or NotRun.
	Result string `json:"result"`
}

// Held is a --hold: how long the allocation was kept and how many times it
// was written over by the GPU meanwhile (cuMemsetD8_v2, each followed by
// cuCtxSynchronize), so that NVML sees a busy process: utilization, memory
// traffic and the process's SM samples.
type Held struct {
	Seconds float64 `json:"seconds"`
	Memsets int     `json:"memsets"`
	// Busy is false where the driver has no cuMemsetD8_v2: the memory was
	// only held.
	Busy bool `json:"busy"`
}

// Status is a CUresult.
type Status int32

// The CUresults the check tells apart.
const (
	Success       Status = 0
	ErrorNoDevice Status = 100
)

// Driver is the part of the CUDA driver API the check calls, with the
// real calls' semantics (libcuda.Open binds them).
type Driver interface {
	Init(flags uint32) Status                          // cuInit
	DriverGetVersion() (int, Status)                   // cuDriverGetVersion
	DeviceGetCount() (int, Status)                     // cuDeviceGetCount
	DeviceGet(ordinal int) (int32, Status)             // cuDeviceGet
	DeviceGetName(dev int32) (string, Status)          // cuDeviceGetName
	DeviceGetUUID(dev int32) ([16]byte, Status)        // cuDeviceGetUuid_v2, else cuDeviceGetUuid
	DeviceTotalMem(dev int32) (uint64, Status)         // cuDeviceTotalMem_v2
	PrimaryCtxRetain(dev int32) (uintptr, Status)      // cuDevicePrimaryCtxRetain
	PrimaryCtxRelease(dev int32) Status                // cuDevicePrimaryCtxRelease_v2
	CtxSetCurrent(ctx uintptr) Status                  // cuCtxSetCurrent
	MemAlloc(bytes uint64) (ptr uint64, status Status) // cuMemAlloc_v2
	MemFree(ptr uint64) Status                         // cuMemFree_v2
	// ErrorName is cuGetErrorName's string, "" where it has none.
	ErrorName(s Status) string
}

// Memsetter is the part of the driver API a --hold keeps the GPU busy
// with; a Driver that lacks it only holds its allocation.
type Memsetter interface {
	MemsetD8(ptr uint64, value byte, n uint64) Status // cuMemsetD8_v2
	CtxSynchronize() Status                           // cuCtxSynchronize
}

// Config is what to check.
type Config struct {
	// AllocBytes, when positive, is allocated on device ordinal Device.
	AllocBytes int64
	Device     int
	// Hold, when positive, keeps the allocation for that long before it is
	// freed, writing it over with the GPU again and again (Memsetter).
	Hold time.Duration
	// now and sleep are time.Now and time.Sleep but in tests.
	now   func() time.Time
	sleep func(time.Duration)
}

// Unloadable is the result where no libcuda could be loaded: no device.
func Unloadable(err error) Result {
	return Result{Check: Name, Outcome: NoDevice, LoadError: err.Error(), Devices: []Device{},
		Error: "libcuda not loadable"}
}

// Run checks CUDA through d. The calls run on one locked OS thread: a
// context is current per thread.
func Run(d Driver, cfg Config) Result {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	r := Result{Check: Name, Outcome: OK, Devices: []Device{}}
	if cfg.AllocBytes > 0 {
		r.Alloc = &Alloc{Device: cfg.Device, Bytes: cfg.AllocBytes, Result: NotRun}
	}
	name := func(s Status) string {
		if n := d.ErrorName(s); n != "" {
			return n
		}
		return fmt.Sprintf("CUresult %d", s)
	}
	fail := func(call string, s Status) Result {
		r.Outcome, r.Error = Failed, call+": "+name(s)
		return r
	}
	if v, s := d.DriverGetVersion(); s == Success {
		r.DriverVersion, r.CUDAVersion = v, fmt.Sprintf("%d.%d", v/1000, v%1000/10)
	}
	s := d.Init(0)
	r.Init = name(s)
	if s == ErrorNoDevice {
		r.Outcome, r.Error = NoDevice, "cuInit: "+name(s)
		return r
	}
	if s != Success {
		return fail("cuInit", s)
	}
	n, s := d.DeviceGetCount()
	if s != Success {
		return fail("cuDeviceGetCount", s)
	}
	if n == 0 {
		r.Outcome, r.Error = NoDevice, "cuDeviceGetCount: 0 devices"
		return r
	}
	handles := make([]int32, n)
	for i := range n {
		h, s := d.DeviceGet(i)
		if s != Success {
			return fail(fmt.Sprintf("cuDeviceGet(%d)", i), s)
		}
		handles[i] = h
		dev := Device{Ordinal: i}
		if dev.Name, s = d.DeviceGetName(h); s != Success {
			return fail(fmt.Sprintf("cuDeviceGetName(%d)", i), s)
		}
		uuid, s := d.DeviceGetUUID(h)
		if s != Success {
			return fail(fmt.Sprintf("cuDeviceGetUuid(%d)", i), s)
		}
		dev.UUID = FormatUUID(uuid)
		if dev.MemoryBytes, s = d.DeviceTotalMem(h); s != Success {
			return fail(fmt.Sprintf("cuDeviceTotalMem(%d)", i), s)
		}
		r.Devices = append(r.Devices, dev)
	}
	if r.Alloc == nil {
		return r
	}
	if cfg.Device < 0 || cfg.Device >= n {
		r.Alloc.Result = "CUDA_ERROR_INVALID_DEVICE"
		r.Outcome, r.Error = Failed, fmt.Sprintf("--device %d: CUDA has %d devices", cfg.Device, n)
		return r
	}
	h := handles[cfg.Device]
	ctx, s := d.PrimaryCtxRetain(h)
	if s != Success {
		r.Alloc.Result = name(s)
		return fail("cuDevicePrimaryCtxRetain", s)
	}
	defer d.PrimaryCtxRelease(h)
	if s := d.CtxSetCurrent(ctx); s != Success {
		r.Alloc.Result = name(s)
		return fail("cuCtxSetCurrent", s)
	}
	ptr, s := d.MemAlloc(uint64(cfg.AllocBytes))
	if s != Success {
		r.Alloc.Result = name(s)
		return fail("cuMemAlloc_v2", s)
	}
	r.Alloc.Result = OK
	if cfg.Hold > 0 {
		held, call, s := hold(d, cfg, ptr)
		r.Held = held
		if s != Success {
			d.MemFree(ptr)
			return fail(call, s)
		}
	}
	if s := d.MemFree(ptr); s != Success {
		return fail("cuMemFree_v2", s)
	}
	return r
}

// hold keeps the allocation at ptr for cfg.Hold, writing it over with the
// GPU where the driver can (else sleeping); it returns the failed call's
// name and status where one failed.
func hold(d Driver, cfg Config, ptr uint64) (*Held, string, Status) {
	now, sleep := cfg.now, cfg.sleep
	if now == nil {
		now, sleep = time.Now, time.Sleep
	}
	start := now()
	h := &Held{}
	m, busy := d.(Memsetter)
	h.Busy = busy
	for now().Sub(start) < cfg.Hold {
		if !busy {
			sleep(min(cfg.Hold-now().Sub(start), 100*time.Millisecond))
			continue
		}
		if s := m.MemsetD8(ptr, byte(h.Memsets), uint64(cfg.AllocBytes)); s != Success {
			h.Seconds = now().Sub(start).Seconds()
			return h, "cuMemsetD8_v2", s
		}
		if s := m.CtxSynchronize(); s != Success {
			h.Seconds = now().Sub(start).Seconds()
			return h, "cuCtxSynchronize", s
		}
		h.Memsets++
	}
	h.Seconds = now().Sub(start).Seconds()
	return h, "", Success
}

// FormatUUID prints a CUuuid as nvidia-smi prints a GPU's UUID.
func FormatUUID(b [16]byte) string {
	return fmt.Sprintf("GPU-%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:16])
}

// ParseSize reads --alloc: a Kubernetes quantity of bytes ("1Gi", "512Mi",
// "4G"), positive and whole.
func ParseSize(s string) (int64, error) {
	q, err := resource.ParseQuantity(s)
	if err != nil {
		return 0, fmt.Errorf("size %q: %w", s, err)
	}
	v, ok := q.AsInt64()
	if !ok || v <= 0 {
		return 0, fmt.Errorf("size %q: want a positive whole number of bytes (1Gi, 512Mi)", s)
	}
	return v, nil
}

// ExitCode is the check's exit status: 0 OK, 1 a CUDA call failed, 3 no
// device (2 is left to usage errors).
func (r *Result) ExitCode() int {
	switch r.Outcome {
	case OK:
		return 0
	case NoDevice:
		return 3
	default:
		return 1
	}
}

// Summary is the line for people.
func (r *Result) Summary() string {
	var b strings.Builder
	b.WriteString(Name + ": " + r.Outcome)
	if r.CUDAVersion != "" {
		fmt.Fprintf(&b, ", CUDA %s", r.CUDAVersion)
	}
	switch r.Outcome {
	case NoDevice:
		b.WriteString(": " + r.Error)
		if r.LoadError != "" {
			b.WriteString(": " + r.LoadError)
		}
		return b.String()
	}
	fmt.Fprintf(&b, ", %d device(s)", len(r.Devices))
	for _, d := range r.Devices {
		fmt.Fprintf(&b, "; %d: %s (%s, %s)", d.Ordinal, d.Name, d.UUID, bytesText(int64(d.MemoryBytes)))
	}
	if r.Alloc != nil {
		fmt.Fprintf(&b, "; cuMemAlloc %s on device %d: %s", bytesText(r.Alloc.Bytes), r.Alloc.Device, r.Alloc.Result)
	}
	if r.Error != "" && (r.Alloc == nil || !strings.HasSuffix(r.Error, r.Alloc.Result)) {
		b.WriteString("; " + r.Error)
	}
	return b.String()
}

// bytesText is 4 GiB, 512 MiB or 1000 bytes.
func bytesText(n int64) string {
	for _, u := range []struct {
		shift uint
		name  string
	}{{40, "TiB"}, {30, "GiB"}, {20, "MiB"}, {10, "KiB"}} {
		if n >= 1<<u.shift && n%(1<<u.shift) == 0 {
			return fmt.Sprintf("%d %s", n>>u.shift, u.name)
		}
	}
	if n >= 1<<30 {
		return fmt.Sprintf("%.2f GiB", float64(n)/(1<<30))
	}
	return fmt.Sprintf("%d bytes", n)
}

// Write prints the result: its JSON on one line, then Summary.
func Write(w io.Writer, r Result) error {
	doc, err := json.Marshal(r)
	if err != nil {
		return err
	}
	_, err = fmt.Fprintf(w, "%s\n%s\n", doc, r.Summary())
	return err
}

// ParseOutput finds the check's result in what it printed (alone, or
// within other output, as in a probe report's command output): the last
// line that is a JSON object with "check": Name.
func ParseOutput(out string) (*Result, error) {
	lines := strings.Split(out, "\n")
	for i := len(lines) - 1; i >= 0; i-- {
		line := strings.TrimSpace(lines[i])
		if !strings.HasPrefix(line, "{") {
			continue
		}
		var r Result
		if err := json.Unmarshal([]byte(line), &r); err != nil || r.Check != Name {
			continue
		}
		return &r, nil
	}
	return nil, fmt.Errorf("no %s result in its output: %q", Name, truncate(out, 400))
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}
