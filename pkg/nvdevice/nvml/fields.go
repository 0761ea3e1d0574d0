//go:build cgo && linux

package nvml

import (
	"encoding/binary"
	"math"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/go-logr/logr"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

// A GPU's readings that NVML gives as field values are read in one
// nvmlDeviceGetFieldValues call a pass (NVML itself makes one driver call
// per distinct source among them), where they took a call each: the power
// draw and the PCIe byte counters every pass, the enforced power limit, the
// ECC counts and the row remapping state on a full pass. A field NVML
// refuses is read by its own call, as before (readGPUTelemetry): a driver
// without the field, or without the function, loses no reading.

// gpuField is one field a pass reads, and where its value goes; set nil for
// the PCIe counters, which give a rate across passes (pcieRates).
type gpuField struct {
	id   uint32
	slow bool
	set  func(s *nvdevice.TelemetrySample, v float64)
}

var gpuFields = []gpuField{
	// NVML_FI_DEV_POWER_AVERAGE is nvmlDeviceGetPowerUsage's figure on
	// Ampere (but GA100) and later: the draw averaged over a second.
	{id: nvml.FI_DEV_POWER_AVERAGE, set: func(s *nvdevice.TelemetrySample, v float64) { s.PowerWatts = nvdevice.Read(v / 1000) }},
	{id: nvml.FI_DEV_PCIE_COUNT_TX_BYTES},
	{id: nvml.FI_DEV_PCIE_COUNT_RX_BYTES},
	// The enforced limit (nvmlDeviceGetEnforcedPowerLimit), milliwatts.
	{id: nvml.FI_DEV_POWER_CURRENT_LIMIT, slow: true, set: func(s *nvdevice.TelemetrySample, v float64) { s.PowerLimitWatts = nvdevice.Read(v / 1000) }},
	{id: nvml.FI_DEV_ECC_SBE_VOL_TOTAL, slow: true, set: func(s *nvdevice.TelemetrySample, v float64) { s.ECCVolatileCorrected = nvdevice.Read(v) }},
	{id: nvml.FI_DEV_ECC_DBE_VOL_TOTAL, slow: true, set: func(s *nvdevice.TelemetrySample, v float64) { s.ECCVolatileUncorrected = nvdevice.Read(v) }},
	{id: nvml.FI_DEV_ECC_SBE_AGG_TOTAL, slow: true, set: func(s *nvdevice.TelemetrySample, v float64) { s.ECCAggregateCorrected = nvdevice.Read(v) }},
	{id: nvml.FI_DEV_ECC_DBE_AGG_TOTAL, slow: true, set: func(s *nvdevice.TelemetrySample, v float64) { s.ECCAggregateUncorrected = nvdevice.Read(v) }},
	{id: nvml.FI_DEV_REMAPPED_COR, slow: true, set: func(s *nvdevice.TelemetrySample, v float64) { s.RemappedRowsCorrectable = nvdevice.Read(v) }},
	{id: nvml.FI_DEV_REMAPPED_UNC, slow: true, set: func(s *nvdevice.TelemetrySample, v float64) { s.RemappedRowsUncorrectable = nvdevice.Read(v) }},
	{id: nvml.FI_DEV_REMAPPED_PENDING, slow: true, set: func(s *nvdevice.TelemetrySample, v float64) { s.RemapPending = nvdevice.Read(min(v, 1)) }},
	{id: nvml.FI_DEV_REMAPPED_FAILURE, slow: true, set: func(s *nvdevice.TelemetrySample, v float64) { s.RemapFailure = nvdevice.Read(min(v, 1)) }},
}

// fieldsRead are the field ids a pass got a value of.
type fieldsRead map[uint32]bool

// all says whether every one of ids was read.
func (r fieldsRead) all(ids ...uint32) bool {
	for _, id := range ids {
		if !r[id] {
			return false
		}
	}
	return true
}

// pcieCount is a GPU's PCIe byte counters as one pass read them, and when
// (microseconds since the epoch).
type pcieCount struct {
	tx, rx uint64
	at     int64
}

// readFields reads the GPU's fields in one call (the slow ones too when
// slow), sets the readings they give and the PCIe rates since the previous
// pass, and says which fields it read; none when the call failed.
func (b *Backend) readFields(logger logr.Logger, uuid string, dev nvml.Device, slow bool, s *nvdevice.TelemetrySample) fieldsRead {
	var asked []gpuField
	for _, f := range gpuFields {
		if slow || !f.slow {
			asked = append(asked, f)
		}
	}
	values := make([]nvml.FieldValue, len(asked))
	for i, f := range asked {
		values[i].FieldId = f.id
	}
	if !b.hasSymbol(symFieldValues) || !field(logger, dev.GetFieldValues(values), "field values") {
		return nil
	}
	read := fieldsRead{}
	var count pcieCount
	for i, f := range asked {
		v := values[i]
		if v.FieldId != f.id || !field(logger, nvml.Return(v.NvmlReturn), "field "+fieldName(f.id)) {
			continue
		}
		n, ok := fieldUint(v)
		if !ok {
			logger.V(4).Info("Telemetry reading unsupported", "field", fieldName(f.id), "valueType", v.ValueType)
			continue
		}
		read[f.id] = true
		switch f.id {
		case nvml.FI_DEV_PCIE_COUNT_TX_BYTES:
			count.tx, count.at = n, max(count.at, v.Timestamp)
		case nvml.FI_DEV_PCIE_COUNT_RX_BYTES:
			count.rx, count.at = n, max(count.at, v.Timestamp)
		default:
			f.set(s, float64(n))
		}
	}
	if read.all(nvml.FI_DEV_PCIE_COUNT_TX_BYTES, nvml.FI_DEV_PCIE_COUNT_RX_BYTES) {
		if count.at <= 0 { // a driver that stamps no time: the pass's
			count.at = int64(microseconds(b.now()))
		}
		prev, had := b.pass.pcie[uuid]
		b.pass.pcie[uuid] = count
		if had {
			s.PCIeTXBytesPerSecond, s.PCIeRXBytesPerSecond = pcieRates(prev, count)
		}
	}
	return read
}

// pcieRates are the bytes per second each way between two readings of a
// GPU's PCIe counters; unsupported when a counter went back (the GPU was
// reset or the driver reloaded, or a counter narrower than 64 bits wrapped:
// nvml.h says they can) or no time passed. The next pass counts from now.
func pcieRates(prev, now pcieCount) (tx, rx nvdevice.Reading) {
	seconds := float64(now.at-prev.at) / 1e6
	if seconds <= 0 || now.tx < prev.tx || now.rx < prev.rx {
		return nvdevice.Reading{}, nvdevice.Reading{}
	}
	return nvdevice.Read(float64(now.tx-prev.tx) / seconds), nvdevice.Read(float64(now.rx-prev.rx) / seconds)
}

// fieldUint is a field's value as an unsigned integer (every field read
// here is a count, milliwatts or a flag); false for a negative value or a
// type NVML did not define.
func fieldUint(v nvml.FieldValue) (uint64, bool) {
	le := binary.LittleEndian
	switch nvml.ValueType(v.ValueType) {
	case nvml.VALUE_TYPE_DOUBLE:
		f := math.Float64frombits(le.Uint64(v.Value[:]))
		return uint64(f), f >= 0 && !math.IsNaN(f)
	case nvml.VALUE_TYPE_UNSIGNED_INT:
		return uint64(le.Uint32(v.Value[:])), true
	case nvml.VALUE_TYPE_UNSIGNED_LONG, nvml.VALUE_TYPE_UNSIGNED_LONG_LONG:
		return le.Uint64(v.Value[:]), true
	case nvml.VALUE_TYPE_SIGNED_LONG_LONG:
		n := int64(le.Uint64(v.Value[:]))
		return uint64(n), n >= 0
	case nvml.VALUE_TYPE_SIGNED_INT:
		n := int32(le.Uint32(v.Value[:]))
		return uint64(n), n >= 0
	case nvml.VALUE_TYPE_UNSIGNED_SHORT:
		return uint64(le.Uint16(v.Value[:])), true
	}
	return 0, false
}

// fieldName names a field id in the logs.
func fieldName(id uint32) string {
	switch id {
	case nvml.FI_DEV_POWER_AVERAGE:
		return "power average"
	case nvml.FI_DEV_PCIE_COUNT_TX_BYTES:
		return "PCIe TX bytes"
	case nvml.FI_DEV_PCIE_COUNT_RX_BYTES:
		return "PCIe RX bytes"
	case nvml.FI_DEV_POWER_CURRENT_LIMIT:
		return "power limit"
	case nvml.FI_DEV_REMAPPED_COR, nvml.FI_DEV_REMAPPED_UNC, nvml.FI_DEV_REMAPPED_PENDING, nvml.FI_DEV_REMAPPED_FAILURE:
		return "remapped rows"
	}
	return "ECC"
}
