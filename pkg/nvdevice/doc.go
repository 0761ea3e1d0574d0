// Package nvdevice is gpudra's one model of the GPUs on a node: full GPUs, MIG
// profiles with their memory-slice placements, existing MIG devices, NVLink
// topology and domains, and health events.
//
// Every consumer (the kubelet plugin, the slice builder, the CLI) reads the
// node through the small interfaces defined here. Two backends implement them:
// nvml (the real driver, the only cgo package) and sim (faithful simulated
// machines for tests and the demo).
package nvdevice
