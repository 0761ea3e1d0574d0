// Package libcuda binds the CUDA driver API of libcuda.so.1 for
// cudacheck, without cgo: purego loads the library through the process's
// own dynamic loader. A binary that imports it is dynamically linked even
// with CGO_ENABLED=0 (it needs a libc and ld.so, as the container's image
// gives), which is why only cmd/gpudra-cuda-check imports it.
package libcuda

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"unsafe"

	"github.com/ebitengine/purego"

	"github.com/gpudra/gpudra/pkg/probe/cudacheck"
)

// Soname is the driver library's name, as every CUDA program loads it.
const Soname = "libcuda.so.1"

// Open loads libcuda: path where given; else Soname through the dynamic
// loader (LD_LIBRARY_PATH, ld.so.cache, the standard directories), else
// the libcuda.so.1 a CDI spec mounted where the loader does not look (a
// driver installed under /usr/local/nvidia/lib64, with no ldcache hook
// run in the container). It returns the file that was loaded.
func Open(path string) (cudacheck.Driver, string, error) {
	var tried []string
	candidates := []string{path}
	if path == "" {
		candidates = append([]string{Soname}, mountedLibCUDA("/proc/self/mountinfo")...)
	}
	for _, c := range candidates {
		h, err := purego.Dlopen(c, purego.RTLD_NOW|purego.RTLD_GLOBAL)
		if err != nil {
			tried = append(tried, err.Error())
			continue
		}
		d, err := bind(h)
		if err != nil {
			return nil, c, err
		}
		file := loadedFile("/proc/self/maps")
		if file == "" {
			file = c
		}
		return withMemset(h, d), file, nil
	}
	return nil, "", errors.New(strings.Join(tried, "; "))
}

// mountedLibCUDA are the mount points named libcuda.so.1 in mountinfo.
func mountedLibCUDA(mountinfo string) []string {
	f, err := os.Open(mountinfo)
	if err != nil {
		return nil
	}
	defer f.Close()
	var out []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) > 4 && filepath.Base(fields[4]) == Soname {
			out = append(out, fields[4])
		}
	}
	return out
}

// loadedFile is the libcuda file mapped into the process.
func loadedFile(maps string) string {
	f, err := os.Open(maps)
	if err != nil {
		return ""
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) >= 6 && strings.HasPrefix(filepath.Base(fields[5]), "libcuda.so") {
			return fields[5]
		}
	}
	return ""
}

// driver is libcuda's functions.
type driver struct {
	cuInit                       func(flags uint32) int32
	cuDriverGetVersion           func(v *int32) int32
	cuDeviceGetCount             func(n *int32) int32
	cuDeviceGet                  func(dev *int32, ordinal int32) int32
	cuDeviceGetName              func(name *byte, n int32, dev int32) int32
	cuDeviceGetUuid              func(uuid *[16]byte, dev int32) int32
	cuDeviceTotalMem             func(bytes *uint64, dev int32) int32
	cuDevicePrimaryCtxRetain     func(ctx *uintptr, dev int32) int32
	cuDevicePrimaryCtxRelease_v2 func(dev int32) int32
	cuCtxSetCurrent              func(ctx uintptr) int32
	cuMemAlloc                   func(ptr *uint64, bytes uint64) int32
	cuMemFree                    func(ptr uint64) int32
	cuGetErrorName               func(s int32, name **byte) int32
}

// busyDriver is a driver that can also keep the GPU busy (a --hold):
// cuMemsetD8_v2 and cuCtxSynchronize, bound only where libcuda has both (a
// stand-in libcuda may not).
type busyDriver struct {
	*driver
	cuMemsetD8       func(ptr uint64, value uint8, n uint64) int32
	cuCtxSynchronize func() int32
}

func (d *busyDriver) MemsetD8(ptr uint64, value byte, n uint64) cudacheck.Status {
	return cudacheck.Status(d.cuMemsetD8(ptr, value, n))
}

func (d *busyDriver) CtxSynchronize() cudacheck.Status { return cudacheck.Status(d.cuCtxSynchronize()) }

// withMemset is d as a busyDriver where libcuda has both calls, else d.
func withMemset(h uintptr, d *driver) cudacheck.Driver {
	memset, err1 := purego.Dlsym(h, "cuMemsetD8_v2")
	sync, err2 := purego.Dlsym(h, "cuCtxSynchronize")
	if err1 != nil || err2 != nil || memset == 0 || sync == 0 {
		return d
	}
	b := &busyDriver{driver: d}
	purego.RegisterFunc(&b.cuMemsetD8, memset)
	purego.RegisterFunc(&b.cuCtxSynchronize, sync)
	return b
}

// bind looks up every function; cuDeviceGetUuid_v2 where the driver has
// it (CUDA 11.4 and later), else cuDeviceGetUuid.
func bind(h uintptr) (*driver, error) {
	d := &driver{}
	for _, f := range []struct {
		fn    any
		names []string
	}{
		{&d.cuInit, []string{"cuInit"}},
		{&d.cuDriverGetVersion, []string{"cuDriverGetVersion"}},
		{&d.cuDeviceGetCount, []string{"cuDeviceGetCount"}},
		{&d.cuDeviceGet, []string{"cuDeviceGet"}},
		{&d.cuDeviceGetName, []string{"cuDeviceGetName"}},
		{&d.cuDeviceGetUuid, []string{"cuDeviceGetUuid_v2", "cuDeviceGetUuid"}},
		{&d.cuDeviceTotalMem, []string{"cuDeviceTotalMem_v2"}},
		{&d.cuDevicePrimaryCtxRetain, []string{"cuDevicePrimaryCtxRetain"}},
		{&d.cuDevicePrimaryCtxRelease_v2, []string{"cuDevicePrimaryCtxRelease_v2"}},
		{&d.cuCtxSetCurrent, []string{"cuCtxSetCurrent"}},
		{&d.cuMemAlloc, []string{"cuMemAlloc_v2"}},
		{&d.cuMemFree, []string{"cuMemFree_v2"}},
		{&d.cuGetErrorName, []string{"cuGetErrorName"}},
	} {
		var addr uintptr
		for _, n := range f.names {
			if a, err := purego.Dlsym(h, n); err == nil {
				addr = a
				break
			}
		}
		if addr == 0 {
			return nil, fmt.Errorf("libcuda has no %s", strings.Join(f.names, " or "))
		}
		purego.RegisterFunc(f.fn, addr)
	}
	return d, nil
}

func (d *driver) Init(flags uint32) cudacheck.Status { return cudacheck.Status(d.cuInit(flags)) }

func (d *driver) DriverGetVersion() (int, cudacheck.Status) {
	var v int32
	s := d.cuDriverGetVersion(&v)
	return int(v), cudacheck.Status(s)
}

func (d *driver) DeviceGetCount() (int, cudacheck.Status) {
	var n int32
	s := d.cuDeviceGetCount(&n)
	return int(n), cudacheck.Status(s)
}

func (d *driver) DeviceGet(ordinal int) (int32, cudacheck.Status) {
	var dev int32
	s := d.cuDeviceGet(&dev, int32(ordinal))
	return dev, cudacheck.Status(s)
}

func (d *driver) DeviceGetName(dev int32) (string, cudacheck.Status) {
	buf := make([]byte, 256)
	s := d.cuDeviceGetName(&buf[0], int32(len(buf)), dev)
	if i := strings.IndexByte(string(buf), 0); i >= 0 {
		buf = buf[:i]
	}
	return string(buf), cudacheck.Status(s)
}

func (d *driver) DeviceGetUUID(dev int32) ([16]byte, cudacheck.Status) {
	uuid := new([16]byte)
	s := d.cuDeviceGetUuid(uuid, dev)
	return *uuid, cudacheck.Status(s)
}

func (d *driver) DeviceTotalMem(dev int32) (uint64, cudacheck.Status) {
	var n uint64
	s := d.cuDeviceTotalMem(&n, dev)
	return n, cudacheck.Status(s)
}

func (d *driver) PrimaryCtxRetain(dev int32) (uintptr, cudacheck.Status) {
	var ctx uintptr
	s := d.cuDevicePrimaryCtxRetain(&ctx, dev)
	return ctx, cudacheck.Status(s)
}

func (d *driver) PrimaryCtxRelease(dev int32) cudacheck.Status {
	return cudacheck.Status(d.cuDevicePrimaryCtxRelease_v2(dev))
}

func (d *driver) CtxSetCurrent(ctx uintptr) cudacheck.Status {
	return cudacheck.Status(d.cuCtxSetCurrent(ctx))
}

func (d *driver) MemAlloc(bytes uint64) (uint64, cudacheck.Status) {
	var p uint64
	s := d.cuMemAlloc(&p, bytes)
	return p, cudacheck.Status(s)
}

func (d *driver) MemFree(ptr uint64) cudacheck.Status { return cudacheck.Status(d.cuMemFree(ptr)) }

func (d *driver) ErrorName(s cudacheck.Status) string {
	var p *byte
	if d.cuGetErrorName(int32(s), &p) != 0 || p == nil {
		return ""
	}
	return cString(p)
}

// cString copies a NUL-terminated C string.
func cString(p *byte) string {
	n := 0
	for *(*byte)(unsafe.Add(unsafe.Pointer(p), n)) != 0 {
		n++
	}
	return string(unsafe.Slice(p, n))
}
