#!/bin/sh
# A stand-in for nvidia-smi (issue 34) in gpudra's simulated driver root
# (pkg/nvdevice/sim: Machine.WriteDriverRoot with DriverStandIns.NvidiaSMI),
# in the spirit of its fake libcuda (fakecuda/libcuda.c): it lists the GPUs
# whose character device (major 195, the GPU's minor) the container has
# under /dev, in PCI bus order, numbered from 0 as the real nvidia-smi
# numbers the GPUs it can see, with the names and UUIDs of the machine's
# device table below (written in by the simulator). Only -L (--list-gpus)
# is supported; no /dev/nvidiactl and no GPU give the real tool's messages
# and exit codes. GPUDRA_FAKECUDA_DEV names another directory than /dev.
dev=${GPUDRA_FAKECUDA_DEV:-/dev}
case "$*" in
-L | --list-gpus) ;;
*)
	echo "nvidia-smi: gpudra's simulated driver supports only -L (--list-gpus)" >&2
	exit 2
	;;
esac
if [ ! -c "$dev/nvidiactl" ]; then
	echo "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure that the latest NVIDIA driver is installed and running."
	exit 9
fi
# The minors of the GPU nodes the container has.
minors=" "
for node in "$dev"/nvidia[0-9]*; do
	[ -c "$node" ] || continue
	set -- $(stat -L -c '%t %T' "$node")
	[ "$((0x$1))" -eq 195 ] || continue
	minors="$minors$((0x$2)) "
done
# The device table: minor, PCI bus id, UUID, memory in bytes, name; in PCI
# bus order.
i=0
while read -r kind minor bus uuid memory name; do
	[ "$kind" = gpu ] || continue
	case "$minors" in
	*" $minor "*) ;;
	*) continue ;;
	esac
	echo "GPU $i: $name (UUID: $uuid)"
	i=$((i + 1))
done <<'GPUDRA_DEVICE_TABLE'
@TABLE@
GPUDRA_DEVICE_TABLE
if [ "$i" -eq 0 ]; then
	echo "No devices were found"
	exit 6
fi
