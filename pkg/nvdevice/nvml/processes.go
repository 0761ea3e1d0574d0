//go:build cgo && linux

package nvml

import (
	"math"
	"slices"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/go-logr/logr"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

// notAvailable is NVML_VALUE_NOT_AVAILABLE (-1) as an unsigned long long:
// what usedGpuMemory holds when NVML cannot say (without the privilege to
// see another container's processes, under some hypervisors).
const notAvailable = math.MaxUint64

// readProcesses lists the compute processes on a GPU or a MIG device (its
// own handle), MPS clients included when mps (the MPS list is read only
// then), one entry per PID. With a GPU (perProcessSM), each process's SM
// utilization is averaged over the samples NVML kept since the previous
// pass; NVML samples none per MIG device. ProcessesRead stays false unless
// every list asked was read.
func (b *Backend) readProcesses(logger logr.Logger, uuid string, dev nvml.Device, perProcessSM, mps bool, s *nvdevice.TelemetrySample) {
	lists, ok := processLists(logger, dev, mps)
	if !ok {
		return
	}
	s.Processes = mergeProcesses(lists...)
	s.ProcessesRead = true
	if !perProcessSM {
		return
	}
	now := microseconds(b.now())
	if len(s.Processes) == 0 {
		b.pass.procSince[uuid] = now // the next pass's processes started after this
		return
	}
	samples, ret := dev.GetProcessUtilization(b.pass.procSince[uuid])
	switch {
	case ret == nvml.SUCCESS:
	case ret == nvml.ERROR_NOT_FOUND:
		// No sample since then: no process ran a kernel NVML saw.
		samples = nil
	case ret == nvml.ERROR_INSUFFICIENT_SIZE && len(samples) == 0:
		// go-nvml's answer when NVML counted no sample to fetch.
	default:
		field(logger, ret, "process utilization")
		return // the next pass asks from the same time again
	}
	b.pass.procSince[uuid] = now
	avg := averageSMUtilization(samples)
	for i := range s.Processes {
		if v, ok := avg[s.Processes[i].PID]; ok {
			s.Processes[i].SMUtilization = nvdevice.Read(v)
		}
	}
}

// processLists are the device's compute processes, and its MPS clients
// when mps; false when NVML refused a list.
func processLists(logger logr.Logger, dev nvml.Device, mps bool) ([][]nvml.ProcessInfo, bool) {
	compute, ret := dev.GetComputeRunningProcesses()
	if !field(logger, ret, "compute processes") {
		return nil, false
	}
	if !mps {
		return [][]nvml.ProcessInfo{compute}, true
	}
	clients, ret := dev.GetMPSComputeRunningProcesses()
	if !field(logger, ret, "MPS compute processes") {
		return nil, false
	}
	return [][]nvml.ProcessInfo{compute, clients}, true
}

// instanceKey is a MIG device's GPU and compute instance ids.
type instanceKey struct{ gi, ci uint32 }

// noInstance is what NVML gives as a process's instance ids outside MIG
// mode, or to a caller without the privilege to see them.
const noInstance = math.MaxUint32

// readMigProcesses lists the processes of every MIG device of a GPU in MIG
// mode in one call (two with mps) on the GPU's own handle, where asking
// each MIG device took two calls per device: NVML gives a privileged
// caller the GPU's processes with their GPU and compute instance ids. They
// are returned by instance, merged as mergeProcesses does. False when NVML
// refused the list, or gave a process without its instance ids (a caller
// without the privilege): the caller then asks each MIG device.
func readMigProcesses(logger logr.Logger, dev nvml.Device, mps bool) (map[instanceKey][]nvdevice.ProcessSample, bool) {
	lists, ok := processLists(logger, dev, mps)
	if !ok {
		return nil, false
	}
	byInstance := map[instanceKey][][]nvml.ProcessInfo{}
	for li, list := range lists {
		for _, p := range list {
			if p.GpuInstanceId == noInstance || p.ComputeInstanceId == noInstance {
				logger.V(4).Info("MIG processes read per MIG device: the GPU's list gives no instance ids", "pid", p.Pid)
				return nil, false
			}
			k := instanceKey{p.GpuInstanceId, p.ComputeInstanceId}
			per := byInstance[k]
			if per == nil {
				per = make([][]nvml.ProcessInfo, len(lists))
				byInstance[k] = per
			}
			per[li] = append(per[li], p)
		}
	}
	out := make(map[instanceKey][]nvdevice.ProcessSample, len(byInstance))
	for k, per := range byInstance {
		out[k] = mergeProcesses(per...)
	}
	return out, true
}

// mergeProcesses is the compute and the MPS lists as one entry per PID,
// sorted by PID: an MPS server shows in the compute list and its clients in
// the MPS one, and NVML may list a PID in both. A PID's memory is the
// largest figure NVML gave it (the same allocation, not two), unsupported
// when NVML gave none.
func mergeProcesses(lists ...[]nvml.ProcessInfo) []nvdevice.ProcessSample {
	byPID := map[int]*nvdevice.ProcessSample{}
	var out []nvdevice.ProcessSample
	for _, list := range lists {
		for _, p := range list {
			pid := int(p.Pid)
			if _, ok := byPID[pid]; !ok {
				out = append(out, nvdevice.ProcessSample{PID: pid})
				byPID[pid] = nil // filled below, once out stops growing
			}
		}
	}
	slices.SortFunc(out, func(a, b nvdevice.ProcessSample) int { return a.PID - b.PID })
	for i := range out {
		byPID[out[i].PID] = &out[i]
	}
	for _, list := range lists {
		for _, p := range list {
			if p.UsedGpuMemory == notAvailable {
				continue
			}
			mem := &byPID[int(p.Pid)].UsedMemoryBytes
			if v := float64(p.UsedGpuMemory); !mem.Supported || v > mem.Value {
				*mem = nvdevice.Read(v)
			}
		}
	}
	return out
}

// averageSMUtilization is each PID's mean SM utilization (0..1) over its
// samples; NVML gives percent.
func averageSMUtilization(samples []nvml.ProcessUtilizationSample) map[int]float64 {
	sum, n := map[int]float64{}, map[int]int{}
	for _, u := range samples {
		sum[int(u.Pid)] += float64(u.SmUtil)
		n[int(u.Pid)]++
	}
	out := make(map[int]float64, len(sum))
	for pid, v := range sum {
		out[pid] = v / float64(n[pid]) / 100
	}
	return out
}
