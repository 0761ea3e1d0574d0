package cudacheck

import (
	"bytes"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// goDriver is a Driver in Go, for the check's own logic.
type goDriver struct {
	initStatus Status
	names      []string
	memory     uint64
	allocLimit uint64
	current    uintptr
	calls      []string
}

var errorNames = map[Status]string{0: "CUDA_SUCCESS", 2: "CUDA_ERROR_OUT_OF_MEMORY", 100: "CUDA_ERROR_NO_DEVICE",
	201: "CUDA_ERROR_INVALID_CONTEXT"}

func (d *goDriver) Init(uint32) Status              { d.calls = append(d.calls, "init"); return d.initStatus }
func (d *goDriver) DriverGetVersion() (int, Status) { return 12080, Success }
func (d *goDriver) DeviceGetCount() (int, Status)   { return len(d.names), Success }
func (d *goDriver) DeviceGet(i int) (int32, Status) { return int32(i), Success }
func (d *goDriver) DeviceGetName(dev int32) (string, Status) {
	return d.names[dev], Success
}
func (d *goDriver) DeviceGetUUID(dev int32) ([16]byte, Status) {
	return [16]byte{0xde, 0xad, 0xbe, 0xef, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, byte(dev)}, Success
}
func (d *goDriver) DeviceTotalMem(int32) (uint64, Status) { return d.memory, Success }
func (d *goDriver) PrimaryCtxRetain(dev int32) (uintptr, Status) {
	d.calls = append(d.calls, fmt.Sprint("retain ", dev))
	return uintptr(0x1000 + dev), Success
}
func (d *goDriver) PrimaryCtxRelease(dev int32) Status {
	d.calls = append(d.calls, fmt.Sprint("release ", dev))
	return Success
}
func (d *goDriver) CtxSetCurrent(ctx uintptr) Status { d.current = ctx; return Success }
func (d *goDriver) MemAlloc(n uint64) (uint64, Status) {
	if d.current == 0 {
		return 0, 201
	}
	d.calls = append(d.calls, fmt.Sprint("alloc ", n))
	if n > d.allocLimit {
		return 0, 2
	}
	return 0xabc, Success
}
func (d *goDriver) MemFree(p uint64) Status {
	d.calls = append(d.calls, fmt.Sprintf("free %#x", p))
	return Success
}
func (d *goDriver) ErrorName(s Status) string { return errorNames[s] }

func TestRun(t *testing.T) {
	h100 := "NVIDIA H100 80GB HBM3"
	t.Run("one device, allocation fits", func(t *testing.T) {
		d := &goDriver{names: []string{h100}, memory: 80 << 30, allocLimit: 8 << 30}
		r := Run(d, Config{AllocBytes: 4 << 30})
		assert.Equal(t, OK, r.Outcome)
		assert.Equal(t, "CUDA_SUCCESS", r.Init)
		assert.Equal(t, 12080, r.DriverVersion)
		assert.Equal(t, "12.8", r.CUDAVersion)
		require.Len(t, r.Devices, 1)
		assert.Equal(t, Device{Ordinal: 0, Name: h100, UUID: "GPU-deadbeef-0001-0203-0405-060708090a00", MemoryBytes: 80 << 30}, r.Devices[0])
		assert.Equal(t, &Alloc{Device: 0, Bytes: 4 << 30, Result: OK}, r.Alloc)
		assert.Equal(t, []string{"init", "retain 0", "alloc 4294967296", "free 0xabc", "release 0"}, d.calls,
			"a primary context made current, the allocation freed, the context released")
		assert.Equal(t, 0, r.ExitCode())
	})
	t.Run("allocation refused", func(t *testing.T) {
		d := &goDriver{names: []string{h100, h100}, memory: 80 << 30, allocLimit: 8 << 30}
		r := Run(d, Config{AllocBytes: 12 << 30, Device: 1})
		assert.Equal(t, Failed, r.Outcome)
		assert.Equal(t, &Alloc{Device: 1, Bytes: 12 << 30, Result: "CUDA_ERROR_OUT_OF_MEMORY"}, r.Alloc)
		assert.Equal(t, "cuMemAlloc_v2: CUDA_ERROR_OUT_OF_MEMORY", r.Error)
		assert.Len(t, r.Devices, 2, "the devices are listed all the same")
		assert.Contains(t, d.calls, "release 1")
		assert.Equal(t, 1, r.ExitCode())
	})
	t.Run("no device", func(t *testing.T) {
		d := &goDriver{initStatus: ErrorNoDevice}
		r := Run(d, Config{AllocBytes: 1 << 30})
		assert.Equal(t, NoDevice, r.Outcome)
		assert.Equal(t, "CUDA_ERROR_NO_DEVICE", r.Init)
		assert.Equal(t, "cuInit: CUDA_ERROR_NO_DEVICE", r.Error)
		assert.Equal(t, &Alloc{Bytes: 1 << 30, Result: NotRun}, r.Alloc)
		assert.Empty(t, r.Devices)
		assert.Equal(t, 3, r.ExitCode())
	})
	t.Run("device out of range", func(t *testing.T) {
		r := Run(&goDriver{names: []string{h100}, memory: 1, allocLimit: 1}, Config{AllocBytes: 1, Device: 1})
		assert.Equal(t, Failed, r.Outcome)
		assert.Equal(t, "CUDA_ERROR_INVALID_DEVICE", r.Alloc.Result)
	})
	t.Run("unnamed error", func(t *testing.T) {
		r := Run(&goDriver{initStatus: 999}, Config{})
		assert.Equal(t, Failed, r.Outcome)
		assert.Equal(t, "cuInit: CUresult 999", r.Error)
	})
	t.Run("no allocation asked for", func(t *testing.T) {
		d := &goDriver{names: []string{h100}, memory: 1}
		r := Run(d, Config{})
		assert.Equal(t, OK, r.Outcome)
		assert.Nil(t, r.Alloc)
		assert.Equal(t, []string{"init"}, d.calls, "no context without an allocation")
	})
}

func TestParseSize(t *testing.T) {
	for in, want := range map[string]int64{"1Gi": 1 << 30, "512Mi": 512 << 20, "4G": 4e9, "4096": 4096, "12Gi": 12 << 30} {
		got, err := ParseSize(in)
		require.NoError(t, err, in)
		assert.Equal(t, want, got, in)
	}
	for _, in := range []string{"", "0", "-1Gi", "1.5", "lots", "100m"} {
		_, err := ParseSize(in)
		assert.Error(t, err, in)
	}
}

func TestWriteAndParseOutput(t *testing.T) {
	r := Run(&goDriver{names: []string{"NVIDIA H100 80GB HBM3"}, memory: 81559 << 20, allocLimit: 8 << 30}, Config{AllocBytes: 4 << 30})
	r.Library = "/usr/lib/x86_64-linux-gnu/libcuda.so.570.172.08"
	var out bytes.Buffer
	require.NoError(t, Write(&out, r))
	lines := strings.Split(strings.TrimSuffix(out.String(), "\n"), "\n")
	require.Len(t, lines, 2, "one JSON line and one line for people")
	assert.Equal(t, "gpudra-cuda-check: ok, CUDA 12.8, 1 device(s); 0: NVIDIA H100 80GB HBM3 (GPU-deadbeef-0001-0203-0405-060708090a00, 81559 MiB); "+
		"cuMemAlloc 4 GiB on device 0: ok", lines[1])

	// Within a probe report's command output, after other lines.
	got, err := ParseOutput("nvidia-smi says hello\n{\"not\":\"ours\"}\n" + out.String())
	require.NoError(t, err)
	assert.Equal(t, r, *got)

	_, err = ParseOutput("exec: \"/gpudra-cuda-check\": no such file or directory")
	assert.ErrorContains(t, err, "no gpudra-cuda-check result")

	nd := Unloadable(errors.New("libcuda.so.1: cannot open shared object file: No such file or directory"))
	out.Reset()
	require.NoError(t, Write(&out, nd))
	got, err = ParseOutput(out.String())
	require.NoError(t, err)
	assert.Equal(t, NoDevice, got.Outcome)
	assert.Contains(t, out.String(), "gpudra-cuda-check: no-device: libcuda not loadable: libcuda.so.1: cannot open shared object file")
	assert.Equal(t, 3, got.ExitCode())

	oom := Run(&goDriver{names: []string{"H"}, memory: 1, allocLimit: 8 << 30}, Config{AllocBytes: 12 << 30})
	assert.Equal(t, "gpudra-cuda-check: error, CUDA 12.8, 1 device(s); 0: H (GPU-deadbeef-0001-0203-0405-060708090a00, 1 bytes); "+
		"cuMemAlloc 12 GiB on device 0: CUDA_ERROR_OUT_OF_MEMORY", oom.Summary())
}

// busyGoDriver is a goDriver with cuMemsetD8_v2 and cuCtxSynchronize.
type busyGoDriver struct {
	goDriver
	memsets   int
	failAfter int // the memset after this many fails; 0: none fails
}

func (d *busyGoDriver) MemsetD8(ptr uint64, v byte, n uint64) Status {
	if d.failAfter > 0 && d.memsets == d.failAfter {
		return 2
	}
	d.memsets++
	d.calls = append(d.calls, fmt.Sprintf("memset %#x %d", ptr, n))
	return Success
}
func (d *busyGoDriver) CtxSynchronize() Status { return Success }

// fakeClock advances by step at every look.
type fakeClock struct {
	t    time.Time
	step time.Duration
}

func (c *fakeClock) now() time.Time { c.t = c.t.Add(c.step); return c.t }

func TestRunHold(t *testing.T) {
	h100 := "NVIDIA H100 80GB HBM3"
	for _, tc := range []struct {
		name        string
		driver      Driver
		wantOutcome string
		wantBusy    bool
		wantMemsets int
		wantErr     string
	}{
		{name: "busy driver writes the allocation over until the hold ends",
			driver:      &busyGoDriver{goDriver: goDriver{names: []string{h100}, memory: 1 << 40, allocLimit: 1 << 40}},
			wantOutcome: OK, wantBusy: true, wantMemsets: 9},
		{name: "a driver without memset only holds",
			driver:      &goDriver{names: []string{h100}, memory: 1 << 40, allocLimit: 1 << 40},
			wantOutcome: OK, wantBusy: false},
		{name: "a failed memset fails the check and frees the allocation",
			driver:      &busyGoDriver{goDriver: goDriver{names: []string{h100}, memory: 1 << 40, allocLimit: 1 << 40}, failAfter: 3},
			wantOutcome: Failed, wantBusy: true, wantMemsets: 3, wantErr: "cuMemsetD8_v2: CUDA_ERROR_OUT_OF_MEMORY"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			clk := &fakeClock{t: time.Unix(0, 0), step: 100 * time.Millisecond}
			slept := time.Duration(0)
			cfg := Config{AllocBytes: 1 << 20, Hold: time.Second, now: clk.now,
				sleep: func(d time.Duration) { slept += d; clk.t = clk.t.Add(d) }}
			r := Run(tc.driver, cfg)
			assert.Equal(t, tc.wantOutcome, r.Outcome)
			assert.Equal(t, tc.wantErr, r.Error)
			require.NotNil(t, r.Held)
			assert.Equal(t, tc.wantBusy, r.Held.Busy)
			assert.Equal(t, tc.wantMemsets, r.Held.Memsets)
			if !tc.wantBusy {
				assert.Positive(t, slept, "a hold without memset sleeps")
			}
			var calls []string
			switch d := tc.driver.(type) {
			case *busyGoDriver:
				calls = d.calls
			case *goDriver:
				calls = d.calls
			}
			assert.Equal(t, "free 0xabc", calls[len(calls)-2], "the allocation is freed, then the context released: %v", calls)
		})
	}
}
